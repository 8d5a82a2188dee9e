"""Drafting with an EAGLE-3 head run by llama.cpp (an ``eagle3`` GGUF; docs/eagle3-notes.md).

The target exports the inputs of three of its layers for every token it evaluates (its
features, ``Target.set_feature_layers``). The head runs in its own llama.cpp context,
borrowing the target's token embedding and LM head where its file leaves them out:
- encode: fc fuses each token's three layer inputs into one vector g;
- decode: entry j is (token j+1, g_j) at position j, in the head's own KV cache; its
  output row scores token j+2, and its pre-norm vector stands in for the next g when the
  head drafts on from its own guess.
The drafting loop and the head's cache are ``engine.drafters.native_head``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.drafters.kinds import DrafterKind
from engine.drafters.native_head import (
    HEAD_BATCH,
    HeadChainConfig,
    NativeHandle,
    NativeHeadDrafter,
)
from engine.errors import DrafterUnavailableError, IncompatibleDraftError
from engine.gguf.draft_compat import mismatches
from engine.gguf.eagle3 import EAGLE3_ARCHITECTURE
from engine.gguf.header import read_tensor_infos
from engine.runtime.native import NativeContext, NativeExtBatch, NativeModel

if TYPE_CHECKING:
    from engine.runtime.target import Target


def check_eagle3_head(head: NativeModel, target: NativeModel,
                      shape: tuple[int, int] | None = None) -> tuple[int, ...]:
    """The target layers the head reads; raises IncompatibleDraftError naming what does
    not fit (not an eagle3 file, layers the target lacks, another width or vocabulary).
    ``shape``: the target's (layers, hidden size) when ``target`` is a vocabulary-only
    load, which carries neither; the head must be loaded whole (its layer ids)."""
    name = head.path.name
    arch = head.architecture().name
    if arch != EAGLE3_ARCHITECTURE:
        raise IncompatibleDraftError(name, [("architecture", arch, EAGLE3_ARCHITECTURE)])
    found: list[tuple[str, object, object]] = []
    layers = head.target_layer_ids()
    n_layer, n_embd = shape or (target.n_layer, target.n_embd)
    if len(layers) != 3 or not all(0 <= i < n_layer for i in layers):
        found.append(("target layers", list(layers), f"three of 0..{n_layer - 1}"))
    hidden = head.metadata("eagle3.target_hidden_size")
    if hidden is None or int(hidden) != n_embd:
        found.append(("target hidden size", hidden, n_embd))
    if head.n_embd != n_embd:  # it embeds tokens with the target's matrix
        found.append(("hidden size", head.n_embd, n_embd))
    if head.n_vocab != target.n_vocab:
        found.append(("vocabulary size", head.n_vocab, target.n_vocab))
    else:
        found += mismatches(head.vocab_facts(), target.vocab_facts())
    if found:
        raise IncompatibleDraftError(name, found)
    return layers


# d2t's ggml integer types (GGML_TYPE_I8..I64) as numpy's.
_INT_TYPES = {24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64}


def draft_vocabulary_ids(path: Path) -> np.ndarray | None:
    """The target ids an eagle3 head with its own vocabulary scores (its ``d2t``), read
    from where the tensor table says it lies."""
    table = read_tensor_infos(path)
    if table is None:
        return None
    start, infos = table
    for t in infos:
        if t.name == "d2t" and t.ggml_type in _INT_TYPES:
            return np.fromfile(path, dtype=_INT_TYPES[t.ggml_type], count=t.n_elements,
                               offset=start + t.offset).astype(np.int64)
    return None


class Eagle3Drafter(NativeHeadDrafter):
    name = kind = DrafterKind.EAGLE3

    def __init__(self, path: Path, target: Target, config: HeadChainConfig | None = None,
                 n_gpu_layers: int = 0) -> None:
        """Raises ModelLoadError (the file cannot load) or IncompatibleDraftError (it is
        not a head for this target), before any decode; the target is left as it was."""
        if target.output_on_workers:
            # llama.cpp aborts building the head's graph over a tensor in an RPC buffer.
            raise DrafterUnavailableError(
                target.path.name, "an EAGLE-3 head", "the head shares the target's "
                "embeddings and LM head, which run on the workers (a target opened for it "
                "keeps its output here)")
        super().__init__(target, config)
        self.path = Path(path)
        self.model = NativeModel(self.path, n_gpu_layers=n_gpu_layers)
        try:
            self.layers = check_eagle3_head(self.model, target.model)
            self._draft_ids = draft_vocabulary_ids(self.path)
            # F16 K and V: drafts need not match any batch size bit for bit.
            self.ctx = NativeContext(self.model, n_ctx=target.n_ctx, n_batch=HEAD_BATCH,
                                     n_seq_max=1, n_threads=target.n_threads,
                                     features=False, type_k="f16", type_v="f16",
                                     ctx_other=target.ctx)
            self.ctx.enable_next_vectors()
            self.batch = NativeExtBatch(self.ctx)
            target.set_feature_layers(self.layers)
        except BaseException:
            self.close()
            raise
        self.n_embd = self.model.n_embd

    @property
    def label(self) -> str:
        return f"eagle3 head {self.path.name}"

    def _owned(self) -> tuple[NativeHandle | None, ...]:
        return (*super()._owned(), self.model)  # the head's file after its context

    def _release_target(self, target: Target) -> None:
        target.set_feature_layers(())

    def _entries(self, first: int, features: np.ndarray) -> tuple[np.ndarray, int]:
        """fc over each row of three layer inputs: [n, n_embd]; entry j sits at the
        position of the token whose features it holds."""
        ctx, out = self._context(), []
        for start in range(0, len(features), HEAD_BATCH):
            rows = features[start:start + HEAD_BATCH]
            batch = self._fresh_batch()
            for j, row in enumerate(rows):
                batch.add_vector(row, first + start + j)
            ctx.process(batch, encode=True)
            out.append(ctx.next_vectors(len(rows)))
        return np.concatenate(out), first
