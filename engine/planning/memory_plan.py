"""What an engine's target and drafters take of memory, by part, from the model file's
header and the settings it runs (``engine.runtime.memory_fit``'s rule): shown before a
model loads (``tandem plan``), by a loaded engine (its plan, the dashboard) and checked
against the process's peak by ``tandem bench --long-context``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.drafters.kinds import Need
from engine.errors import ContextTooLargeError
from engine.runtime.memory_fit import (
    CPU_COMPUTE_BYTES,
    DRAFT_MARGIN,
    RAM_HEADROOM,
    MemoryNeed,
    context_memory,
    fits_ram,
    head_need,
)
from engine.runtime.model_info import ModelInfo, read_model_info
from engine.runtime.native_policy import flash_attn_as_asked
from engine.runtime.prompt_weights import prompts_prefer_repacked

if TYPE_CHECKING:
    from engine.drafters.spec import DrafterSpec
    from engine.runtime.target import Target


def target_memory(model: ModelInfo, n_ctx: int, type_k: str, type_v: str, n_batch: int,
                  flash_attn: bool, prefill_in_f16: bool, drafter_bytes: int = 0,
                  prefill_copy: bool = False, on_cpu: bool = True) -> MemoryNeed:
    """A target's need at ``n_ctx`` with these settings. ``prefill_in_f16``: long prompts
    are read in a second, F16 context of the same size, and their cells moved in through
    two buffers (the F16 cells' blob and the converted one: the 1.7B shape's process
    peaked 600 MB above its load at 8k tokens); ``prefill_copy``: that context reads with
    a second copy of the weights (mmapped: its pages count once a prompt touches them)."""
    f16_kv = model.kv_bytes(n_ctx, "f16", "f16") if prefill_in_f16 else 0
    kv = model.kv_bytes(n_ctx, type_k, type_v)
    move = f16_kv + kv if prefill_in_f16 else 0
    return context_memory(
        model.size_bytes * (2 if prefill_copy else 1), kv, prefill_kv_bytes=f16_kv + move,
        n_batch=n_batch, n_ctx=n_ctx, n_heads=model.header.n_heads or 0,
        flash_attn=flash_attn, drafter_bytes=drafter_bytes, on_cpu=on_cpu)


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
                  draft_model: Path | None, n_ctx: int | None = None) -> MemoryNeed:
    """The need of a loaded engine as it runs now (``Engine.model``, ``.target``,
    ``.setup.spec``, ``.config.draft_model``): its target's context and kernels, whether
    long prompts go through the F16 context, and its drafter; at ``n_ctx`` (the same
    engine reloaded with a larger context) where given."""
    c = target.config
    n_ctx = n_ctx or target.n_ctx
    return target_memory(model, n_ctx, c.type_k, c.type_v, c.n_batch,
                         target.flash_attn, target.prompts.f16_off is None,
                         drafter_bytes(spec, draft_model, n_ctx),
                         prefill_copy=target.prompts.f16.prefill_model is not None,
                         on_cpu=not c.n_gpu_layers and not c.workers)


def planned_memory(model: ModelInfo, n_ctx: int, type_k: str, type_v: str,
                   on_cpu: bool = True, n_batch: int = 256, drafter: int = 0,
                   flash_attn: bool | None = None) -> MemoryNeed:
    """The need foreseen before the weights load, by the rules the target will apply:
    without flash attention on the CPU with a Q8_0 K and float V (``choose_flash_attn``; a
    latent-attention model, unknown from the header alone, is counted so too, the larger
    need), where prompts are read in the target's own cache; with it, in the F16 context
    unless the model keeps recurrent state. ``flash_attn``: as asked, None by the rule."""
    flash_attn = flash_attn_as_asked(flash_attn, type_k, type_v, on_cpu, latent_attention=False,
                                     sliding_window=model.header.sliding_window > 0)
    # Without flash attention the F16 context opens only to read with a plain copy of
    # repacked K-quant weights (their prompts' fast layout: engine.runtime.prompt_weights;
    # the target repacks them, the probe allowing, as it does on x86).
    copy = (not flash_attn and model.path.is_file()
            and prompts_prefer_repacked(model.path) is False)
    # Recurrent state (plain-only, or a hybrid's capped drafts) has no cells to move.
    f16_context = ((flash_attn or copy) and model.why_plain is None
                   and model.max_draft is None)
    return target_memory(model, n_ctx, type_k, type_v, n_batch, flash_attn, f16_context,
                         drafter, prefill_copy=copy and f16_context, on_cpu=on_cpu)


# The steps a context is offered in when the one asked for does not fit.
CONTEXT_STEP = 256


def largest_context_that_fits(model: ModelInfo, room: int, type_k: str, type_v: str,
                              on_cpu: bool = True, flash_attn: bool | None = None) -> int:
    """The largest context (a multiple of ``CONTEXT_STEP``, up to the trained length)
    whose need is at most ``room`` bytes; 0 when not even the smallest fits."""
    trained = model.header.context_length or 1 << 20
    lo, hi = 0, trained // CONTEXT_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        need = planned_memory(model, mid * CONTEXT_STEP, type_k, type_v, on_cpu,
                              flash_attn=flash_attn)
        if need.total <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo * CONTEXT_STEP


def check_context_fits(model: ModelInfo, n_ctx: int, type_k: str, type_v: str,
                       available_ram: int, flash_attn: bool | None = None) -> MemoryNeed:
    """The need at ``n_ctx`` on this machine's CPU; raises ContextTooLargeError, naming
    the context that fits, when it is more than the RAM this app may take
    (``memory_fit.fits_ram``): llama.cpp would fail to allocate, or the machine swap."""
    need = planned_memory(model, n_ctx, type_k, type_v, flash_attn=flash_attn)
    if not fits_ram(need.total, available_ram):
        room = int(available_ram * RAM_HEADROOM)
        fits = largest_context_that_fits(model, room, type_k, type_v, flash_attn=flash_attn)
        raise ContextTooLargeError(model.path.name, n_ctx, need.describe(), room, fits)
    return need


def lanes_memory(model: ModelInfo, n_ctx: int, type_k: str, type_v: str, n_lanes: int) -> int:
    """What ``n_lanes`` answers decoded together take beside the engine
    (engine.decoding.parallel): their context holds a whole cache per lane, in the
    target's types, and a compute buffer of its own."""
    return n_lanes * model.kv_bytes(n_ctx, type_k, type_v) + CPU_COMPUTE_BYTES


def lanes_that_fit(model: ModelInfo, n_ctx: int, type_k: str, type_v: str, asked: int,
                   available_ram: int) -> int:
    """The most lanes (at most ``asked``) whose context fits the RAM left after the
    engine loaded (``available_ram``, with the rule's headroom); 0 when not even one."""
    n = asked
    while n > 0 and not fits_ram(lanes_memory(model, n_ctx, type_k, type_v, n), available_ram):
        n -= 1
    return n
