"""Which CPU kernels a model file runs with, and which guarantee that gives.

The first time a model file is used, the exactness probe (engine.runtime.exactness) runs
with llama.cpp's repacked weights, the fast default. On x86 Tandem's build makes every
repacked kernel multiply a batch as one token (packaging/llama-cpp/
batch-invariant-repack.patch), so that is where the probe ends. Where a verified batch
still differs from one-token decoding (other CPUs' repacked GEMMs, from 4 rows, sum in
another order than their one-row GEMV), two exact settings are tried:

- repacked weights with verification batches of at most 3 tokens, which llama.cpp runs
  through the same one-row kernel as a single token (probed with such batches);
- repacking off (one summation order for every batch size).

Where both are exact, the one with the faster expected decoding on this machine is kept
(a few timed batches of each, drafts accepted at a typical rate): the first keeps plain
decoding at llama.cpp's own speed, the second verifies longer drafts. Where none is exact,
the closer setting is kept and the guarantee says so. The verdict is cached with the
calibration, keyed by the file, the build's kernel switches, the KV types and the thread
count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.planning.calibration import CalibrationCache, file_key, measure_verify_curve
from engine.runtime.exactness import ExactnessProbe, probe_exactness
from engine.runtime.native import (
    cpu_build_identity,
    kernel_settings,
    llama_version,
    loaded_cpu_variant,
)
from engine.runtime.target import Target, TargetConfig

EXACT = "identical to plain decoding"
ROUNDED = "the same model, rounded differently: greedy output can differ at near-ties"
PROBE_CTX = 256  # the probe's prompt and answer fit; the kernels do not depend on it
# Repacked weights multiply up to 3 rows with the one-row kernel (ggml-cpu's repack.cpp:
# "more than three rows ... gemm; otherwise gemv"): such batches are probed on their own.
SHORT_BATCH = 3
SHORT_CHAINS = (2, 3, 2, 3, 3, 2, 3, 3, 2, 3, 3, 2)
# The chance that a draft token is accepted, for comparing the exact settings' expected
# speed before any drafter has run (memory drafts and heads land around it on chat).
TYPICAL_ACCEPTANCE = 0.6
SHORT_REPACKED = f"with repacking, at most {SHORT_BATCH} tokens"  # KernelChoice.rates' keys
UNREPACKED = "without repacking"


@dataclass(frozen=True)
class KernelChoice:
    """The settings chosen for a model file, the probe that chose them, and what each
    setting tried gave."""

    repack: bool
    probe: ExactnessProbe
    tried: dict[bool, ExactnessProbe]
    # The largest verification batch kept exact (repacked weights, batches of up to
    # SHORT_BATCH rows); None: any batch.
    max_batch: int | None = None
    short: ExactnessProbe | None = None  # repacked weights with batches of SHORT_BATCH
    # Expected tokens per second of each exact setting that was timed ("repack, batches of
    # at most 3", "no repack"), at TYPICAL_ACCEPTANCE.
    rates: dict[str, float] = field(default_factory=dict)
    # The CPU library probed: a portable build's level ("haswell", "zen4"), or "linked".
    cpu_library: str = ""

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
        switches = ", ".join(f"{name} {_switch_state(on)}" for name, on in s.items())
        text = f"{self.guarantee} ({self.probe.describe()}; kernels: {switches}"
        if self.max_batch is not None:
            text += (f"; at most {self.max_batch} tokens a verification, since repacked "
                     "batches of 4 and more sum in another order")
        if len(self.rates) > 1:
            text += "; expected " + ", ".join(f"{r:.0f} tok/s {name}"
                                              for name, r in self.rates.items())
        if self.cpu_library and self.cpu_library != "linked":
            text += f"; llama.cpp's {self.cpu_library} CPU library"
        return text + ")"

    def to_json(self) -> dict:
        return {"repack": self.repack, "exact": self.exact, "guarantee": self.guarantee,
                "probe": self.probe.to_json(), "kernels": self.settings(),
                "tried": {("repack" if r else "no_repack"): p.to_json()
                          for r, p in self.tried.items()},
                "max_batch": self.max_batch,
                "short": self.short.to_json() if self.short is not None else None,
                "rates": dict(self.rates), "cpu_library": self.cpu_library}

    @classmethod
    def from_json(cls, d: dict) -> KernelChoice:
        tried = {name == "repack": ExactnessProbe.from_json(p)
                 for name, p in d["tried"].items()}
        short = ExactnessProbe.from_json(d["short"]) if d.get("short") else None
        max_batch = d.get("max_batch")
        return cls(bool(d["repack"]), ExactnessProbe.from_json(d["probe"]), tried,
                   int(max_batch) if max_batch is not None else None, short,
                   {str(k): float(v) for k, v in d.get("rates", {}).items()},
                   str(d.get("cpu_library", "")))


def _switch_state(on: object) -> str:
    """"on"/"off", or where a switch is on ("prompts": llamafile's sgemm)."""
    if isinstance(on, str):
        return f"on for {on} only"
    return "on" if on else "off"


def exactness_key(model_path: Path, config: TargetConfig, n_threads: int,
                  n_gpu_layers: int = 0) -> str:
    settings = kernel_settings(True)
    parts = ["exactness", file_key(model_path), llama_version(),
             # The CPU library ggml loaded and the build's bytes: a verdict holds for one
             # instruction-set level of one build (a home shared across CPUs, the source
             # build against the bundle's).
             cpu_build_identity(),
             f"tiled={settings['tiled_matmul'] is True}", f"fusion={settings['fusion']}",
             config.type_k, config.type_v,
             # None: the target's rule (engine.runtime.native_policy.choose_flash_attn).
             f"fa={'rule1' if config.flash_attn is None else config.flash_attn}",
             str(n_threads),
             # Since CPU targets keep every batch on the CPU (TargetConfig.op_offload):
             # verdicts from before, in builds that offload, saw the GPU's batches.
             "ops=cpu",
             # Since short repacked batches are a setting of their own: older verdicts
             # gave repacking up without trying them.
             "short-batches",
             # Since the x86 repacked GEMMs sum like the GEMV (the build's patch): older
             # verdicts turned repacking off where it is now exact.
             "batch-invariant-repack"]
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
    if n_gpu_layers:
        # Repacking is a local CPU matter: a GPU placement is probed once (a workers' one
        # may keep layers or the output here).
        with Target(model_path, probe_config) as target:
            tried[True] = probe_exactness(target)
        choice = KernelChoice(True, tried[True], tried)
    else:
        choice = _choose_cpu_kernels(model_path, probe_config)
    choice = replace(choice, cpu_library=loaded_cpu_variant())
    if cache is not None:
        cache.put_entry(key, choice.to_json())
    return choice


def _choose_cpu_kernels(model_path: Path, config: TargetConfig) -> KernelChoice:
    tried: dict[bool, ExactnessProbe] = {}
    rates: dict[str, float] = {}
    with Target(model_path, replace(config, repack=True)) as target:
        tried[True] = probe_exactness(target)
        if tried[True].exact:
            return KernelChoice(True, tried[True], tried)
        short = probe_exactness(target, chains=SHORT_CHAINS)
        if short.exact:
            rates[SHORT_REPACKED] = _expected_rate(target, (1, 2, SHORT_BATCH))
    with Target(model_path, replace(config, repack=False)) as target:
        tried[False] = probe_exactness(target)
        if tried[False].exact and short.exact:
            rates[UNREPACKED] = _expected_rate(target, (1, 2, 3, 4, 8, 16))
    if short.exact and (not tried[False].exact or rates[SHORT_REPACKED] >= rates[UNREPACKED]):
        return KernelChoice(True, short, tried, SHORT_BATCH, short, rates)
    repack = min(tried, key=lambda r: (tried[r].differing, not r))
    return KernelChoice(repack, tried[repack], tried, None, short, rates)


def _expected_rate(target: Target, sizes: tuple[int, ...],
                   acceptance: float = TYPICAL_ACCEPTANCE) -> float:
    """Tokens per second with the best of these verification sizes (those the target can
    verify), each draft token accepted with ``acceptance`` (a chain of n - 1 drafts yields
    (1 - a^n) / (1 - a) tokens), from a few timed batches over a short context."""
    curve = measure_verify_curve(target, context=64, sizes=sizes, repeats=3)
    return max((1 - acceptance ** n) / (1 - acceptance) / t for n, t in curve.items())
