"""What the engine knows about a model file before it loads the weights: the header's
shape numbers and the vocabulary's fingerprint (a vocab-only load, milliseconds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.gguf.draft_compat import VocabFacts
from engine.gguf.header import GGUFFacts, read_file_facts
from engine.runtime.kv_cache import TYPE_K, TYPE_V, kv_cache_bytes
from engine.runtime.native import NativeModel
from models.gguf_weights import fingerprint
from models.head_config import TargetFingerprint


@dataclass(frozen=True)
class ModelFacts:
    """What the planner weighs of a target: its size, depth and KV cache."""

    size_bytes: int
    n_layers: int
    kv_bytes: int = 0  # KV cache at the chosen context
    # Whether a verified batch on the GPU equals one-token decoding there (the exactness
    # probe on that placement): if not, no draft is verified by target layers on the GPU.
    exact_on_gpu: bool = True
    # Draft tokens a verification may take back at most (recurrent state's snapshots);
    # None: no limit from the architecture.
    max_draft: int | None = None


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    size_bytes: int
    header: GGUFFacts  # shape numbers (embedding length and block count present)
    n_vocab: int
    fingerprint: TargetFingerprint  # what a draft must match
    eog_ids: frozenset[int]  # tokens that end a generation
    # Why no draft can be taken back on this architecture (recurrent state), None when
    # speculation can run: known before the weights load, so auto measures nothing.
    why_plain: str | None = None
    max_draft: int | None = None  # the architecture's cap on draft tokens per step

    @property
    def n_layer(self) -> int:
        return self.header.n_layers or 0

    @property
    def n_embd(self) -> int:
        return self.header.hidden_size or 0

    def kv_bytes(self, n_ctx: int, type_k: str = TYPE_K, type_v: str = TYPE_V) -> int:
        return kv_cache_bytes(self.header, n_ctx, self.size_bytes, type_k, type_v)

    def planner_facts(self, n_ctx: int, type_k: str = TYPE_K, type_v: str = TYPE_V
                      ) -> ModelFacts:
        return ModelFacts(self.size_bytes, self.n_layer, self.kv_bytes(n_ctx, type_k, type_v),
                          max_draft=self.max_draft)


def read_model_info(path: Path) -> ModelInfo:
    """Raises ModelLoadError (missing, not a GGUF, a header llama.cpp refuses)."""
    path = Path(path)
    header = read_file_facts(path)
    if not header.hidden_size or not header.n_layers:
        raise ModelLoadError(f"{path}: the GGUF header names no embedding length or block "
                             "count for its architecture")
    # A vocab-only load reads the tokenizer, not the shape numbers: those come from the
    # header.
    with NativeModel(path, vocab_only=True) as vocab:
        arch = vocab.architecture()  # decides recurrence; a vocab-only load has it
        return ModelInfo(path=path, size_bytes=path.stat().st_size, header=header,
                         n_vocab=vocab.n_vocab,
                         fingerprint=fingerprint(vocab.pieces(), header.hidden_size),
                         eog_ids=vocab.eog_ids, why_plain=arch.why_plain,
                         max_draft=arch.max_draft or None)


def read_vocab_facts(path: Path) -> VocabFacts:
    """Vocabulary facts of a GGUF file (milliseconds: no weights are read). Raises
    ModelLoadError when it is not a readable GGUF."""
    with NativeModel(path, vocab_only=True) as model:
        return model.vocab_facts()
