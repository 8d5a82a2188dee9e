"""Drafting with the target's own next-token (MTP) block, which Qwen3.5/3.6, GLM-4.5+,
DeepSeek and others ship inside their GGUF: a draft that costs no download
(docs/mtp-notes.md has what the vendored llama.cpp does, call by call).

- The target is loaded with its MTP weights (``Target(load_mtp=...)``) and exports, for
  every token of every batch, its normed last hidden state h (llama.cpp's unmasked
  next-token rows, ``Target.set_next_features``).
- The block runs in a second llama.cpp context of type MTP over the same model: entry p
  is (token p, h of token p-1) at position p in its own KV cache (one layer, no recurrent
  state, so any suffix can be dropped); its output scores token p+1 and its own h feeds
  the next draft level.
Correctness never depends on the block: the target verifies every token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.drafters.kinds import DrafterKind
from engine.drafters.native_head import HEAD_BATCH, HeadChainConfig, NativeHeadDrafter
from engine.errors import DrafterUnavailableError
from engine.runtime.native import NativeContext, NativeExtBatch

if TYPE_CHECKING:
    from engine.runtime.native import NativeModel
    from engine.runtime.target import Target

# Architectures whose llama.cpp MTP graph Tandem has read and runs: one block, its output
# vector exported for every row (handled by ``last_entry_alone``), tested on a synthetic
# file of each layout (qwen35, glm4moe, deepseek2). Others with MTP graphs (step35,
# mimo2...) are refused with that reason until checked.
MTP_ARCHITECTURES = frozenset({"qwen35", "qwen35moe", "glm4moe", "deepseek2"})


def why_no_mtp_block(arch: str, n_blocks: int) -> str | None:
    """Why a file of ``arch`` with ``n_blocks`` next-token blocks (its header says both)
    cannot draft with them, None when it can."""
    if not n_blocks:
        return "the GGUF has no next-token (MTP) layers"
    if arch not in MTP_ARCHITECTURES:
        return f"{n_blocks} MTP block(s), but MTP drafting is not supported for {arch} yet"
    if n_blocks != 1:
        return f"{n_blocks} MTP blocks (one is supported)"
    return None


def why_no_mtp(model: NativeModel, arch: str) -> str | None:
    """Why this loaded model cannot draft with its MTP block, None when it can."""
    why = why_no_mtp_block(arch, model.n_layer_nextn)
    if why is None and not model.mtp_loaded:
        return "the model was loaded without its MTP layers"
    return why


class MtpDrafter(NativeHeadDrafter):
    name = kind = DrafterKind.MTP
    last_entry_alone = True

    def __init__(self, target: Target, config: HeadChainConfig | None = None) -> None:
        """Raises DrafterUnavailableError (no usable MTP block) or ModelLoadError (no
        memory for its context), before any decode; the target is left as it was."""
        super().__init__(target, config)
        why = why_no_mtp(target.model, target.arch.name)
        if why is None and not target.arch.can_speculate:
            why = target.arch.why_plain
        if why is not None:
            raise DrafterUnavailableError(target.path.name, "its MTP block", why)
        try:
            # F16 K and V: drafts need not match any batch size bit for bit.
            self.ctx = NativeContext(target.model, n_ctx=target.n_ctx, n_batch=HEAD_BATCH,
                                     n_seq_max=1, n_threads=target.n_threads,
                                     features=False, type_k="f16", type_v="f16", mtp=True)
            self.ctx.enable_next_vectors()
            self.batch = NativeExtBatch(self.ctx)
            target.set_next_features(True)
        except BaseException:
            self.close()
            raise

    @property
    def label(self) -> str:
        return f"MTP block of {self.target.path.name}"

    def _release_target(self, target: Target) -> None:
        target.set_next_features(False)

    def _entries(self, first: int, features: np.ndarray) -> tuple[np.ndarray, int]:
        """The target's h of the tokens at ``first``.. as they are: each pairs with the
        token after it, at that token's position."""
        return features, first + 1
