"""Decoding beside other programs: plain decoding on 1 thread, on 2 and following the load
(Tandem's default), quiet and beside a busy program at normal priority, a niced one and
a niced compile; and how long a start takes on a busy machine. Prints a table, writes JSON.

    .venv/bin/python -m app.benchmarks.load_bench --json load.json [--model M.gguf] [--tokens 128]
        [--llama-bench PATH] [--repeat 3] [--loads quiet,niced-compile] [--no-start]

With ``--llama-bench`` (llama.cpp's own, built from the same vendored source), the same
decode by llama-bench on 1 and on 2 threads, beside each load, with Tandem's cache types,
after as many cached tokens as Tandem's prompt (``-d``).

The loads are real processes: a Python busy loop, the same at nice 10, and gcc compiling
a generated C file again and again at nice 10 (two jobs, as `nice make -j2`).
With ``--repeat N`` every cell is the median of N runs, taken in turn (one round of every
runner, then the next), so a slow moment of the machine does not fall on one runner alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper and the sea."
SETTLE_S = 1.0  # a load runs this long before an answer starts


def _c_source(folder: Path) -> Path:
    """A C file that takes gcc -O2 about a second: many small functions."""
    path = folder / "load.c"
    body = "\n".join(f"double f{i}(double x) {{ double s = 0; for (int k = 0; k < {i % 7 + 3};"
                     f" k++) s += x * k + {i}; return s; }}" for i in range(2500))
    path.write_text(body + "\nint main(void) { return (int) f1(1.0); }\n")
    return path


@contextmanager
def _load(kind: str, folder: Path) -> Iterator[None]:
    """``kind``: "quiet", "busy", "niced-busy" or "niced-compile" (two jobs)."""
    procs: list[subprocess.Popen] = []
    loop = [sys.executable, "-c", "while True: pass"]
    if kind == "busy":
        procs.append(subprocess.Popen(loop))
    elif kind == "niced-busy":
        procs.append(subprocess.Popen(["nice", "-n", "10", *loop]))
    elif kind == "niced-compile":
        src = _c_source(folder)
        job = (f"while true; do gcc -O2 -c {src} -o {folder}/load-$$.o; done")
        procs += [subprocess.Popen(["nice", "-n", "10", "sh", "-c", job]) for _ in range(2)]
    try:
        time.sleep(SETTLE_S if procs else 0.2)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
        subprocess.run(["pkill", "-f", f"{folder}/load"], check=False)


def _decode(engine: object, prompt: list[int], tokens: int) -> dict[str, float]:
    from engine.decoding.generation import GenerationConfig

    result = engine.generate(prompt, GenerationConfig(max_tokens=tokens),  # type: ignore[attr-defined]
                             remember=False)
    s = result.stats
    return {"tok_per_s": round(s.tok_per_s, 1), "ttft_ms": round(s.ttft_s * 1000, 1),
            "threads": engine.target.n_threads}  # type: ignore[attr-defined]


def _llama_bench(binary: Path, model: Path, tokens: int, threads: int, depth: int) -> float:
    """llama-bench's decode speed (tok/s): ``tokens`` generated after ``depth`` cached
    tokens (Tandem's prompt, so both attend over as many cells; the depth is read
    untimed), one repeat, Tandem's exact cache (Q8_0 K, F16 V, flash attention)."""
    out = subprocess.run([str(binary), "-m", str(model), "-p", "0", "-n", str(tokens),
                          "-d", str(depth),
                          "-t", str(threads), "-r", "1", "-ctk", "q8_0", "-ctv", "f16",
                          "-fa", "1", "-o", "json"], capture_output=True, text=True,
                         check=True, timeout=600)
    return round(float(json.loads(out.stdout)[0]["avg_ts"]), 1)


