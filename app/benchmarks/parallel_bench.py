"""Several requests at once through the API: Tandem answering one at a time and N at once
(``tandem serve --parallel N``), and llama.cpp's llama-server with ``-np 1`` and ``-np N``,
on the same chat requests from the same clients. Prints a table, writes JSON.

    .venv/bin/python -m app.benchmarks.parallel_bench \\
        --prompts training/data/spec_bench_dev.jsonl \\
        --json parallel.json [--parallel 4] [--requests 8] [--max-tokens 64] \\
        [--llama-server PATH]

``--batch-costs MODEL.gguf ...`` measures instead, without HTTP, what a batch of lanes
costs against one token alone, and the answers' speed together and alone, per model.

Throughput is every answer's tokens over the wall time from the first request sent to the
last answer received, N clients sending their requests one after another. Tandem's answers
together are checked against its answers one at a time (greedy: the same text).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.drafters.kinds import DrafterKind
from training.spec_bench import load_prompts


@contextmanager
def _tandem(model: Path | None, parallel: int, threads: int, ctx: int) -> Iterator[str]:
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--threads", str(threads),
           "--ctx", str(ctx), "--drafter", str(DrafterKind.NONE), "--parallel", str(parallel)]
    if model is not None:
        cmd += ["--model", str(model)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        url = None
        for line in proc.stdout or []:
            if line.startswith("Tandem serving"):
                url = line.split(" at ", 1)[1].split()[0]
                break
        if url is None:
            raise RuntimeError(f"tandem serve did not start (exit {proc.wait()})")
        threading.Thread(target=lambda: [None for _ in proc.stdout or []], daemon=True).start()
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@contextmanager
def _llama_server(binary: str, model: Path, parallel: int, threads: int, ctx: int
                  ) -> Iterator[str]:
    from app.benchmarks.bench_baselines import LlamaServer

    # Tandem's exact cache types; a context per slot as large as Tandem's.
    server = LlamaServer(binary, str(model), ctx * parallel, threads, ["-fa", "on"],
                         type_k="q8_0", type_v="f16", n_parallel=parallel)
    try:
        yield f"http://127.0.0.1:{server.port}/v1"
    finally:
        server.close()


def _drive(url: str, questions: list[str], clients: int, max_tokens: int) -> dict[str, Any]:
    """``clients`` threads share the questions in turn; each sends its next one when its
    last is answered."""
    answers: list[str | None] = [None] * len(questions)
    tokens = [0] * len(questions)
    errors: list[str] = []

    def client(k: int) -> None:
        for i in range(k, len(questions), clients):
            body = json.dumps({"model": "any", "max_tokens": max_tokens, "temperature": 0,
                               "messages": [{"role": "user", "content": questions[i]}]})
            req = urllib.request.Request(url + "/chat/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=600) as resp:
                    reply = json.loads(resp.read())
            except urllib.error.URLError as exc:
                errors.append(str(exc))
                continue
            answers[i] = reply["choices"][0]["message"]["content"]
            tokens[i] = reply["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 2), "tokens": sum(tokens),
            "tok_per_s": round(sum(tokens) / wall, 1), "answers": answers, "errors": errors}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.hub.model_store import default_model_path

    model = args.model or default_model_path()
    rows = load_prompts(args.prompts, per_category=2)
    questions = [r.turns[0] for r in rows][:args.requests]
    n = args.parallel
    results: dict[str, Any] = {"model": str(model), "threads": args.threads,
                               "requests": len(questions), "clients": n,
                               "max_tokens": args.max_tokens, "runs": {}}
    setups: list[tuple[str, Any]] = [
        ("tandem, one at a time", lambda: _tandem(args.model, 1, args.threads, args.ctx)),
        (f"tandem --parallel {n}", lambda: _tandem(args.model, n, args.threads, args.ctx))]
    if args.llama_server:
        setups += [
            ("llama-server -np 1", lambda: _llama_server(args.llama_server, model, 1,
                                                         args.threads, args.ctx)),
            (f"llama-server -np {n}", lambda: _llama_server(args.llama_server, model, n,
                                                            args.threads, args.ctx))]
    for name, start in setups:
        with start() as url:
            _drive(url, questions[:1], 1, 8)  # warm: the first start's measurements
            results["runs"][name] = _drive(url, questions, n, args.max_tokens)
        print(f"{name:24} {results['runs'][name]['tok_per_s']:7.1f} tok/s", file=sys.stderr)
        args.json.write_text(json.dumps(results, indent=1))
    alone = results["runs"]["tandem, one at a time"]["answers"]
    together = results["runs"][f"tandem --parallel {n}"]["answers"]
    results["same_answers"] = sum(a == b for a, b in zip(alone, together, strict=True))
    args.json.write_text(json.dumps(results, indent=1))
    return results


def batch_costs(model: Path, questions: list[str], n: int, max_tokens: int,
                threads: int) -> dict[str, Any]:
    """``n`` answers one after another, then together in lanes; the median decode time of
    each batch size the lanes ran."""
    import statistics

    from engine.decoding.generation import GenerationConfig, generate
    from engine.decoding.parallel import ParallelLanes
    from engine.runtime.target import Target, TargetConfig

    config = GenerationConfig(max_tokens)
    with Target(model, TargetConfig(n_ctx=2048, n_threads=threads)) as target:
        prompts = [target.chat_prompt([{"role": "user", "content": q}])
                   for q in questions[:n]]
        t0 = time.perf_counter()
        alone = sum(len(generate(target, p, None, config).tokens) for p in prompts)
        t_alone = time.perf_counter() - t0
        lanes = ParallelLanes(target, n)
        times: dict[int, list[float]] = {}
        decode = lanes._run_batch

        def timed(rows: list) -> None:  # noqa: ANN001
            t = time.perf_counter()
            decode(rows)
            times.setdefault(len(rows), []).append(time.perf_counter() - t)

        lanes._run_batch = timed  # type: ignore[method-assign]
        counts = [0] * n

        def answer(i: int) -> None:
            lane = lanes.lane()
            try:
                counts[i] = len(generate(lane, prompts[i], None, config).tokens)
            finally:
                lane.release()

        threads_ = [threading.Thread(target=answer, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for t in threads_:
            t.start()
        closer = threading.Thread(target=lambda: ([t.join() for t in threads_],
                                                  lanes.close()))
        closer.start()
        lanes.serve_forever()
        closer.join()
        t_together = time.perf_counter() - t0
        lanes.free()
    return {"model": model.name, "alone_tok_per_s": round(alone / t_alone, 1),
            "together_tok_per_s": round(sum(counts) / t_together, 1),
            "batch_ms": {k: round(1000 * statistics.median(v), 2)
                         for k, v in sorted(times.items())},
            "batches": {k: len(v) for k, v in sorted(times.items())}}


def table(results: dict[str, Any]) -> str:
    base = results["runs"]["tandem, one at a time"]["tok_per_s"]
    lines = [f"{results['requests']} requests of up to {results['max_tokens']} tokens from "
             f"{results['clients']} clients, {results['threads']} threads",
             "| server | wall s | tok/s | vs Tandem one at a time |", "|---|---|---|---|"]
    for name, run_ in results["runs"].items():
        lines.append(f"| {name} | {run_['wall_s']} | {run_['tok_per_s']} | "
                     f"{run_['tok_per_s'] / base:.2f}x |")
    lines.append(f"Tandem's answers together equal its answers alone: "
                 f"{results['same_answers']} of {results['requests']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.benchmarks.parallel_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--batch-costs", type=Path, nargs="+", default=None, metavar="MODEL",
                   help="measure the lanes' batch costs on these models instead")
    args = p.parse_args(argv)
    if args.batch_costs:
        questions = [r.turns[0] for r in load_prompts(args.prompts, per_category=2)]
        rows = []
        for model in args.batch_costs:
            rows.append(batch_costs(model, questions, args.parallel, args.max_tokens,
                                    args.threads))
            args.json.write_text(json.dumps(rows, indent=1))
        print("| model | alone tok/s | together tok/s | batch ms by rows |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['alone_tok_per_s']} | {r['together_tok_per_s']} | "
                  f"{r['batch_ms']} (batches {r['batches']}) |")
        return 0
    print(table(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
