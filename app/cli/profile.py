"""``tandem profile``: measure what a big model's shape costs on this machine, and
``tandem plan --profile FILE``: the plan such a profile leads to.

The measuring is in ``engine.planning.measured_profile``; this module parses arguments
and prints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.drafters.kinds import DrafterKind
from engine.gguf.model_shapes import SHAPES, shape_named
from engine.hub.model_store import default_model_path
from engine.planning.measured_profile import (
    MeasuredProfile,
    load_measured_profile,
    measure_profile,
    shapes,
)
from engine.planning.planner import DRAFT_MODEL_ACCEPTANCE, Plan
from engine.runtime.hardware import default_threads, probe_hardware


def print_candidates(plan: Plan) -> None:
    """The planner's candidates, fastest first."""
    print("\nCandidates (predicted):")
    for c in sorted(plan.candidates, key=lambda c: -c.tok_per_s):
        if c.drafter is DrafterKind.HEAD:
            what = f"head on {c.head_device}, {c.budget.describe()}"
        elif c.drafter is DrafterKind.DRAFT:
            what = f"draft model on {c.head_device}, {c.budget.describe()}"
        elif c.drafter is DrafterKind.MTP:
            what = f"the model's MTP block, {c.budget.describe()}"
        elif c.drafter is DrafterKind.EAGLE3:
            what = f"EAGLE-3 head (llama.cpp), {c.budget.describe()}"
        else:
            what = "plain decoding (+ drafts from memory)"
        est = " (estimated)" if c.estimated else ""
        print(f"  {c.layout:12s} {c.tok_per_s:7.1f} tok/s  {what}{est}")


def describe_profile(profile: MeasuredProfile) -> str:
    """The measured figures, as a few lines."""
    lines = [f"Profile: {profile.target_shape} ({profile.quant}, "
             f"{profile.size_bytes / 1e9:.2f} GB) measured with {profile.n_threads} threads"]
    for where, curves, prefills in (("", profile.verify_s, profile.prefill_s),
                                    ("on the GPU, ", profile.gpu_verify_s,
                                     profile.gpu_prefill_s)):
        for ctx, curve in sorted(curves.items()):
            t1 = curve[1]
            rel = ", ".join(f"{n}: {t / t1:.2f}x" for n, t in sorted(curve.items()) if n > 1)
            first = prefills.get(ctx)
            wait = f"; a {ctx}-token prompt prefills in {first:.2f} s" if first else ""
            lines.append(f"  {where}context {ctx}: one token {t1 * 1000:.1f} ms; "
                         f"n tokens: {rel}{wait}")
    for d in profile.drafts:
        lines.append(f"  draft model {d.shape} ({d.size_bytes / 1e9:.2f} GB): "
                     f"{d.token_s * 1000:.1f} ms a token, {d.sync_s * 1000:.1f} ms a step "
                     "to catch up")
    for dev, h in profile.heads.items():
        lines.append(f"  draft head of width {h.width} on {dev} ({h.vocab}-row LM head): "
                     f"{h.level_s * 1000:.1f} ms a level, {h.update_s * 1000:.1f} ms a step")
    if profile.eagle3 is not None:
        e = profile.eagle3
        t1 = profile.verify_s[min(profile.verify_s)][1]
        lines.append(f"  EAGLE-3 head of width {e.width} through llama.cpp ({e.vocab}-token "
                     f"draft vocabulary, Q8_0): {e.level_s * 1000:.1f} ms a level "
                     f"({e.level_s / t1:.2f} of a token), {e.update_s * 1000:.1f} ms a step")
    lines += [f"  note: {n}" for n in profile.notes]
    return "\n".join(lines)


def show_profile_plan(path: Path, acceptance: tuple[float, ...] | None, as_json: bool) -> int:
    profile = load_measured_profile(path)
    acc = acceptance or DRAFT_MODEL_ACCEPTANCE
    plan = profile.plan(acc, head_acceptance=acceptance)
    if as_json:
        print(json.dumps({"plan": plan.to_json(), "profile": profile.to_json(),
                          "acceptance_assumed": list(acc)}, indent=1))
        return 0
    print(describe_profile(profile))
    print()
    print(plan.describe())
    print(f"Assumed acceptance by depth: {', '.join(f'{a:.2f}' for a in acc)} "
          f"({'given' if acceptance else 'the draft-model prior'}; --acceptance changes it)")
    print_candidates(plan)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    target = shape_named(args.shape)
    drafts = shapes(args.draft or [])
    try:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    except ValueError:
        raise ValueError(f"--contexts must be comma-separated token counts, got "
                         f"{args.contexts!r}") from None
    if any(c < 16 for c in contexts):
        raise ValueError(f"--contexts must be at least 16 tokens each, got {args.contexts}")
    head_devices = tuple(args.head_device or ["cpu"])
    # Writing the file, each context (twice with --gpu), the GPU's exactness probe, the
    # EAGLE-3 level, drafts, heads.
    total = 2 + len(contexts) * (2 if args.gpu else 1) + args.gpu + len(drafts) + len(head_devices)
    steps = tqdm(total=total, desc=target.name, file=sys.stderr)

    def say(message: str) -> None:
        steps.set_postfix_str(message)
        steps.update(1)

    hardware = probe_hardware()
    if args.gpu and not hardware.llama_gpu_offload:
        raise ValueError("--gpu: this build of llama.cpp cannot offload to a GPU "
                         "(docs/gpu.md says how to build one that can)")
    profile = measure_profile(target, drafts, args.workdir, default_model_path(),
                              hardware, args.threads or default_threads(), contexts,
                              head=not args.no_head, say=say, gpu=args.gpu,
                              head_devices=head_devices)
    steps.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    print(describe_profile(profile))
    print(f"\nwritten to {args.out}; tandem plan --profile {args.out} shows the plan")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile", help="measure a big model's costs here, from a file of its exact shape")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES),
                   help="the target model's shape")
    p.add_argument("--draft", action="append", choices=sorted(SHAPES),
                   help="a draft model's shape to measure (repeatable)")
    p.add_argument("--contexts", default="256,1024",
                   help="context lengths for the verification curve (comma-separated)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-head", action="store_true", help="skip the draft head level")
    p.add_argument("--head-device", action="append",
                   help="where to time the draft head: cpu, cuda, ... (repeatable; "
                        "default: cpu)")
    p.add_argument("--gpu", action="store_true",
                   help="time the target with every layer on the GPU too")
    p.add_argument("--workdir", type=Path, default=Path("profile-work"),
                   help="where the synthetic GGUFs are written (and removed)")
    p.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    p.set_defaults(func=cmd_profile)
