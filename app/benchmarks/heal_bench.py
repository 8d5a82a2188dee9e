"""The healing benchmark (``tandem bench --heal``): a plan made on a busy machine, then
answers on the quiet one.

1. The engine starts (``auto``, costs measured now) while another llama.cpp process
   decodes on the same cores (``app.benchmarks.background_load``): its costs are provisional.
2. The load stops; the same engine answers the prompts. Each answer's drafter, speed and
   tokens per verification are recorded, with the plan in force after it.
3. A quiet start with its own fresh cache gives the quiet plan, and answers the same
   prompts (the speeds to heal towards).
4. A second start with the busy start's cache, on the quiet machine: it measures again.

Nothing here is a test: it prints a table and writes JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.benchmarks.background_load import BackgroundDecode
from engine.decoding.generation import GenerationConfig
from engine.drafters.kinds import DrafterKind
from engine.hub.model_store import default_model_path
from engine.planning.calibration import CostProfile
from engine.session import Engine, EngineConfig


def _costs(costs: CostProfile | None) -> dict[str, Any]:
    if costs is None:
        return {}
    curve = costs.verify_s.get("cpu", {})
    t1 = curve.get(1, 0.0)
    return {"t1_ms": round(t1 * 1000, 2),
            "ratios": {n: round(t / t1, 2) for n, t in sorted(curve.items()) if t1 and n > 1},
            "head_level_ms": {d: round(v * 1000, 2) for d, v in costs.head_level_s.items()},
            "conditions": costs.conditions(), "provisional": costs.provisional}


def _plan(engine: Engine) -> dict[str, Any]:
    plan = engine.plan
    assert plan is not None
    return {"layout": plan.layout_text(), "runs": plan.runs,
            "predicted_speedup": round(plan.predicted_speedup, 3),
            "costs": _costs(engine.costs)}


def _answer(engine: Engine, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    ran = engine.drafter_name
    engine.target.reset(cold=True)
    result = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens))
    s = result.stats
    return {"ran": ran, "tok_per_s": round(s.tok_per_s, 1),
            "tokens_per_verification": round(s.mean_accepted, 2),
            # The drafter the plan runs now; "none": no plan (a drafter asked by name).
            "plan_after": engine.plan.runs if engine.plan else "none",
            "check": engine.plan_check.last_verdict if engine.plan_check else ""}


def run_heal_bench(base: EngineConfig, prompts: list[list[int]], max_tokens: int,
                   workdir: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """``prompts`` as chat tokens; ``base`` names the model and threads. Caches and
    memories live under ``workdir``."""
    model = base.model_path or default_model_path()
    threads = base.n_threads or 2
    busy_config = replace(base, drafter=DrafterKind.AUTO, recalibrate=True,
                          cache_dir=workdir / "busy", memory_dir=workdir / "busy-memory",
                          model_path=model)
    say("starting under load (another llama.cpp process decoding)")
    with BackgroundDecode(model, threads):
        engine = Engine(busy_config)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": str(model),
                           "threads": engine.n_threads, "max_tokens": max_tokens}
    try:
        out["busy_plan"] = _plan(engine)
        answers = []
        for i, prompt in enumerate(prompts):
            say(f"answer {i + 1} of {len(prompts)} on the quiet machine")
            answers.append(_answer(engine, prompt, max_tokens))
        out["answers"] = answers
        out["changes"] = [c.why for c in engine.plan_check.changes] if engine.plan_check \
            else []
    finally:
        engine.close()
    say("a quiet start with its own cache (the quiet plan)")
    with Engine(replace(busy_config, cache_dir=workdir / "quiet",
                        memory_dir=workdir / "quiet-memory")) as quiet:
        out["quiet_plan"] = _plan(quiet)
        out["quiet_answers"] = [_answer(quiet, p, max_tokens) for p in prompts]
    say("starting again with the busy start's cache, on the quiet machine")
    with Engine(replace(busy_config, recalibrate=False)) as again:
        out["next_start"] = {**_plan(again), "measured_again": again.calibrated_now}
    quiet_runs = out["quiet_plan"]["runs"]
    healed = next((i + 1 for i, a in enumerate(out["answers"]) if a["ran"] == quiet_runs),
                  None)
    out["healed_at_answer"] = healed
    return out


def format_heal(out: dict[str, Any]) -> str:
    lines = [f"busy start:  {out['busy_plan']['layout']} "
             f"(predicted {out['busy_plan']['predicted_speedup']:.2f}x; "
             f"one token {out['busy_plan']['costs']['t1_ms']} ms)",
             f"quiet start: {out['quiet_plan']['layout']} "
             f"(predicted {out['quiet_plan']['predicted_speedup']:.2f}x; "
             f"one token {out['quiet_plan']['costs']['t1_ms']} ms)",
             "", f"{'answer':>6}  {'ran':<12} {'tok/s':>7} {'tau':>5}   "
             f"{'quiet plan':<12} {'tok/s':>7} {'tau':>5}"]
    for i, (a, q) in enumerate(zip(out["answers"], out["quiet_answers"], strict=True)):
        lines.append(f"{i + 1:>6}  {a['ran']:<12} {a['tok_per_s']:>7.1f} "
                     f"{a['tokens_per_verification']:>5.2f}   {q['ran']:<12} "
                     f"{q['tok_per_s']:>7.1f} {q['tokens_per_verification']:>5.2f}")
    healed = out["healed_at_answer"]
    lines += ["", f"healed: the quiet plan's drafter ran from answer {healed}"
              if healed else "healed: not within these answers",
              f"next start: {out['next_start']['layout']} "
              f"(measured again: {out['next_start']['measured_again']})"]
    return "\n".join(lines)
