"""The target's settings for one engine: its context and cache types, what the drafter
asked for needs of it (state snapshots to take drafts back, the LM head kept here for an
EAGLE-3 head), the workers' share of its layers, and the CPU kernels that keep verified
batches exact (engine.planning.kernels: probed once per model file, cached)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from engine.drafters.kinds import DrafterKind, Need
from engine.planning.calibration import CalibrationCache
from engine.planning.kernels import KernelChoice, choose_kernels
from engine.planning.machine_load import count_as_own
from engine.planning.memory_plan import check_context_fits
from engine.runtime.hardware import HardwareProfile
from engine.runtime.kv_cache import KV_MODES
from engine.runtime.model_info import ModelInfo
from engine.runtime.target import TargetConfig
from engine.workers.endpoints import listener_pid
from engine.workers.handshake import WorkerInfo
from engine.workers.placement import placement_text, worker_layers


class TargetAsked(Protocol):
    """What the user asked of the target (engine.session.EngineConfig's fields)."""

    drafter: DrafterKind
    kv_cache: str
    flash_attn: bool | None
    workers: tuple[str, ...]
    worker_layers: int | None


def target_settings(asked: TargetAsked, model: ModelInfo, n_ctx: int, n_threads: int,
                    workers: tuple[WorkerInfo, ...], cache_dir: Path,
                    say: Callable[[str], None], notes: list[str],
                    hardware: HardwareProfile | None = None
                    ) -> tuple[TargetConfig, KernelChoice | None]:
    """The target's settings and the kernels chosen for it (None where the model decodes
    plainly anyway); ``workers`` are the probed ``asked.workers``; ``notes`` get where
    the layers run. Raises ContextTooLargeError (naming the context that fits) where the
    target can only run in this machine's RAM and its need at ``n_ctx`` is more than
    the RAM can give."""
    type_k, type_v = KV_MODES[asked.kv_cache]
    if not workers and hardware is not None and not hardware.has_gpu:
        check_context_fits(model, n_ctx, type_k, type_v, hardware.ram_available_bytes,
                           asked.flash_attn)
    config = TargetConfig(n_ctx=n_ctx, n_threads=n_threads, type_k=type_k, type_v=type_v,
                          flash_attn=asked.flash_attn,
                          # No drafts to take back: no state snapshots to pay.
                          state_snapshots=asked.drafter.drafts)
    for endpoint in asked.workers:  # a worker on these cores computes for us
        pid = listener_pid(endpoint)
        if pid is not None:
            count_as_own(pid)
    if workers:
        config = replace(config, workers=asked.workers,
                         worker_layers=worker_layers(model, workers, config,
                                                     asked.worker_layers),
                         output_here=Need.TARGET_LM_HEAD in asked.drafter.needs)
        notes.append(placement_text(model, workers, config))
    # Plain decoding runs on the kernels speculation would use, so an answer does not
    # depend on the drafter (docs/benchmarks.md: exact kernels).
    if model.why_plain is not None:
        return config, None
    kernels = choose_kernels(model.path, config, n_threads, CalibrationCache(cache_dir), say)
    return replace(config, repack=kernels.repack, max_batch=kernels.max_batch), kernels
