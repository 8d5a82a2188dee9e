"""``python -m tests.gpu_check --out DIR``: the GPU runbook's first checks, on a machine
with a CUDA build of llama.cpp (docs/gpu.md). Each step writes its figures and verdict to
``DIR/gpu_check.json`` as it ends, so a run cut short keeps what it measured.

1. What the hardware probe sees (GPU, free VRAM, whether llama.cpp offloads).
2. The exactness probe with the target on the GPU and on the CPU: whether a verified
   batch's logits equal one-token decoding's (the lossless contract's premise). The CPU
   placement must be exact; the GPU one may not be, and then the planner must keep
   drafts off it.
3. Greedy lossless (by default on the GPU-resident target): plain decoding's tokens with
   lookup, the head on CUDA and memory drafts, drafts accepted.
4. The verification curve (seconds for a batch of n tokens) on the GPU and on the CPU at
   several thread counts, for the default model and synthetic real shapes.

Every check passes, fails (why) or is skipped because this machine cannot run it (no
GPU, torch without CUDA, a llama.cpp build that cannot offload). The exit code:
``EXIT_PASSED`` (0) when nothing failed and something ran (skips are in the summary),
``EXIT_FAILED`` (1) when anything failed, ``EXIT_NOTHING_RAN`` (3) when nothing failed
because nothing could run here.

``--strict`` (the GPU runbook's mode): a GPU this machine has (torch sees it, or
nvidia-smi lists it) that llama.cpp cannot offload to fails the run. Without it, that is
one more skip and a CUDA build that failed (llama-cpp-python falls back to the CPU) ran
the CPU checks, skipped every GPU one and exited 0. Without a GPU the step is skipped in
both modes: a CPU machine passes as before.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

# libllama before numpy: a llama.cpp built with cmake on the GPU image (2026-11-26)
# segfaulted in init_tokenizer when numpy or torch was loaded first (docs/gpu.md).
import llama_cpp

from engine.runtime.target import Target, TargetConfig

MAX_TOKENS = 48
EXIT_PASSED, EXIT_FAILED, EXIT_NOTHING_RAN = 0, 1, 3
# The Makefile's llama.cpp flags with CUDA added (on an AMX CPU, keep its AMX-safe ones).
REBUILD_WITH_CUDA = (
    "rebuild llama-cpp-python with CUDA: `rm .venv/.installed && .venv/bin/pip uninstall "
    "-y llama-cpp-python && make install "
    "LLAMA_CMAKE_ARGS='-DGGML_CUDA=ON -DGGML_LLAMAFILE=ON -DGGML_RPC=ON'` (add the "
    "Makefile's AMX-safe CPU flags on an AMX CPU; on the device machine `bash "
    "packaging/device/build_cuda.sh cuda`), and read the build log for why CUDA was left out")
NO_OFFLOAD = ("this machine has a GPU but this llama.cpp build cannot offload to it (built "
              "without CUDA, or its CUDA build failed and fell back to the CPU): "
              + REBUILD_WITH_CUDA)
PROFILES = Path(__file__).resolve().parent / "profiles"
# GPU and CPU costs of a large GPU (recorded): verification on the GPU nearly free, the
# layout that would draft there if the planner let it.
GPU_COSTS = PROFILES / "synthetic_costs_large_gpu_1p7b.json"


class Skip(Exception):  # noqa: N818 - a verdict, not an error
    """This machine cannot run the check (no GPU, torch without CUDA, a llama.cpp that
    cannot offload): reported, never a failure."""


@dataclass
class Checks:
    """One step's verdicts, by check name: passed, or failed / skipped with why."""

    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def expect(self, ok: bool, name: str, why: str) -> bool:
        """``name`` passes when ``ok``, else fails with ``why``; returns ``ok``."""
        if ok:
            self.passed.append(name)
        else:
            self.failed[name] = why
        return ok

    def skip(self, name: str, why: str) -> None:
        self.skipped[name] = why


