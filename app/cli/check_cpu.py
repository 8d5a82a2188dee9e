"""``tandem check-cpu``: each CPU library of this llama.cpp build that this processor runs,
loaded in turn and checked exact (engine.planning.cpu_check); a table, and JSON."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from engine.hub.model_store import default_model_path
from engine.planning.cpu_check import (
    check_level,
    levels_to_check,
    prepare_models,
    table,
)


def cmd_check_cpu(args: argparse.Namespace) -> int:
    levels = levels_to_check()
    if args.levels:
        asked = args.levels.split(",")
        unknown = sorted(set(asked) - set(levels))
        if unknown:
            raise ValueError(f"--levels: this build has no {', '.join(unknown)} CPU library "
                             f"(it has {', '.join(levels)})")
        levels = asked
    work = Path(args.work_dir) if args.work_dir else default_model_path().parent / "check-cpu"
    models = prepare_models(Path(args.model) if args.model else default_model_path(), work,
                            args.threads, tuple(args.types.split(",")),
                            lambda what: print(f"  {what}", flush=True))
    results = []
    bar = tqdm(levels, desc="CPU libraries", unit="level")
    for level in bar:
        bar.set_postfix_str(level)
        results.append(check_level(level, models, args.threads))
        if args.json:  # as each ends: a crash later keeps what was checked
            Path(args.json).write_text(json.dumps(
                {"cpu": _cpu_name(), "levels": [asdict(r) for r in results]}, indent=1))
    bar.close()
    print(table(results))
    failed = [r.level for r in results if r.failed]
    ran = [r.level for r in results if r.runnable]
    print(f"\n{len(ran)} of {len(results)} CPU libraries run on this CPU"
          + (f"; FAILED: {', '.join(failed)}" if failed else "; all exact"))
    return 1 if failed or not ran else 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check-cpu", help="check each CPU library of this build that this CPU runs: "
        "kernels, exactness probe, drafted answers equal to plain")
    p.add_argument("--model", default=None, help="Q4_0 weights to requantize (default: the "
                   "bundled model)")
    p.add_argument("--types", default="q4_0,q4_k_m,q6_k,iq4_xs",
                   help="weight types to check (comma-separated)")
    p.add_argument("--levels", default=None, help="only these CPU libraries (e.g. haswell,zen4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work-dir", default=None, help="where the requantized copies are kept")
    p.add_argument("--json", default=None, help="write the results here as they come")
    p.set_defaults(func=cmd_check_cpu)