def _median_cell(runs: list[dict]) -> dict:
    """The run with the median speed, and every run's speed."""
    ordered = sorted(runs, key=lambda r: r["tok_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs": [r["tok_per_s"] for r in runs]}


LOADS = ("quiet", "busy", "niced-busy", "niced-compile")


def run(model: Path | None, tokens: int, out: Path, say: Callable[[str], None],
        llama_bench: Path | None = None, repeat: int = 1, loads: tuple[str, ...] = LOADS,
        starts: bool = True) -> dict:
    from engine.drafters.kinds import DrafterKind
    from engine.hub.model_store import default_model_path
    from engine.session import Engine, EngineConfig

    results: dict = {"machine": os.uname().machine, "cores": os.cpu_count(),
                     "tokens": tokens, "repeat": repeat, "decode": {}, "start_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cache = folder / "cache"
        runners = {"1 thread": 1, "2 threads": 2, "follows the load": None}
        engines = {name: Engine(EngineConfig(model_path=model, drafter=DrafterKind.NONE,
                                             n_threads=n, cache_dir=cache,
                                             memory_dir=folder / "memory"))
                   for name, n in runners.items()}
        try:
            prompt = next(iter(engines.values())).chat_prompt(
                [{"role": "user", "content": PROMPT}])
            for kind in loads:
                row = results["decode"][kind] = {}
                runs: dict[str, list[dict]] = {}
                for _ in range(repeat):
                    for name, engine in engines.items():
                        with _load(kind, folder):
                            engine.target.reset()
                            got = _decode(engine, prompt, tokens)
                        runs.setdefault(name, []).append(got)
                        say(f"{kind:14} {name:17} {got['tok_per_s']:7.1f} tok/s "
                            f"({got['threads']} threads)")
                    for n in (1, 2) if llama_bench else ():
                        with _load(kind, folder):
                            speed = _llama_bench(llama_bench, model or default_model_path(),
                                                 tokens, n, len(prompt))
                        runs.setdefault(f"llama-bench {n}", []).append(
                            {"tok_per_s": speed, "threads": n})
                        say(f"{kind:14} llama-bench {n} thr  {speed:7.1f} tok/s")
                    row.update({name: _median_cell(r) for name, r in runs.items()})
                    out.write_text(json.dumps(results, indent=1))
        finally:
            for engine in engines.values():
                engine.close()
        # A first start (auto: the kernel probe and the machine's costs measured) quiet
        # and beside a busy program, each from an empty cache.
        for kind in ("quiet", "busy") if starts else ():
            with _load(kind, folder):
                t0 = time.perf_counter()
                Engine(EngineConfig(model_path=model, drafter=DrafterKind.AUTO,
                                    cache_dir=folder / f"start-{kind}",
                                    memory_dir=folder / "memory")).close()
                results["start_s"][kind] = round(time.perf_counter() - t0, 1)
            say(f"first start, {kind}: {results['start_s'][kind]} s")
            out.write_text(json.dumps(results, indent=1))
    return results


def table(results: dict) -> str:
    decode = results["decode"]
    quiet = decode["quiet"]
    peer = "llama-bench 1" in quiet
    lines = ["| load | 1 thread | 2 threads | follows the load (threads) | vs quiet 1 thread |"
             + (" llama-bench 1 / 2 threads | vs the better llama-bench |" if peer else ""),
             "|---|---|---|---|---|" + ("---|---|" if peer else "")]
    for kind, row in decode.items():
        follow = row["follows the load"]
        line = (f"| {kind} | {row['1 thread']['tok_per_s']} | "
                f"{row['2 threads']['tok_per_s']} | {follow['tok_per_s']} "
                f"({follow['threads']}) | "
                f"{follow['tok_per_s'] / quiet['1 thread']['tok_per_s']:.2f}x |")
        if peer:
            one, two = row["llama-bench 1"]["tok_per_s"], row["llama-bench 2"]["tok_per_s"]
            line += f" {one} / {two} | {follow['tok_per_s'] / max(one, two):.2f}x |"
        lines.append(line)
    starts = results["start_s"]
    if starts:
        lines.append("")
        lines.append(f"first start (auto, empty cache): quiet {starts.get('quiet')} s, "
                     f"beside a busy program {starts.get('busy')} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.benchmarks.load_bench", description=__doc__)
    p.add_argument("--json", type=Path, required=True, help="where the results go")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: bundled)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--llama-bench", type=Path, default=None,
                   help="llama.cpp's llama-bench, run beside each load on 1 and 2 threads")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell (the median)")
    p.add_argument("--loads", default=",".join(LOADS),
                   help="which loads, comma-separated (quiet is always run: the table's "
                        "reference)")
    p.add_argument("--no-start", action="store_true", help="leave out the first starts")
    args = p.parse_args(argv)
    asked = [k.strip() for k in args.loads.split(",") if k.strip()]
    unknown = sorted(set(asked) - set(LOADS))
    if unknown:
        p.error(f"unknown load {', '.join(unknown)}: choose from {', '.join(LOADS)}")
    loads = tuple(k for k in LOADS if k == "quiet" or k in asked)
    results = run(args.model, args.tokens, args.json,
                  lambda line: print(line, file=sys.stderr, flush=True), args.llama_bench,
                  max(1, args.repeat), loads, not args.no_start)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