@dataclass(frozen=True)
class StepResult:
    name: str
    status: str  # "passed", "failed: <why>" or "skipped: <why>"
    checks: Checks

    @property
    def failed(self) -> bool:
        return self.status.startswith("failed")

    @property
    def skipped(self) -> bool:
        return self.status.startswith("skipped")


def step_status(checks: Checks, error: str | None = None, skip: str | None = None) -> str:
    """A step's verdict: failed when it raised or any check failed; skipped when it could
    not run here or every check was skipped; else passed (a step with no checks of its
    own, figures only, passes by running)."""
    if error is not None:
        return f"failed: {error}"
    if checks.failed:
        return "failed: " + "; ".join(f"{k}: {v}" for k, v in checks.failed.items())
    if skip is not None:
        return f"skipped: {skip}"
    if checks.skipped and not checks.passed:
        return "skipped: " + "; ".join(f"{k}: {v}" for k, v in checks.skipped.items())
    return "passed"


def summarize(steps: list[StepResult]) -> tuple[int, dict]:
    """The run's exit code and summary: ``EXIT_FAILED`` if any step failed,
    ``EXIT_NOTHING_RAN`` if none failed and none passed (nothing could run here, or
    nothing was asked), else ``EXIT_PASSED``. Skipped checks inside passing steps are
    listed, so "passed" never hides what did not run."""
    failed = {s.name: s.status for s in steps if s.failed}
    skipped = {s.name: s.status for s in steps if s.skipped}
    skipped.update({f"{s.name}: {k}": f"skipped: {v}" for s in steps
                    if not s.failed and not s.skipped for k, v in s.checks.skipped.items()})
    passed = [s.name for s in steps if not s.failed and not s.skipped]
    if failed:
        code, verdict = EXIT_FAILED, f"failed: {', '.join(failed)}"
    elif passed:
        code, verdict = EXIT_PASSED, "passed" + (" (some checks skipped)" if skipped else "")
    else:
        code, verdict = EXIT_NOTHING_RAN, "nothing could run here"
    return code, {"verdict": verdict, "exit_code": code, "passed": passed, "failed": failed,
                  "skipped": skipped}


def _save(out: Path, results: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))


def run_step(out: Path | None, results: dict, name: str,
             fn: Callable[[Checks], dict]) -> StepResult:
    """Run one step: its figures and verdict go to ``results[name]`` (and the file). A step
    that raises fails (with its trace), except ``Skip``; one failing step must not lose
    the others, so nothing propagates."""
    checks, error, skip = Checks(), None, None
    t0 = time.perf_counter()
    try:
        figures = fn(checks)
    except Skip as exc:
        figures, skip = {}, str(exc)
    except Exception as exc:  # noqa: BLE001 - reported as the step's failure
        error = f"{type(exc).__name__}: {exc}"
        figures = {"trace": traceback.format_exc()[-2000:]}
    status = step_status(checks, error, skip)
    results[name] = {"status": status, **figures, "checks": {
        "passed": checks.passed, "failed": checks.failed, "skipped": checks.skipped}}
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    print(f"== {name} ({results['seconds'][name]} s): "
          f"{json.dumps(results[name], default=str)[:1500]}", flush=True)
    if out is not None:
        _save(out, results)
    return StepResult(name, status, checks)


