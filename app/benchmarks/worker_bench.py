"""The workers benchmark (``tandem bench --workers-trend``): plain decoding and ``auto``
with the target on this machine and with its layers on a worker, side by side.

1. A worker (``tandem worker``) starts on 127.0.0.1, a second process with as many
   threads as this machine has cores; a worker the user names (``--workers``) is used
   instead.
2. Each placement opens one engine (``auto``: costs measured through the worker, then
   the plan) and answers every prompt twice: plain decoding, then as planned. Both runs
   use the same engine, each from a cold cache and each placement from an empty memory
   of answers, so the ratio is the plan's gain there; the tokens must be equal.
3. Placements: this machine; the worker; the worker behind a relay that adds 1 ms and
   5 ms of round trip (``app.benchmarks.latency_proxy``; ``tc netem`` where the kernel has
   it would do the same), the trend a real network gives.

On a machine with few cores the loopback worker shares them with the client: while the
worker computes, the client only waits on the socket (drafting from memory costs
microseconds), so each placement gives the target every core. The table says so.
Results are saved after each placement (a run resumes where it stopped).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.benchmarks.latency_proxy import LatencyProxy
from app.benchmarks.loopback_worker import loopback_worker
from engine.decoding.generation import GenerationConfig
from engine.session import EngineConfig
from engine.session_process import open_engine
from engine.workers.handshake import probe_worker

ADDED_ROUND_TRIPS_S = (0.0, 0.001, 0.005)


def _placement(engine: Any, prompts: list[list[dict[str, str]]], max_tokens: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    for i, messages in enumerate(prompts):
        prompt = engine.chat_prompt(messages)
        # No prompt cache, as the servers run: each answer prefills its prompt.
        engine.target.reset(cold=True)
        plain = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens), plain=True,
                                remember=False)
        engine.target.reset(cold=True)
        auto = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens))
        rows.append({"plain_tok_per_s": plain.stats.tok_per_s,
                     "auto_tok_per_s": auto.stats.tok_per_s,
                     "plain_ttft_s": plain.stats.ttft_s, "auto_ttft_s": auto.stats.ttft_s,
                     "tokens_per_verification": auto.stats.mean_accepted,
                     "identical": plain.tokens == auto.tokens, "n_tokens": len(plain.tokens)})
        say(f"prompt {i + 1}/{len(prompts)}: plain {plain.stats.tok_per_s:.1f} tok/s, auto "
            f"{auto.stats.tok_per_s:.1f}")
    plain_s = sum(r["n_tokens"] / r["plain_tok_per_s"] for r in rows if r["plain_tok_per_s"])
    auto_s = sum(r["n_tokens"] / r["auto_tok_per_s"] for r in rows if r["auto_tok_per_s"])
    n = sum(r["n_tokens"] for r in rows)
    plan = engine.plan
    curve = engine.costs.verify_s.get("cpu", {}) if engine.costs is not None else {}
    return {"plan": plan.layout_text() if plan else engine.drafter_name,
            # What the planner priced: one token, and a batch of 8 against it.
            "t1_ms": curve.get(1, 0.0) * 1e3,
            "verify8_ratio": curve[8] / curve[1] if 1 in curve and 8 in curve else 0.0,
            "predicted_speedup": plan.predicted_speedup if plan else 1.0,
            "drafter": engine.drafter_name,
            "plain_tok_per_s": n / plain_s if plain_s else 0.0,
            "auto_tok_per_s": n / auto_s if auto_s else 0.0,
            "identical": sum(r["identical"] for r in rows), "prompts": len(rows),
            "rows": rows}


def run_worker_bench(base: EngineConfig, prompts: list[list[dict[str, str]]], max_tokens: int,
                     out_path: Path | None, say: Callable[[str], None],
                     worker: str | None = None,
                     added_round_trips_s: tuple[float, ...] = ADDED_ROUND_TRIPS_S
                     ) -> dict[str, Any]:
    """Every placement's figures (see the module docstring), saved to ``out_path``."""
    done: dict[str, Any] = {}
    if out_path is not None and out_path.exists():
        done = json.loads(out_path.read_text()).get("placements", {})
    threads = base.n_threads or os.cpu_count() or 1
    meta = {"threads": threads, "max_tokens": max_tokens, "prompts": len(prompts),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cores": "the loopback worker and this client share the machine's cores; the "
                       "client waits while the worker computes"}

    def save() -> None:
        if out_path is not None:
            out_path.write_text(json.dumps({"meta": meta, "placements": done}, indent=1))

    memory = Path(tempfile.mkdtemp(prefix="tandem-workers-bench-"))

    def fresh(workers: tuple[str, ...], name: str) -> EngineConfig:
        """Each placement's drafts start from an empty memory: answers remembered at one
        placement would be free drafts at the next."""
        return replace(base, workers=workers, memory_dir=memory / name.replace(" ", "_"))

    if "local" not in done:
        say("this machine")
        with open_engine(fresh((), "local"), say) as engine:
            done["local"] = {"round_trip_ms": 0.0, **_placement(engine, prompts, max_tokens,
                                                                 say)}
        save()
    with contextlib.ExitStack() as stack:
        endpoint = worker or stack.enter_context(loopback_worker(threads))[0]
        for added in added_round_trips_s:
            name = f"worker +{added * 1e3:g} ms" if added else "worker"
            if name in done:
                continue
            via = stack.enter_context(LatencyProxy(endpoint, added)).endpoint if added \
                else endpoint
            rtt = probe_worker(via).round_trip_s
            say(f"{name} ({rtt * 1e3:.2f} ms round trip)")
            with open_engine(fresh((via,), name), say) as engine:
                done[name] = {"round_trip_ms": rtt * 1e3, "added_ms": added * 1e3,
                              **_placement(engine, prompts, max_tokens, say)}
            save()
    return {"meta": meta, "placements": done}


def format_worker_table(result: dict[str, Any]) -> str:
    lines = [f"{'target':<14}{'round trip':>11}{'token':>9}{'8 vs 1':>8}{'plain tok/s':>13}"
             f"{'auto tok/s':>12}{'auto/plain':>12}{'predicted':>11}{'identical':>11}  plan"]
    for name, p in result["placements"].items():
        gain = p["auto_tok_per_s"] / p["plain_tok_per_s"] if p["plain_tok_per_s"] else 0.0
        lines.append(f"{name:<14}{p['round_trip_ms']:>9.2f}ms{p['t1_ms']:>7.1f}ms"
                     f"{p['verify8_ratio']:>7.2f}x{p['plain_tok_per_s']:>13.1f}"
                     f"{p['auto_tok_per_s']:>12.1f}{gain:>11.2f}x{p['predicted_speedup']:>10.2f}x"
                     f"{p['identical']:>6}/{p['prompts']:<4}  {p['plan']}")
    lines.append(f"({result['meta']['cores']}; {result['meta']['threads']} threads each)")
    return "\n".join(lines)
