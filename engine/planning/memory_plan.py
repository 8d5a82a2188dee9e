"""What an engine's target and drafters take of memory, by part, from the model file's
header and the settings it runs (``engine.runtime.memory_fit``'s rule): shown before a
model loads (``tandem plan``), by a loaded engine (its plan, the dashboard) and checked
against the process's peak by ``tandem bench --long-context``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.drafters.kinds import Need
from engine.runtime.memory_fit import DRAFT_MARGIN, MemoryNeed, context_memory, head_need
from engine.runtime.model_info import ModelInfo, read_model_info

if TYPE_CHECKING:
    from engine.drafters.spec import DrafterSpec
    from engine.runtime.target import Target


def target_memory(model: ModelInfo, n_ctx: int, type_k: str, type_v: str, n_batch: int,
                  flash_attn: bool, prefill_in_f16: bool, drafter_bytes: int = 0
                  ) -> MemoryNeed:
    """A target's need at ``n_ctx`` with these settings (``prefill_in_f16``: long prompts
    are read in a second, F16 context of the same size)."""
    return context_memory(
        model.size_bytes, model.kv_bytes(n_ctx, type_k, type_v),
        prefill_kv_bytes=model.kv_bytes(n_ctx, "f16", "f16") if prefill_in_f16 else 0,
        n_batch=n_batch, n_ctx=n_ctx, n_heads=model.header.n_heads or 0,
        flash_attn=flash_attn, drafter_bytes=drafter_bytes)


def drafter_bytes(spec: DrafterSpec, draft_model: Path | None, n_ctx: int) -> int:
    """What a drafter holds beside the target: a draft model's weights and F16 cache, a
    head's weights (torch's or llama.cpp's); nothing for drafts from text."""
    needs = spec.kind.needs
    if Need.DRAFT_GGUF in needs and draft_model is not None and draft_model.is_file():
        info = read_model_info(draft_model)
        return int(info.size_bytes * DRAFT_MARGIN) + info.kv_bytes(n_ctx, "f16", "f16")
    head = spec.head_dir
    if head is not None and head.exists() and (Need.HEAD_DIR in needs
                                               or Need.EAGLE3_GGUF in needs):
        files = [head] if head.is_file() else [p for p in head.rglob("*") if p.is_file()]
        return head_need(sum(p.stat().st_size for p in files))
    return 0


def engine_memory(model: ModelInfo, target: Target, spec: DrafterSpec,
                  draft_model: Path | None) -> MemoryNeed:
    """The need of a loaded engine as it runs now (``Engine.model``, ``.target``,
    ``.setup.spec``, ``.config.draft_model``): its target's context and kernels, whether
    long prompts go through the F16 context, and its drafter."""
    c = target.config
    return target_memory(model, target.n_ctx, c.type_k, c.type_v, c.n_batch,
                         target.flash_attn, target.prompts.f16_off is None,
                         drafter_bytes(spec, draft_model, target.n_ctx))