# --- what this machine can run ----------------------------------------------------------
class Here:
    """What this machine offers the checks, probed once."""

    @cached_property
    def hardware(self):  # noqa: ANN201 - HardwareProfile, imported late (numpy after libllama)
        from engine.runtime.hardware import probe_hardware

        return probe_hardware()

    @property
    def gpu_target_skip(self) -> str | None:
        """Why target layers cannot go on a GPU here, or None."""
        if not self.hardware.gpus:
            return "no GPU"
        if not self.hardware.llama_gpu_offload:
            return "llama.cpp build without GPU offload"
        return None

    @cached_property
    def torch_cuda(self) -> bool | None:
        """Whether torch sees a CUDA device; None: no torch."""
        if importlib.util.find_spec("torch") is None:
            return None
        import torch

        return bool(torch.cuda.is_available())

    @property
    def cuda_head_skip(self) -> str | None:
        """Why a head cannot run on CUDA here, or None."""
        if self.torch_cuda is None:
            return "torch is not installed"
        return None if self.torch_cuda else "torch without CUDA"

    @cached_property
    def nvidia_smi_gpus(self) -> list[str]:
        """The GPUs ``nvidia-smi -L`` lists (none without it or its driver): torch may be
        the CPU build the Makefile installs, and still this machine has a GPU."""
        if shutil.which("nvidia-smi") is None:
            return []
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                    timeout=60, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [line.strip() for line in listed.splitlines() if line.startswith("GPU ")]

    @property
    def gpu_seen(self) -> bool:
        return bool(self.torch_cuda or self.nvidia_smi_gpus or self.hardware.gpus)


