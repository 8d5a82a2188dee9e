"""Each CPU library of a portable llama.cpp build, checked on this CPU (``tandem check-cpu``).

The packaged build ships one CPU library per instruction-set level, and ggml loads the best
one a processor runs: most laptops run the AVX2 (haswell) one, whatever machine the bundle
was built and tested on. So each level this CPU can run is loaded in turn, in a process of
its own (``TANDEM_CPU_VARIANT``), and checked for what the lossless contract rests on:
- the repacked kernels and the attention kernel sum a row inside a batch as they sum it
  alone (bit for bit);
- the exactness probe on Q4_0, Q4_K_M, Q6_K and IQ4_XS copies of the bundled weights, and
  the kernel settings it keeps (repacking off, or short batches, where a level is not
  batch-invariant: the plan then says so);
- a drafted answer on those settings equals plain decoding's, with drafts accepted and
  rejected (two memories of the answer, each wrong at other places).

A build that links its CPU backend in (``make install``'s) is checked once, as "linked".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

WEIGHT_TYPES = ("q4_0", "q4_k_m", "q6_k", "iq4_xs")
PROMPT = ("Copy this list exactly, then add one more fruit of your own: apples, pears, "
          "plums, cherries, figs, dates, grapes, lemons.")
N_ANSWER = 32
CHILD_TIMEOUT_S = 600


@dataclass
class ModelCheck:
    weight_type: str
    exact: bool = False  # the kept kernel settings passed the probe
    verdict: str = ""  # KernelChoice.describe()
    repack: bool = True
    max_batch: int | None = None
    differing_with_repack: int = 0  # probe positions that differed with repacking on
    drafted_equals_plain: bool = False
    accepted: int = 0
    rejected: int = 0
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error) or not (self.exact and self.drafted_equals_plain
                                        and self.accepted > 0 and self.rejected > 0)


@dataclass
class LevelCheck:
    level: str  # "haswell", "zen4"...; "linked" for a build with one CPU backend
    status: str = "checked"  # or "not runnable on this CPU", or what went wrong
    loaded: str = ""  # what the process really ran, read back from its memory map
    kernels: list[dict] = field(default_factory=list)  # repack_check.KernelCheck's
    models: list[ModelCheck] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def runnable(self) -> bool:
        return self.status != "not runnable on this CPU"

    @property
    def failed(self) -> bool:
        if not self.runnable:
            return False
        return (self.status != "checked" or self.loaded != self.level
                or any(k["status"] in ("differs", "far") for k in self.kernels)
                or not self.models or any(m.failed for m in self.models))

    @classmethod
    def from_json(cls, d: dict) -> LevelCheck:
        models = [ModelCheck(**m) for m in d.pop("models", [])]
        return cls(**d, models=models)


def prepare_models(source: Path, folder: Path, n_threads: int,
                   types: tuple[str, ...] = WEIGHT_TYPES,
                   say: Callable[[str], None] = lambda _: None) -> dict[str, Path]:
    """The bundled weights (Q4_0) as each of ``types``, requantized from an F32 copy
    (made once in ``folder``, and only when a type asks for it)."""
    from engine.hub.convert import convert, quantize_as

    unknown = sorted(set(types) - set(WEIGHT_TYPES))
    if unknown:
        raise ValueError(f"no check for {', '.join(unknown)}: the types checked are "
                         f"{', '.join(WEIGHT_TYPES)}")
    folder.mkdir(parents=True, exist_ok=True)
    made = {"q4_0": source} if "q4_0" in types else {}
    f32 = folder / "weights.F32.gguf"
    for weight_type in (t for t in types if t != "q4_0"):
        path = folder / f"weights.{weight_type.upper()}.gguf"
        if not path.is_file():
            if not f32.is_file():
                say("an F32 copy of the bundled weights")
                convert(source, f32, "f32", n_threads)
            say(f"requantizing to {weight_type.upper()}")
            quantize_as(f32, path, weight_type, n_threads)
        made[weight_type] = path
    return made


def perturbed(tokens: list[int], every: int, shift: int, n_vocab: int) -> list[int]:
    """``tokens`` with every ``every``-th one changed: a memory that is right in runs."""
    return [t if (i + 1) % every else (t + shift) % n_vocab for i, t in enumerate(tokens)]


def check_model(weight_type: str, path: Path, n_threads: int) -> ModelCheck:
    """The probe's verdict for this file on the loaded CPU library, and a drafted answer on
    the settings it keeps against plain decoding's."""
    from engine.decoding.budget import VerifyCostModel
    from engine.decoding.generation import GenerationConfig, generate
    from engine.drafters.memory import MemoryDrafter
    from engine.drafters.suffix_index import SuffixIndex
    from engine.planning.kernels import choose_kernels
    from engine.runtime.target import Target, TargetConfig

    check = ModelCheck(weight_type)
    config = TargetConfig(n_ctx=512, n_threads=n_threads)
    choice = choose_kernels(path, config, n_threads, cache=None)
    check.exact, check.verdict = choice.exact, choice.describe()
    check.repack, check.max_batch = choice.repack, choice.max_batch
    if True in choice.tried:
        check.differing_with_repack = choice.tried[True].differing
    config = TargetConfig(n_ctx=512, n_threads=n_threads, repack=choice.repack,
                          max_batch=choice.max_batch)
    with Target(path, config) as target:
        prompt = target.chat_prompt([{"role": "user", "content": PROMPT}])
        plain = generate(target, prompt, None, GenerationConfig(N_ANSWER)).tokens
        memory = SuffixIndex()
        memory.insert(prompt + perturbed(plain, 7, 1, target.n_vocab))
        memory.insert(prompt + perturbed(plain, 5, 2, target.n_vocab))
        target.reset()
        # Every drafted node verified: the batch sizes do not follow this machine's load.
        free = VerifyCostModel(slope=0.0, learn=False)
        out = generate(target, prompt, MemoryDrafter(memory),
                       GenerationConfig(N_ANSWER, max_draft=16), cost=free, remember=False)
    check.drafted_equals_plain = out.tokens == plain
    check.accepted = sum(s.n_accepted for s in out.stats.steps)
    check.rejected = sum(s.n_proposed - s.n_accepted for s in out.stats.steps)
    if out.stats.drafter_failed_in:  # the rest went on plainly: equal tokens prove little
        check.error = out.stats.fallback
    return check


