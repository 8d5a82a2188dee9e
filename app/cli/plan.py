"""``tandem plan``: what this machine runs where, and why (or what a measured profile
leads to); ``--measure-acceptance`` measures the draft head's acceptance by depth."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.cli.common import add_head_args, add_model_args, add_plan_args, open_engine
from app.cli.profile import print_candidates, show_profile_plan
from engine.drafters.kinds import DrafterKind
from engine.runtime.target import Target
from engine.session import loaded_memory


def _measure_acceptance(args: argparse.Namespace, target: Target) -> int:
    """Write the head's acceptance by depth on real prompts next to its weights: the
    planner's prior (the governor corrects it online)."""
    from engine.drafters import DEFAULT_HEAD_DIR
    from engine.planning.calibration import measure_acceptance
    from training.spec_bench import load_prompts

    head_dir = args.draft_head or DEFAULT_HEAD_DIR
    rows = load_prompts(args.measure_acceptance, per_category=2)
    prompts = [target.chat_prompt([{"role": "user", "content": r.turns[0]}]) for r in rows]
    by_depth = measure_acceptance(target, head_dir, prompts)
    out = Path(head_dir) / "acceptance.json"
    out.write_text(json.dumps({"by_depth": [round(a, 4) for a in by_depth],
                               "prompts": str(args.measure_acceptance),
                               "n_prompts": len(prompts), "model": target.path.name},
                              indent=1) + "\n")
    print(f"acceptance by depth: {', '.join(f'{a:.2f}' for a in by_depth)} -> {out}")
    return 0


def _acceptance_arg(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"acceptances must be in [0, 1], got {text!r}")
    return values


def _show_plain(as_json: bool, notes: list[str], kernels, architecture: dict,  # noqa: ANN001
                arch_text: str) -> int:
    """A model auto does not speculate on (an inexact weight type, or a state that cannot
    take a draft back): nothing was measured, and the notes say why."""
    if as_json:
        print(json.dumps({"plan": None, "notes": notes, "architecture": architecture,
                          "exactness": kernels.to_json() if kernels else None}, indent=1))
        return 0
    print("Plan: plain decoding, no drafter.")
    if kernels is not None:
        print(f"Output:   {kernels.describe()}")
    print(f"Model:    {arch_text}")
    for note in notes:
        print(f"  note: {note}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.profile is not None:
        return show_profile_plan(args.profile, args.acceptance, args.json)
    if args.measure_acceptance:
        with open_engine(args, drafter=DrafterKind.NONE) as engine:
            return _measure_acceptance(args, engine.target)
    with open_engine(args, drafter=DrafterKind.AUTO) as engine:
        plan, costs, hardware = engine.plan, engine.costs, engine.hardware
        notes, calibrated_now = engine.notes, engine.calibrated_now
        kv_text = engine.kv_cache_text
        kernels = engine.kernels
        architecture = engine.architecture
        arch_text = engine.target.arch.describe()
        if engine.target.arch.trees and not getattr(engine.target, "trees", True):
            arch_text = arch_text.replace("chains and trees",
                                          "chains only (no flash attention on this CPU)")
        status = engine.plan_status()
        workers = engine.workers
        memory = loaded_memory(engine)
    if plan is None or costs is None:  # nothing to weigh: this model decodes plainly
        return _show_plain(args.json, notes, kernels, architecture, arch_text)
    if args.json:
        print(json.dumps({"plan": plan.to_json(), "costs": costs.to_json(),
                          "hardware": hardware.to_json(), "notes": notes,
                          "kv_cache": kv_text,
                          "exactness": kernels.to_json() if kernels else None,
                          "architecture": architecture, "status": status,
                          "memory": memory.parts() if memory else None,
                          "workers": [w.describe() for w in workers]},
                         indent=1))
        return 0
    print(plan.describe())
    print(kv_text[:1].upper() + kv_text[1:] + ". --kv-cache exact|fast chooses.")
    if kernels is not None:
        print(f"Output:   {kernels.describe()}")
    print(f"Model:    {arch_text}")
    if memory is not None:
        print(f"Memory:   {memory.describe()}")
    for worker in workers:
        print(f"Worker:   {worker.describe()}")
    cached = "measured now" if calibrated_now else "cached; --recalibrate measures again"
    t1 = costs.verify_s.get("cpu", {}).get(1)
    if status is not None and status["last_change"]:
        print(f"Planned:  {status['last_change']}")
    curve = ", ".join(f"{n}: {t / t1:.2f}x" for n, t in sorted(costs.verify_s["cpu"].items())
                      if n > 1) if t1 else ""
    print(f"\nCosts ({cached}): {costs.conditions()}")
    if t1:
        print(f"  target, one token: {t1 * 1000:.1f} ms; n tokens, relative: {curve}")
    for dev, lvl in costs.head_level_s.items():
        print(f"  draft head on {dev}: {lvl * 1000:.2f} ms per level, "
              f"{costs.head_update_s[dev] * 1000:.2f} ms per step to read accepted tokens")
    for dev, tok in costs.draft_token_s.items():
        print(f"  draft model on the {dev.upper()}: {tok * 1000:.2f} ms per token, "
              f"{costs.draft_sync_s.get(dev, 0) * 1000:.2f} ms per step to catch up")
    for dev, lvl in costs.eagle3_level_s.items():
        print(f"  EAGLE-3 head on the {dev.upper()}: {lvl * 1000:.2f} ms per level"
              + (f" ({lvl / t1:.2f} of a token)" if t1 else "") + ", "
              f"{costs.eagle3_update_s.get(dev, 0) * 1000:.2f} ms per step to read accepted "
              "tokens")
    for dev, lvl in costs.mtp_level_s.items():
        print(f"  the model's MTP block on the {dev.upper()}: {lvl * 1000:.2f} ms per level"
              + (f" ({lvl / t1:.2f} of a token)" if t1 else "") + ", "
              f"{costs.mtp_update_s.get(dev, 0) * 1000:.2f} ms per step to read accepted "
              "tokens")
    for note in notes:
        print(f"  note: {note}")
    print_candidates(plan)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan`` to the ``tandem`` command's sub-parsers."""
    p = subparsers.add_parser("plan", help="what this machine runs where, and why")
    add_model_args(p)
    add_head_args(p)
    add_plan_args(p)
    p.add_argument("--json", action="store_true", help="plan, costs and hardware as JSON")
    p.add_argument("--measure-acceptance", type=Path, default=None, metavar="PROMPTS",
                   help="measure the draft head's acceptance by depth on these prompts "
                        "(Spec-Bench JSONL) and save it with the head")
    p.add_argument("--profile", type=Path, default=None, metavar="FILE",
                   help="plan for a measured profile (tandem profile writes one) instead "
                        "of this machine and model")
    p.add_argument("--acceptance", type=_acceptance_arg, default=None, metavar="A1,A2,...",
                   help="with --profile: the draft's acceptance by depth to assume")
    p.set_defaults(func=cmd_plan)
