"""What a model's architecture lets speculation do: how a rejected draft is taken back,
whether a tree can be verified, whether a long prompt's cells can move between caches,
and whether intermediate layers can be read. One table drives what the engine offers, so
an architecture that cannot roll back decodes plainly (with a note) instead of aborting.

Read from llama.cpp's loaded model (the sliding window, recurrent or hybrid memory) and,
where the C API does not say, from the vendored source (llama-cpp-notes §2-4):
- attention-only caches drop rejected cells (``llama_memory_seq_rm``);
- a sliding-window (iSWA) cache is made full size (``swa_full``, the C default), so a
  rollback never needs a cell the window had already dropped;
- recurrent state cannot drop a partial sequence; a hybrid that llama.cpp gives per-token
  state snapshots (``n_rs_seq``) can take back up to that many tokens, once per decode;
  the rest (Mamba, RWKV, qwen3next...) cannot speculate.
"""

from __future__ import annotations

from dataclasses import dataclass

# llama.cpp's llm_arch_supports_rs_rollback (src/llama-arch.cpp), by GGUF architecture name.
RS_ROLLBACK_ARCHITECTURES = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h",
    "nemotron_h_moe", "lfm2", "lfm2moe", "bailingmoe3"})
# Graphs that can export a layer's input (llama_set_embeddings_layer_inp): the rest
# (Gemma 2/3, Qwen2, Phi-3, Mistral 3...) abort on a GGML_ASSERT if asked.
LAYER_INPUT_ARCHITECTURES = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "gpt-oss", "lfm2", "gemma4"})
# Draft tokens a state snapshot rollback may take back: the context keeps this many
# snapshots of every recurrent layer's state, so memory grows by as many states.
RS_ROLLBACK_TOKENS = 8


@dataclass(frozen=True)
class ArchitectureFacts:
    """One loaded model's architecture, as speculation sees it."""

    name: str  # GGUF general.architecture
    n_swa: int = 0  # sliding-window size, 0 without one
    recurrent: bool = False  # every layer keeps a state (Mamba, RWKV)
    hybrid: bool = False  # attention layers beside recurrent ones

    @property
    def has_state(self) -> bool:
        return self.recurrent or self.hybrid

    @property
    def rs_rollback(self) -> bool:
        return self.has_state and self.name in RS_ROLLBACK_ARCHITECTURES

    @property
    def rollback(self) -> str:
        """How rejected draft tokens are taken back: the plan shows it."""
        if self.rs_rollback:
            return f"state snapshots (the last {RS_ROLLBACK_TOKENS} tokens)"
        if self.has_state:
            return "none (recurrent state keeps no earlier tokens)"
        if self.n_swa:
            return f"cells dropped (full-size sliding-window cache, window {self.n_swa})"
        return "cells dropped"

    @property
    def can_speculate(self) -> bool:
        return not self.has_state or self.rs_rollback

    @property
    def why_plain(self) -> str | None:
        """Why nothing can be drafted on this architecture, None when it can."""
        if self.can_speculate:
            return None
        return (f"{self.name} keeps a recurrent state that llama.cpp cannot take back a few "
                "tokens at a time, so a rejected draft could not be undone")

    @property
    def trees(self) -> bool:
        """A draft tree puts tokens in several sequences; recurrent state has one per
        sequence, copied whole, and its rollback is one chain's."""
        return not self.has_state

    @property
    def max_draft(self) -> int | None:
        """The longest draft a step may verify, None when the cache sets no limit."""
        return RS_ROLLBACK_TOKENS if self.rs_rollback else (None if self.can_speculate else 0)

    @property
    def why_no_cell_move(self) -> str | None:
        """Why a long prompt cannot be prefilled in an F16 cache and its cells moved here
        (engine.runtime.kv_transfer rewrites KV caches' saved cells, not recurrent state)."""
        if self.recurrent:
            return f"{self.name} keeps a recurrent state, no KV cells to move"
        if self.hybrid:
            return f"{self.name} keeps recurrent state beside its KV cache"
        return None

    @property
    def layer_inputs(self) -> bool:
        """Whether an EAGLE-3-style head can read intermediate layers."""
        return self.name in LAYER_INPUT_ARCHITECTURES

    def describe(self) -> str:
        """One line for ``tandem plan``."""
        if not self.can_speculate:
            return f"{self.name}; decodes plainly: {self.why_plain}"
        shape = "chains only" if not self.trees else "chains and trees"
        limit = f", at most {self.max_draft} draft tokens" if self.max_draft else ""
        return f"{self.name}; drafts verified as {shape}{limit}; rollback: {self.rollback}"

    def table(self) -> dict[str, object]:
        """The capability table a plan or ``tandem plan --json`` shows."""
        return {"architecture": self.name, "sliding_window": self.n_swa,
                "memory": ("hybrid" if self.hybrid else "recurrent" if self.recurrent
                           else "sliding-window KV" if self.n_swa else "KV"),
                "speculation": self.can_speculate, "rollback": self.rollback,
                "trees": self.trees, "max_draft": self.max_draft,
                "f16_prefill": self.why_no_cell_move is None,
                "layer_inputs": self.layer_inputs}