def hardware(here: Here, checks: Checks) -> dict:
    hw = here.hardware
    checks.passed.append("probe")
    if here.torch_cuda:
        checks.expect(bool(hw.gpus), "probe sees the GPU",
                      "torch sees a CUDA device, the hardware probe saw no GPU")
    return {"probe": hw.to_json(), "torch_cuda": here.torch_cuda,
            "llama_supports_gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}


def gpu_offload_verdict(gpu_seen: bool, offload_supported: bool,
                        strict: bool) -> tuple[str, str]:
    """Whether this machine's llama.cpp can use its GPU: ("passed" | "failed" | "skipped",
    why). No GPU: skipped, in both modes. A GPU llama.cpp cannot offload to: failed when
    ``strict``, else skipped (a CPU build beside a GPU on purpose, as for Dovetail)."""
    if not gpu_seen:
        return "skipped", "no GPU here (torch and nvidia-smi see none): nothing to offload to"
    if offload_supported:
        return "passed", "llama.cpp offloads to this machine's GPU"
    return ("failed" if strict else "skipped"), NO_OFFLOAD


def gpu_offload(here: Here, checks: Checks, strict: bool) -> dict:
    """The verdict above on this machine. llama.cpp's offload is the hardware probe's (a
    local GPU in its device list), not ``llama_supports_gpu_offload()``: that one is true
    in any build with the RPC backend, which the Makefile builds in, CPU-only or not."""
    offload = here.hardware.llama_gpu_offload
    status, why = gpu_offload_verdict(here.gpu_seen, offload, strict)
    if status == "skipped":
        checks.skip("llama.cpp on the GPU", why)
    else:
        checks.expect(status == "passed", "llama.cpp on the GPU", why)
    return {"strict": strict, "torch_cuda": here.torch_cuda,
            "nvidia_smi_gpus": here.nvidia_smi_gpus, "llama_gpu_offload": offload,
            "llama_supports_gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}


# --- offload ------------------------------------------------------------------------------
_BUFFER = re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB")


def model_buffers(model: Path, n_gpu_layers: int) -> dict[str, float]:
    """MiB of weights llama.cpp placed in each buffer type, loading ``model`` with
    ``n_gpu_layers`` (its own "model buffer size" lines: its "offloaded n/m layers" line
    is printed in any build that says it supports offload, the RPC one included)."""
    import ctypes

    from engine.runtime import native

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(_level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    native.ensure_backend()  # it sets the engine's callback: ours goes after it
    # The engine keeps only llama.cpp's last 40 lines, and a load ends with a progress
    # dot per tensor: this load's lines are read through a callback of our own.
    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    try:
        with native.NativeModel(model, n_gpu_layers=n_gpu_layers, repack=False):
            pass
    finally:
        llama_cpp.llama_log_set(native._on_native_log, ctypes.c_void_p(0))
    return {m.group(1): float(m.group(2)) for m in map(_BUFFER.search, lines) if m}


def on_gpu_mib(buffers: dict[str, float]) -> float:
    """Weights in device buffers: not the CPU's (CPU, CPU_Mapped, CPU_REPACK) nor a GPU
    backend's pinned host memory (CUDA_Host)."""
    return sum(mib for name, mib in buffers.items()
               if not name.startswith("CPU") and not name.endswith("_Host"))


def check_offload(model: Path, n_gpu_layers: int, checks: Checks, label: str) -> dict:
    buffers = model_buffers(model, n_gpu_layers)
    checks.expect(on_gpu_mib(buffers) > 0, f"{label}: layers offloaded",
                  f"asked for {n_gpu_layers} GPU layers, llama.cpp put no weights on a "
                  f"device (buffers: {buffers or 'none logged'})")
    return {"buffers_mib": buffers}


# --- exactness ----------------------------------------------------------------------------
def plan_drafts_on_gpu(hw, facts, costs=None) -> list[str]:  # noqa: ANN001
    """The layouts the planner would draft with target layers on the GPU (none may, where
    the GPU placement is inexact), priced on recorded GPU costs with a head on offer."""
    from engine.planning.calibration import CostProfile
    from engine.planning.planner import HeadFacts, choose_plan

    costs = costs or CostProfile.from_json(json.loads(GPU_COSTS.read_text()))
    plan = choose_plan(hw, costs, facts, HeadFacts(250_000_000))
    bad = [f"{c.layout} ({c.drafter}, {c.budget.max_draft} drafts, target layers "
           f"{c.target_gpu_layers})" for c in plan.candidates
           if c.layout == "duodecoding"
           or (c.target_gpu_layers != 0 and c.budget.max_draft > 0)]
    if plan.target_gpu_layers != 0 and plan.budget.max_draft > 0:
        bad.append(f"the plan: {plan.layout_text()}")
    return bad


def check_gpu_plan(model: Path, here: Here, checks: Checks, threads: int) -> dict:
    """The GPU placement was inexact: the planner's own verdict must say so, and its plan
    must verify no draft with target layers on the GPU."""
    from engine.planning.kernels import choose_kernels
    from engine.runtime.model_info import read_model_info

    verdict = choose_kernels(model, TargetConfig(n_ctx=2048), threads, cache=None,
                             n_gpu_layers=-1)
    checks.expect(not verdict.exact, "planner: GPU verdict inexact",
                  "the probe found the GPU placement inexact, the planner's own probe "
                  f"(choose_kernels) called it exact: {verdict.probe.describe()}")
    facts = replace(read_model_info(model).planner_facts(2048), exact_on_gpu=verdict.exact)
    bad = plan_drafts_on_gpu(here.hardware, facts)
    checks.expect(not bad, "planner: no drafts verified on the GPU",
                  "with the GPU placement inexact the planner still drafts there: "
                  + "; ".join(bad))
    return {"planner_exact_on_gpu": verdict.exact, "drafting_on_gpu": bad}


def exactness(model: Path, here: Here, checks: Checks,
              placements: list[tuple[str, int, int]],
              contexts: tuple[int, ...] = (0, 1024),
              chains: tuple[int, ...] | None = None) -> dict:
    """``chains``: the verified chain lengths (default: the probe's, up to 33 tokens)."""
    from engine.runtime.exactness import PROBE_CHAINS, probe_exactness

    out: dict = {}
    for label, gpu_layers, threads in placements:
        if gpu_layers and here.gpu_target_skip:
            checks.skip(f"{label} placement", here.gpu_target_skip)
            continue
        if gpu_layers:
            out[f"{label} offload"] = check_offload(model, gpu_layers, checks, label)
        inexact = []
        for repack in (True, False):
            config = TargetConfig(n_ctx=2048, n_threads=threads, n_gpu_layers=gpu_layers,
                                  repack=repack)
            with Target(model, config) as target:
                for ctx in contexts:
                    probe = probe_exactness(target, chains or PROBE_CHAINS, context=ctx)
                    where = f"{label} repack={repack} ctx={ctx}"
                    out[where] = probe.to_json()
                    if not gpu_layers:  # a CPU-resident target must verify exactly
                        checks.expect(probe.exact, f"{where}: exact", probe.describe())
                    elif not probe.exact:
                        inexact.append(where)
            if gpu_layers:
                break  # repacking is a CPU matter
        if inexact:  # allowed, if no draft is verified there
            out[f"{label} planner"] = check_gpu_plan(model, here, checks, threads)
        elif gpu_layers:
            checks.passed.append(f"{label}: exact")
    return out


# --- lossless -----------------------------------------------------------------------------
def lossless_row(target: Target, build: Callable[[], object], rows: list[dict], plain: dict,
                 checks: Checks, name: str, passes: int = 1) -> dict:
    """Greedy answers with the drafter ``build`` makes, against ``plain``: a difference,
    no draft accepted (on the last pass) or a drafter that fails to build or run fails the
    row."""
    from tests.conftest import drafted_equals_plain

    t0 = time.perf_counter()
    try:
        drafter = build()
        for _ in range(passes):  # memory drafts from what the passes before it wrote
            outs = drafted_equals_plain(target, drafter, rows, plain, MAX_TOKENS)
    except AssertionError as exc:
        checks.expect(False, name, f"drafted answers differ from plain decoding ({exc})")
        return {"identical": False, "where": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one drafter must not lose the others' rows
        checks.expect(False, name, f"{type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    steps = [s for o in outs for s in o.stats.steps]
    accepted = sum(s.n_accepted for s in steps)
    proposed = sum(s.n_proposed for s in steps)
    checks.expect(accepted > 0, name, f"identical, but no draft accepted ({proposed} "
                  "proposed): the check proved nothing")
    return {"identical": True, "seconds": time.perf_counter() - t0, "accepted": accepted,
            "rejected": proposed - accepted}


def lossless(model: Path, prompts: Path, here: Here, checks: Checks, gpu_layers: int = 99,
             threads: int = 8) -> dict:
    from engine.drafters import make_drafter
    from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
    from engine.drafters.memory import MemoryDrafter
    from tests.conftest import pick_per_category, plain_answers

    if gpu_layers and here.gpu_target_skip:
        raise Skip(f"{here.gpu_target_skip} (asked for {gpu_layers} GPU layers)")
    rows = pick_per_category([json.loads(x) for x in prompts.read_text().splitlines()
                              if x.strip()], 1)
    out: dict = {"prompts": len(rows), "max_tokens": MAX_TOKENS, "gpu_layers": gpu_layers,
                 "threads": threads}
    if gpu_layers:
        out["offload"] = check_offload(model, gpu_layers, checks, "target")
    config = TargetConfig(n_ctx=2048, n_threads=threads, n_gpu_layers=gpu_layers)
    with Target(model, config) as target:
        t0 = time.perf_counter()
        plain = plain_answers(target, rows, MAX_TOKENS)
        out["plain_s"] = time.perf_counter() - t0
        out["lookup-tree"] = lossless_row(
            target, lambda: PromptLookupDrafter(LookupConfig(max_branches=3)), rows, plain,
            checks, "lookup-tree")
        for mode in ("chain", "tree"):
            name = f"head-{mode}-cuda"
            if here.cuda_head_skip:
                checks.skip(name, here.cuda_head_skip)
                continue
            out[name] = lossless_row(
                target, lambda m=mode: make_drafter("head", target=target, device="cuda",
                                                    mode=m), rows, plain, checks, name)
        out["memory"] = lossless_row(target, MemoryDrafter, rows[:4], plain, checks,
                                     "memory (second pass)", passes=2)
    return out


# --- verification curves ----------------------------------------------------------------
def verify_curves(model: Path, here: Here, checks: Checks,
                  placements: list[tuple[str, int, int]], context: int = 256) -> dict:
    from engine.planning.calibration import measure_verify_curve

    out = {}
    for label, gpu_layers, threads in placements:
        if gpu_layers and here.gpu_target_skip:
            checks.skip(f"{label} curve", here.gpu_target_skip)
            continue
        config = TargetConfig(n_ctx=context + 128, n_threads=threads, n_gpu_layers=gpu_layers)
        with Target(model, config) as target:
            timings: dict[str, float] = {}
            curve = measure_verify_curve(target, context, repeats=3, timings=timings)
            out[label] = {"verify_s": curve, "prefill_s": timings.get("prefill_s")}
        checks.passed.append(f"{label} curve")
    return out


def synthetic_shape_curves(shape_name: str, workdir: Path, tokenizer_from: Path, here: Here,
                           checks: Checks, placements: list[tuple[str, int, int]]) -> dict:
    from engine.gguf.model_shapes import shape_named
    from engine.gguf.synthetic import write_synthetic_gguf

    shape = shape_named(shape_name)
    path = workdir / f"{shape.name}.gguf"
    workdir.mkdir(parents=True, exist_ok=True)
    write_synthetic_gguf(shape, path, tokenizer_from)
    try:
        out = verify_curves(path, here, checks, placements)
        if not here.gpu_target_skip:  # random weights: its exactness is a figure only
            out["exactness_gpu"] = exactness(path, here, Checks(), [("gpu", 99, 8)],
                                             contexts=(0,))
        return out
    finally:
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--gpu-layers", type=int, default=99, help="the target's, for step 3")
    p.add_argument("--steps", default="exactness,lossless,verify", help="which steps to run")
    p.add_argument("--no-hardware", action="store_true", help="skip the hardware probe")
    p.add_argument("--strict", action="store_true",
                   help="fail when this machine has a GPU that llama.cpp cannot offload to "
                        "(the GPU runbook's mode; a CPU machine passes)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/gpu-check"))
    p.add_argument("--model", type=Path, default=None,
                   help="the target (default: the bundled model's Q4_0); the synthetic "
                        "shapes take its tokenizer")
    args = p.parse_args(argv)
    from engine.hub.model_store import bundled_model_path, default_model_path

    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or default_model_path()
    tokenizer_from = args.model or bundled_model_path()
    results: dict = {"model": str(model), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    here = Here()
    # The CPU placement takes the machine's cores, up to the 16 the runbook measured.
    cores = min(16, os.cpu_count() or 1)
    cpu_and_gpu = [("gpu", 99, 8), (f"cpu{cores}", 0, cores)]
    curves = [("gpu", 99, 8)] + [(f"cpu{n}", 0, n) for n in (16, 8, 4) if n <= cores]
    steps: list[StepResult] = []

    def step(name: str, fn: Callable[[Checks], dict]) -> None:
        steps.append(run_step(args.out, results, name, fn))

    if not args.no_hardware:
        step("hardware", lambda c: hardware(here, c))
    # Always, so --strict holds with --no-hardware too; skipped where there is no GPU.
    step("gpu offload", lambda c: gpu_offload(here, c, args.strict))
    asked = args.steps.split(",")
    if "exactness" in asked:
        step("exactness", lambda c: exactness(model, here, c, cpu_and_gpu))
    if "lossless" in asked:
        step("lossless", lambda c: lossless(model, args.prompts, here, c, args.gpu_layers))
    if "verify" in asked:
        step("verify_default", lambda c: verify_curves(model, here, c, curves))
    for name in filter(None, args.shapes.split(",")):
        step(f"shape {name}", lambda c, n=name: synthetic_shape_curves(
            n, args.workdir, tokenizer_from, here, c, curves))
    code, results["summary"] = summarize(steps)
    _save(args.out, results)
    for name, why in results["summary"]["failed"].items():
        print(f"!! {name}: {why}", file=sys.stderr)
    print(f"== gpu_check: {results['summary']['verdict']} (exit {code})", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