def check_this_process(level: str, models: dict[str, Path], n_threads: int) -> LevelCheck:
    """``level``'s checks on the CPU library this process loaded."""
    from engine.runtime.attention_check import check_loaded_attention
    from engine.runtime.native import loaded_cpu_variant
    from engine.runtime.repack_check import check_loaded_library

    t0 = time.monotonic()
    result = LevelCheck(level, loaded=loaded_cpu_variant())
    result.kernels = [asdict(k) for k in (*check_loaded_library(), *check_loaded_attention())]
    for weight_type, path in models.items():
        try:
            result.models.append(check_model(weight_type, path, n_threads))
        except Exception as exc:  # noqa: BLE001 - reported as this model's failure
            result.models.append(ModelCheck(weight_type, error=f"{type(exc).__name__}: {exc}"))
    result.seconds = round(time.monotonic() - t0, 1)
    return result


def check_level(level: str, models: dict[str, Path], n_threads: int) -> LevelCheck:
    """``level`` checked in a process of its own (ggml loads one CPU library a process);
    a crash is a result, not the end of the check."""
    env = dict(os.environ)
    if level != "linked":
        env["TANDEM_CPU_VARIANT"] = level
    spec = json.dumps({"level": level, "n_threads": n_threads,
                       "models": {k: str(v) for k, v in models.items()}})
    t0 = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-m", "engine.planning.cpu_check", spec],
                             env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return LevelCheck(level, status=f"no result in {CHILD_TIMEOUT_S} s")
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode == 0 and lines:
        return LevelCheck.from_json(json.loads(lines[-1]))
    tail = " ".join(run.stderr.strip().splitlines()[-3:])
    if "this CPU cannot run" in tail:
        return LevelCheck(level, status="not runnable on this CPU")
    why = (f"crashed (signal {-run.returncode})" if run.returncode < 0
           else f"exit {run.returncode}")
    return LevelCheck(level, status=f"{why}: {tail[-300:]}",
                      seconds=round(time.monotonic() - t0, 1))


def levels_to_check() -> list[str]:
    from engine.runtime.native import cpu_variants

    return cpu_variants() or ["linked"]


def table(results: list[LevelCheck]) -> str:
    """A row per level and weight type: the kernels, the probe, the drafted answer."""
    head = ("| CPU library | kernel tests | weights | probe (repack on: positions "
            "differing) | kept | drafted = plain (accepted / rejected) |")
    lines = [head, "|" + "---|" * 6]
    for r in results:
        if not r.runnable or not r.models:
            lines.append(f"| {r.level} | - | - | {r.status} | - | - |")
            continue
        exact = sum(k["status"] == "exact" for k in r.kernels)
        built = sum(k["status"] in ("exact", "differs", "far") for k in r.kernels)
        kernels = f"{exact} of {built} exact" if built else "none built"
        for m in r.models:
            kept = ("repack" if m.repack else "no repack") + (
                f", batches <= {m.max_batch}" if m.max_batch else "")
            probe = (f"exact ({m.differing_with_repack})" if m.exact
                     else f"NOT exact ({m.differing_with_repack})")
            drafted = ("yes" if m.drafted_equals_plain else "**NO**") + (
                f" ({m.accepted} / {m.rejected})")
            if m.error:
                drafted = f"error: {m.error[:80]}"
            lines.append(f"| {r.level} | {kernels} | {m.weight_type.upper()} | {probe} | "
                         f"{kept} | {drafted} |")
    return "\n".join(lines)


def _child(spec: str) -> int:
    d = json.loads(spec)
    models = {k: Path(v) for k, v in d["models"].items()}
    result = check_this_process(d["level"], models, int(d["n_threads"]))
    payload = asdict(result)
    print(json.dumps(payload), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
