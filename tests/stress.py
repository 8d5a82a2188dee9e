"""Run test files again and again under generated CPU load and count native crashes.

Not part of ``make test``: it takes minutes and its point is load. ``make stress`` runs
it; each run's output is kept in ``runs/stress/<stamp>/run-N.log`` and the summary in
``summary.json`` there, so a crash can be read afterwards.

    python -m tests.stress --runs 9 --load 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FILES = ("tests/test_gui_chat.py", "tests/test_gui_dashboard.py",
                 "tests/test_gui_kill.py", "tests/test_hub_wizard.py",
                 "tests/test_session.py")
_FATAL = re.compile(r"Fatal Python error: (.*)")
_SUMMARY = re.compile(r"(\d+ (?:passed|failed|error)[^\n]*) in [\d.]+s")


@dataclass
class StressRun:
    index: int
    exit_code: int
    seconds: float
    crashed: bool  # killed by a signal (SIGABRT, SIGSEGV...), or Python's fatal error
    signature: str  # the fatal error line, the signal, or pytest's summary
    log: str


def _busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _signature(rc: int, output: str) -> str:
    fatal = _FATAL.search(output)
    if fatal:
        return fatal.group(1).strip()
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    if rc in (134, 139):
        return f"exit {rc} ({'SIGABRT' if rc == 134 else 'SIGSEGV'})"
    summary = _SUMMARY.search(output)
    return summary.group(1) if summary else f"exit {rc}"


def run_once(index: int, files: list[str], load: int, out_dir: Path,
             timeout_s: float) -> StressRun:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-X", "dev", "-m", "pytest", "-v", "-x", "-p", "no:cacheprovider",
           *files]
    loops = _busy_loops(load)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              errors="replace", timeout=timeout_s)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        partial = [b.decode("utf-8", "replace") if isinstance(b, bytes) else b or ""
                   for b in (exc.stdout, exc.stderr)]
        output = "".join(partial) + f"\n(timed out after {timeout_s:.0f} s)"
    finally:
        _stop(loops)
    seconds = time.monotonic() - t0
    log = out_dir / f"run-{index}.log"
    log.write_text(output)
    crashed = rc < 0 or rc in (134, 139) or bool(_FATAL.search(output))
    return StressRun(index, rc, seconds, crashed, _signature(rc, output), str(log))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=9, help="how many times to run the files")
    p.add_argument("--load", type=int, default=3,
                   help="busy-loop processes that load the CPU during each run")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "stress",
                   help="where the logs and summary.json go")
    p.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    args = p.parse_args(argv)
    if args.runs < 1 or args.load < 0:
        p.error("--runs must be at least 1 and --load at least 0")
    out_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[StressRun] = []
    bar = tqdm(range(1, args.runs + 1), desc=f"stress ({args.load} busy loops)", unit="run")
    for i in bar:
        runs.append(run_once(i, args.files, args.load, out_dir, args.timeout))
        bar.set_postfix(crashes=sum(r.crashed for r in runs),
                        failed=sum(r.exit_code != 0 for r in runs))
    print(f"\n{'run':>4} {'exit':>5} {'seconds':>8}  result")
    for r in runs:
        print(f"{r.index:>4} {r.exit_code:>5} {r.seconds:>8.1f}  "
              f"{'CRASH: ' if r.crashed else ''}{r.signature}")
    crashes = sum(r.crashed for r in runs)
    failures = sum(r.exit_code != 0 for r in runs)
    print(f"\n{len(runs)} runs under {args.load} busy loops: {crashes} crashed, "
          f"{failures} exited non-zero. Logs: {out_dir}")
    summary = {"runs": [asdict(r) for r in runs], "load": args.load, "files": args.files,
               "crashes": crashes, "failures": failures, "python": sys.version.split()[0]}
    try:
        from PySide6 import __version__ as pyside_version
        summary["pyside6"] = pyside_version
    except ImportError:
        pass
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
