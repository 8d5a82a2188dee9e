"""Will a model fit this machine? Weights + draft head + draft model (with its own KV
cache) + KV cache against RAM and VRAM, by the engine's one rule
(``engine.runtime.memory_fit``): the planner places the same model by it, so a "fits on
GPU" label goes with a plan that holds the target, head and draft on the GPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.gguf.header import GGUFFacts
from engine.runtime.kv_cache import kv_cache_bytes
from engine.runtime.memory_fit import draft_need, fits_gpu, fits_ram, head_need, target_need

log = logging.getLogger(__name__)

FITS_GPU = "fits on GPU"
FITS_RAM = "fits in RAM"
TOO_LARGE = "too large"


@dataclass(frozen=True)
class MachineMemory:
    """Memory the machine can give a model, in bytes. ``vram_free`` is None without a GPU."""

    ram_total: int
    ram_available: int
    vram_free: int | None = None


def machine_memory() -> MachineMemory:
    """RAM and the free VRAM of the roomiest GPU, from the engine's one hardware probe.
    Never raises: a failing GPU probe means no GPU."""
    from engine.runtime.hardware import probe_hardware

    hw = probe_hardware()
    gpu = hw.best_gpu
    return MachineMemory(ram_total=hw.ram_total_bytes, ram_available=hw.ram_available_bytes,
                         vram_free=gpu.free_bytes if gpu else None)


@dataclass(frozen=True)
class FitEstimate:
    """The verdict for one model choice and the numbers behind it (bytes)."""

    label: str
    n_weights_bytes: int
    n_head_bytes: int  # what the draft head needs on a device (its margin included)
    n_kv_bytes: int
    n_total_bytes: int  # everything with the margins and llama.cpp's compute buffers
    kv_from_header: bool
    n_draft_bytes: int = 0  # the draft model's weights (with its margin) and own KV cache


def estimate_fit(weights_bytes: int, head_bytes: int, n_ctx: int, facts: GGUFFacts | None,
                 memory: MachineMemory, *, draft_bytes: int = 0,
                 draft_facts: GGUFFacts | None = None) -> FitEstimate:
    """Label a model: "fits on GPU" when everything fits in free VRAM, "fits in RAM" when
    it fits in available RAM, else "too large" (``engine.runtime.memory_fit``'s rule and
    margins). A draft model (``draft_bytes`` > 0) adds its weights and its own KV cache,
    in F16 as the draft-model drafter makes it."""
    n_kv = kv_cache_bytes(facts, n_ctx, weights_bytes)
    n_draft = (draft_need(draft_bytes,
                          kv_cache_bytes(draft_facts, n_ctx, draft_bytes, "f16", "f16"))
               if draft_bytes else 0)
    n_head = head_need(head_bytes)
    total = target_need(weights_bytes, n_kv) + n_head + n_draft
    if memory.vram_free is not None and fits_gpu(total, memory.vram_free):
        label = FITS_GPU
    elif fits_ram(total, memory.ram_available):
        label = FITS_RAM
    else:
        label = TOO_LARGE
    from_header = facts is not None and facts.has_kv_shape
    return FitEstimate(label, weights_bytes, n_head, n_kv, total, from_header, n_draft)


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; for tables and labels."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
