"""How far a loaded model's context may grow when attached documents need it: up to the
length the model was trained for, and only as far as the one memory rule
(engine.runtime.memory_fit) lets the larger KV cache fit where the model runs now.

The memory figures are the ones the engine probed before it loaded the model, the same
the planner placed it by. A model split between devices, or with layers on workers,
keeps its context: a larger cache would move layers, which is the planner's call.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.planning.memory_plan import MemoryNeed
from engine.runtime.hardware import HardwareProfile
from engine.runtime.memory_fit import fits_gpu, fits_ram
from engine.runtime.model_info import ModelInfo

STEP = 1024  # contexts are offered in whole KiB of tokens
# Past this a prompt takes minutes to read on a CPU: the best passages serve better.
MAX_GROWN_CTX = 32_768


def largest_context(need: Callable[[int], MemoryNeed], model: ModelInfo,
                    hardware: HardwareProfile, n_ctx: int, n_gpu_layers: int,
                    remote: bool) -> int:
    """The largest context (``n_ctx`` or more) this engine could be reloaded with here.
    ``need(n)``: the whole engine's memory at context ``n`` (engine_memory: the target's
    cache, the F16 context long prompts are read in and its buffers, the drafter and its
    cache), checked against the room probed before this engine loaded."""
    trained = min(model.header.context_length or n_ctx, MAX_GROWN_CTX)
    if remote or trained <= n_ctx or 0 < n_gpu_layers < model.n_layer:
        return n_ctx
    gpu = hardware.best_gpu

    def fits(n: int) -> bool:
        total = need(n).total
        if n_gpu_layers:
            return gpu is not None and fits_gpu(total, gpu.free_bytes)
        return fits_ram(total, hardware.ram_available_bytes)

    sizes = [*range((n_ctx // STEP + 1) * STEP, trained, STEP), trained]
    fitting = [n for n in sizes if fits(n)]
    return max(fitting, default=n_ctx)
