"""Drafting with an EAGLE-3 head run by llama.cpp (an ``eagle3`` GGUF; docs/eagle3-notes.md).

The target exports the inputs of three of its layers for every token it evaluates (its
features, ``Target.set_feature_layers``). The head runs in its own llama.cpp context,
borrowing the target's token embedding and LM head where its file leaves them out:
- encode: fc fuses each token's three layer inputs into one vector g;
- decode: entry j is (token j+1, g_j) at position j, in the head's own KV cache; its
  output row scores token j+2, and its pre-norm vector stands in for the next g when the
  head drafts on from its own guess.

The head's cache holds the committed entries (built from the target's true features); a
draft adds entries built from the head's own vectors, which the next ``accept`` removes
before it appends the entries of what the target committed. The last committed entry is
decoded with its output on, so a draft starts from scores already there (one decode less
per step). A draft is a greedy chain, stopped when the next token's path probability
cannot repay a level's time, with the next likeliest first tokens beside its first.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.drafters.base import Drafter
from engine.errors import ClosedError, IncompatibleDraftError
from engine.gguf.draft_compat import mismatches
from engine.runtime.draft_tree import DraftTree
from engine.runtime.native import NativeContext, NativeExtBatch, NativeModel

if TYPE_CHECKING:
    from engine.runtime.target import Target

HEAD_BATCH = 64  # rows the head encodes or decodes per call


@dataclass(frozen=True)
class Eagle3Config:
    depth: int = 6  # tokens drafted at most per step
    p_min: float = 0.05  # stop before a token whose path probability is below this
    prompt_features: int = 16  # prompt tokens the head reads the features of
    # First tokens proposed: the chain's, and the next likeliest as siblings of it (from
    # the same scores, no extra level; the budget keeps those likely enough to pay).
    first_candidates: int = 3
    dynamic_depth: bool = True  # stop when the next level cannot repay its time

    def __post_init__(self) -> None:
        if self.depth < 1 or self.prompt_features < 1 or self.first_candidates < 1:
            raise ValueError("depth, prompt_features and first_candidates must be >= 1")
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError(f"p_min must be in [0, 1), got {self.p_min!r}")


def check_eagle3_head(head: NativeModel, target: Target) -> tuple[int, ...]:
    """The target layers the head reads; raises IncompatibleDraftError naming what does
    not fit (not an eagle3 file, layers the target lacks, another width or vocabulary)."""
    name = head.path.name
    arch = head.architecture().name
    if arch != "eagle3":
        raise IncompatibleDraftError(name, [("architecture", arch, "eagle3")])
    found: list[tuple[str, object, object]] = []
    layers = head.target_layer_ids()
    n_layer = target.model.n_layer
    if len(layers) != 3 or not all(0 <= i < n_layer for i in layers):
        found.append(("target layers", list(layers), f"three of 0..{n_layer - 1}"))
    hidden = head.metadata("eagle3.target_hidden_size")
    if hidden is None or int(hidden) != target.n_embd:
        found.append(("target hidden size", hidden, target.n_embd))
    if head.n_embd != target.n_embd:  # it embeds tokens with the target's matrix
        found.append(("hidden size", head.n_embd, target.n_embd))
    if head.n_vocab != target.n_vocab:
        found.append(("vocabulary size", head.n_vocab, target.n_vocab))
    else:
        found += mismatches(head.vocab_facts(), target.model.vocab_facts())
    if found:
        raise IncompatibleDraftError(name, found)
    return layers


def _softmax_top(logits: np.ndarray, k: int, ids: np.ndarray | None = None
                 ) -> list[tuple[int, float]]:
    """The ``k`` best tokens and their probabilities, best first. ``ids``: the only
    tokens the head scores (its draft vocabulary; the rest of the row is -inf), so the
    work follows the head's vocabulary, not the target's (0.5 ms a level at 49152)."""
    scores = logits if ids is None else logits[ids]
    if k == 1:
        top = np.array([int(scores.argmax())])
    else:
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top])]
    best = float(scores[top[0]])
    total = float(np.exp(scores - best).sum(dtype=np.float64))
    tokens = top if ids is None else ids[top]
    return [(int(t), float(np.exp(float(scores[i]) - best) / total))
            for t, i in zip(tokens, top, strict=True)]


def draft_vocabulary_ids(path: Path) -> np.ndarray | None:
    """The target ids an eagle3 head with its own vocabulary scores (its ``d2t``)."""
    from gguf import GGUFReader

    for tensor in GGUFReader(str(path)).tensors:
        if tensor.name == "d2t":
            return np.asarray(tensor.data, dtype=np.int64).copy()
    return None


class Eagle3Drafter(Drafter):
    name = "eagle3"
    needs_features = True
    is_draft_model = True

    def __init__(self, path: Path, target: Target, config: Eagle3Config | None = None,
                 n_gpu_layers: int = 0) -> None:
        """Raises ModelLoadError (the file cannot load) or IncompatibleDraftError (it is
        not a head for this target), before any decode; the target is left as it was."""
        self.config = config or Eagle3Config()
        self.path = Path(path)
        self.target = target
        self.prompt_features = self.config.prompt_features
        self.model = NativeModel(self.path, n_gpu_layers=n_gpu_layers)
        self.ctx: NativeContext | None = None
        self.batch: NativeExtBatch | None = None
        try:
            self.layers = check_eagle3_head(self.model, target)
            self._draft_ids = draft_vocabulary_ids(self.path)
            # F16 K and V: drafts need not match any batch size bit for bit.
            self.ctx = NativeContext(self.model, n_ctx=target.n_ctx, n_batch=HEAD_BATCH,
                                     n_seq_max=1, n_threads=target.n_threads,
                                     embeddings=False, type_k="f16", type_v="f16",
                                     ctx_other=target.ctx)
            self.ctx.enable_next_vectors()
            self.batch = NativeExtBatch(self.ctx)
            target.set_feature_layers(self.layers)
        except BaseException:
            self.close()
            raise
        self.n_embd = self.model.n_embd
        self._tokens: list[int] = []  # the context, the last token included
        self._n_cached = 0  # committed entries end at this position (head cache)
        self._first = 0  # position of the head cache's first entry
        # The last committed entry's output: the first draft tokens with their
        # probabilities, best first, and the head's vector to draft on from.
        self._seed: tuple[list[tuple[int, float]], np.ndarray] | None = None
        self._level_s = 0.0
        self._t_draft_s = 0.0
        self._n_draft_calls = 0
        self._n_levels = 0

    # --- the drafter lifecycle -----------------------------------------------------------
    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        if features is None:
            raise ValueError("the eagle3 drafter needs the target's features")
        ctx = self._context()
        ctx.kv_clear()
        prompt_len = len(context) - 1
        first = prompt_len - len(features)  # the first prompt token with features
        self._tokens = list(context)
        self._first = self._n_cached = first
        self._seed = None
        self._append(first, features, context[first + 1:])

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        if features is None:
            raise ValueError("the eagle3 drafter needs the target's features")
        n = len(self._tokens) - 1  # position of the token whose features come first
        self._tokens += new_tokens
        self._append(n, features, list(new_tokens))

    def draft(self, max_tokens: int, token_time_s: float) -> DraftTree:
        tree = DraftTree()
        if max_tokens <= 0 or self._seed is None:
            return tree
        t0 = time.perf_counter()
        candidates, vector = self._seed
        (token, path_p), siblings = candidates[0], candidates[1:]
        ctx, cfg = self._context(), self.config
        pos = self._n_cached  # the first draft entry's position
        depth_max = min(max_tokens, cfg.depth)
        while True:
            if path_p < cfg.p_min:
                break
            tree.add(token, len(tree) - 1, path_p)
            if len(tree) >= depth_max or not self._level_pays(path_p, token_time_s):
                break
            t_level = time.perf_counter()
            batch = self._fresh_batch()
            batch.add_token(token, vector, pos, output=True)
            ctx.process(batch, encode=False)
            pos += 1
            token, p = _softmax_top(ctx.logits_view(1)[0], 1, self._draft_ids)[0]
            vector = ctx.next_vectors(1)[0]
            path_p *= p
            took = time.perf_counter() - t_level
            self._level_s = took if self._level_s == 0 else 0.8 * self._level_s + 0.2 * took
            self._n_levels += 1
        for sibling, p in siblings[:max_tokens - len(tree)] if tree else ():
            if p >= cfg.p_min:
                tree.add(sibling, -1, p)
        self._t_draft_s += time.perf_counter() - t0
        self._n_draft_calls += 1
        return tree

    def stats(self) -> dict[str, float]:
        calls = max(1, self._n_draft_calls)
        return {"draft_ms_per_call": 1000 * self._t_draft_s / calls,
                "head_levels_per_call": self._n_levels / calls,
                "level_ms": 1000 * self._level_s}

    def close(self) -> None:
        target = getattr(self, "target", None)
        if target is not None and self.ctx is not None:
            with contextlib.suppress(ClosedError):  # a closed target needs nothing back
                target.set_feature_layers(())
        for owner in ("batch", "ctx", "model"):
            handle = getattr(self, owner, None)
            if handle is not None:
                handle.close()

    # --- the head's cache ------------------------------------------------------------------
    def _context(self) -> NativeContext:
        if self.ctx is None:
            raise ClosedError(f"eagle3 head {self.path.name}")
        return self.ctx

    def _fresh_batch(self) -> NativeExtBatch:
        assert self.batch is not None
        self.batch.clear()
        return self.batch

    def _level_pays(self, path_p: float, token_time_s: float) -> bool:
        """Whether drafting one more token can repay a level's time (dynamic depth)."""
        return not (self.config.dynamic_depth and self._level_s > 0 and token_time_s > 0
                    and path_p * token_time_s < self._level_s)

    def _append(self, first: int, features: np.ndarray, next_tokens: list[int]) -> None:
        """Drop the last draft's entries, then add the committed entries (features of the
        tokens at ``first``.., each with the token after it); the last one's output
        becomes the next draft's start."""
        ctx = self._context()
        ctx.kv_remove(0, self._n_cached, -1)
        features = np.asarray(features, np.float32)
        n = min(len(features), len(next_tokens))
        if n == 0:
            self._seed = None
            return
        fused = self._encode(features[:n], first)
        for start in range(0, n, HEAD_BATCH):
            stop = min(n, start + HEAD_BATCH)
            batch = self._fresh_batch()
            for j in range(start, stop):
                batch.add_token(next_tokens[j], fused[j], first + j, output=j == n - 1)
            ctx.process(batch, encode=False)
        self._n_cached = first + n
        self._seed = (_softmax_top(ctx.logits_view(1)[0], self.config.first_candidates,
                                   self._draft_ids), ctx.next_vectors(1)[0])

    def _encode(self, features: np.ndarray, first: int) -> np.ndarray:
        """fc over each row of three layer inputs: [n, n_embd]."""
        ctx, out = self._context(), []
        for start in range(0, len(features), HEAD_BATCH):
            rows = features[start:start + HEAD_BATCH]
            batch = self._fresh_batch()
            for j, row in enumerate(rows):
                batch.add_vector(row, first + start + j)
            ctx.process(batch, encode=True)
            out.append(ctx.next_vectors(len(rows)))
        return np.concatenate(out)
