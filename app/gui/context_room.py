"""How far a loaded model's context may grow when attached documents need it: up to the
length the model was trained for, and only as far as the one memory rule
(engine.runtime.memory_fit) lets the larger KV cache fit where the model runs now.

The memory figures are the ones the engine probed before it loaded the model, the same
the planner placed it by. A model split between devices, or with layers on workers,
keeps its context: a larger cache would move layers, which is the planner's call.
"""

from __future__ import annotations

from engine.planning.memory_plan import planned_memory
from engine.runtime.hardware import HardwareProfile
from engine.runtime.kv_cache import KV_MODES
from engine.runtime.memory_fit import fits_gpu, fits_ram
from engine.runtime.model_info import ModelInfo

STEP = 1024  # contexts are offered in whole KiB of tokens
# Past this a prompt takes minutes to read on a CPU: the best passages serve better.
MAX_GROWN_CTX = 32_768


def largest_context(model: ModelInfo, hardware: HardwareProfile, kv_cache: str,
                    n_ctx: int, n_gpu_layers: int, remote: bool) -> int:
    """The largest context (``n_ctx`` or more) this model could be reloaded with here."""
    trained = min(model.header.context_length or n_ctx, MAX_GROWN_CTX)
    if remote or trained <= n_ctx or 0 < n_gpu_layers < model.n_layer:
        return n_ctx
    type_k, type_v = KV_MODES.get(kv_cache, KV_MODES["exact"])
    gpu = hardware.best_gpu

    def fits(n: int) -> bool:
        need = planned_memory(model, n, type_k, type_v, on_cpu=not n_gpu_layers).total
        if n_gpu_layers:
            return gpu is not None and fits_gpu(need, gpu.free_bytes)
        return fits_ram(need, hardware.ram_available_bytes)

    sizes = [*range((n_ctx // STEP + 1) * STEP, trained, STEP), trained]
    fitting = [n for n in sizes if fits(n)]
    return max(fitting, default=n_ctx)
