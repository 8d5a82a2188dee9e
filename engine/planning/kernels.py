"""Which CPU kernels a model file runs with, and which guarantee that gives.

The first time a model file is used, the exactness probe (engine.runtime.exactness) runs
with llama.cpp's repacked weights, the fast default; where a verified batch then differs
from one-token decoding it runs again with repacking off (one summation order for every
batch size on the K-quants). The first setting that is exact is kept; where none is, the
closer one is kept and the guarantee says so. The verdict is cached with the calibration,
keyed by the file, the build's kernel switches, the KV types and the thread count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from engine.planning.calibration import CalibrationCache, file_key
from engine.runtime.exactness import ExactnessProbe, probe_exactness
from engine.runtime.native import kernel_settings, llama_version
from engine.runtime.target import Target, TargetConfig

EXACT = "identical to plain decoding"
ROUNDED = "the same model, rounded differently: greedy output can differ at near-ties"
PROBE_CTX = 256  # the probe's prompt and answer fit; the kernels do not depend on it


@dataclass(frozen=True)
class KernelChoice:
    """The settings chosen for a model file, the probe that chose them, and what each
    setting tried gave."""

    repack: bool
    probe: ExactnessProbe
    tried: dict[bool, ExactnessProbe]

    @property
    def exact(self) -> bool:
        return self.probe.exact

    @property
    def guarantee(self) -> str:
        return EXACT if self.exact else ROUNDED

    def settings(self) -> dict[str, object]:
        return kernel_settings(self.repack)

    def describe(self) -> str:
        s = self.settings()
        switches = ", ".join(f"{name} {'on' if on else 'off'}" for name, on in s.items())
        return f"{self.guarantee} ({self.probe.describe()}; kernels: {switches})"

    def to_json(self) -> dict:
        return {"repack": self.repack, "exact": self.exact, "guarantee": self.guarantee,
                "probe": self.probe.to_json(), "kernels": self.settings(),
                "tried": {("repack" if r else "no_repack"): p.to_json()
                          for r, p in self.tried.items()}}

    @classmethod
    def from_json(cls, d: dict) -> KernelChoice:
        tried = {name == "repack": ExactnessProbe.from_json(p)
                 for name, p in d["tried"].items()}
        return cls(bool(d["repack"]), ExactnessProbe.from_json(d["probe"]), tried)


def exactness_key(model_path: Path, config: TargetConfig, n_threads: int,
                  n_gpu_layers: int = 0) -> str:
    settings = kernel_settings(True)
    parts = ["exactness", file_key(model_path), llama_version(),
             f"tiled={settings['tiled_matmul']}", f"fusion={settings['fusion']}",
             config.type_k, config.type_v, str(config.flash_attn), str(n_threads),
             # Since CPU targets keep every batch on the CPU (TargetConfig.op_offload):
             # verdicts from before, in builds that offload, saw the GPU's batches.
             "ops=cpu"]
    if n_gpu_layers:  # the CPU's verdicts keep their keys
        parts.append(f"gpu_layers={n_gpu_layers}")
    if config.workers:  # the workers' kernels, probed through them
        parts.append(f"workers={','.join(config.workers)}:{config.worker_layers}:"
                     f"{config.output_here}")
    return "exactness-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


def choose_kernels(model_path: Path, config: TargetConfig, n_threads: int,
                   cache: CalibrationCache | None,
                   progress: Callable[[str], None] | None = None,
                   n_gpu_layers: int = 0) -> KernelChoice:
    """The cached verdict for this file placed with ``n_gpu_layers`` on the GPU (-1: all),
    or the probe run now (and cached). GPU kernels pick another matrix kernel by batch
    size (one token: a vector kernel; more: tiled ones), so a GPU-resident target is
    probed as it will run (an H200 with CUDA: 78 of 80 positions differed, max 2.8)."""
    key = exactness_key(model_path, config, n_threads, n_gpu_layers)
    entry = cache.get_entry(key) if cache is not None else None
    if entry is not None:
        try:
            return KernelChoice.from_json(entry)
        except (KeyError, TypeError, ValueError):
            pass  # an older format: probe again
    if progress is not None:
        where = " on the GPU" if n_gpu_layers else " on the workers" if config.workers else ""
        progress(f"checking that verified batches match one-token decoding{where}")
    tried: dict[bool, ExactnessProbe] = {}
    probe_config = replace(config, n_ctx=min(config.n_ctx, PROBE_CTX), n_threads=n_threads,
                           f16_prefill=False, n_gpu_layers=n_gpu_layers)
    # Repacking is a local CPU matter: a GPU placement is probed once (a workers' one
    # may keep layers or the output here).
    for repack in (True,) if n_gpu_layers else (True, False):
        with Target(model_path, replace(probe_config, repack=repack)) as target:
            tried[repack] = probe_exactness(target)
        if tried[repack].exact:
            break
    repack = min(tried, key=lambda r: (tried[r].differing, not r))
    choice = KernelChoice(repack, tried[repack], tried)
    if cache is not None:
        cache.put_entry(key, choice.to_json())
    return choice
