"""Will a model fit this machine? Weights + draft head + KV cache against RAM and VRAM."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.hub.gguf_header import GGUFFacts

log = logging.getLogger(__name__)

FITS_GPU = "fits on GPU"
FITS_RAM = "fits in RAM"
TOO_LARGE = "too large"

# Tandem runs llama.cpp with a Q8_0 K/V cache: 34 bytes per block of 32 values.
KV_BYTES_PER_ELEM = 34 / 32
# Without header numbers: KV bytes per token ~ sqrt(weight count), a fit to Q8_0 caches of
# grouped-query models (SmolLM2-135M 12 KiB/token, Qwen2.5-7B 30 KiB, Llama-3-8B 68 KiB;
# sqrt gives 11, 82 and 87 KiB). Models without GQA (Llama-2-7B: 272 KiB) are
# underestimated ~3x; their headers carry the real numbers, which are used when read.
KV_BYTES_PER_TOKEN_PER_SQRT_PARAM = 1.0
# Leave room for the OS, the app, llama.cpp's compute buffers and the GPU driver.
RAM_HEADROOM = 0.80
VRAM_HEADROOM = 0.90
COMPUTE_OVERHEAD_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class MachineMemory:
    """Memory the machine can give a model, in bytes. ``vram_free`` is None without a GPU."""

    ram_total: int
    ram_available: int
    vram_free: int | None = None


def machine_memory() -> MachineMemory:
    """RAM from psutil; free VRAM of the first CUDA device when torch sees one. Never
    raises: a failing GPU probe means no GPU."""
    import psutil

    vm = psutil.virtual_memory()
    vram: int | None = None
    try:
        import torch  # lazily: importing torch costs a second, and only this needs it

        if torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info()
            vram = int(free)
    except Exception as exc:  # noqa: BLE001 - a broken driver must not break the wizard
        log.debug("no VRAM figure: %s", exc)
    return MachineMemory(ram_total=int(vm.total), ram_available=int(vm.available),
                         vram_free=vram)


def kv_cache_bytes(facts: GGUFFacts | None, n_ctx: int, weights_bytes: int,
                   bytes_per_elem: float = KV_BYTES_PER_ELEM) -> int:
    """KV cache bytes for ``n_ctx`` tokens: from the GGUF header's layer and head counts
    when known, else estimated from the weights' size (assumes ~4.5 bits per weight)."""
    per_token = facts.kv_bytes_per_token(bytes_per_elem) if facts else None
    if per_token is None:
        n_params = weights_bytes * 8 / 4.5
        per_token = KV_BYTES_PER_TOKEN_PER_SQRT_PARAM * n_params ** 0.5
    return int(per_token * n_ctx)


@dataclass(frozen=True)
class FitEstimate:
    """The verdict for one model choice and the numbers behind it (bytes)."""

    label: str
    n_weights_bytes: int
    n_head_bytes: int
    n_kv_bytes: int
    n_total_bytes: int
    kv_from_header: bool


def estimate_fit(weights_bytes: int, head_bytes: int, n_ctx: int, facts: GGUFFacts | None,
                 memory: MachineMemory) -> FitEstimate:
    """Label a model: "fits on GPU" when everything fits in free VRAM, "fits in RAM" when
    it fits in available RAM, else "too large"; all with headroom for the rest of the
    machine."""
    n_kv = kv_cache_bytes(facts, n_ctx, weights_bytes)
    total = weights_bytes + head_bytes + n_kv + COMPUTE_OVERHEAD_BYTES
    if memory.vram_free is not None and total <= memory.vram_free * VRAM_HEADROOM:
        label = FITS_GPU
    elif total <= memory.ram_available * RAM_HEADROOM:
        label = FITS_RAM
    else:
        label = TOO_LARGE
    from_header = facts is not None and facts.kv_bytes_per_token(1.0) is not None
    return FitEstimate(label, weights_bytes, head_bytes, n_kv, total, from_header)


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; for tables and labels."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
