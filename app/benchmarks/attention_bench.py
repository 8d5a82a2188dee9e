"""What a verification and a prompt cost at long contexts through each CPU attention path,
side by side in one process: ``tandem bench --attention 1024,4096,8192,16384``.

Three paths on one model and one text (the long-context bench's):
- ``tiled``: Tandem's batch-invariant kernel (packaging/llama-cpp/tiled-attention.patch),
  flash attention on, what a CPU target runs now;
- ``ggml-fa``: the same context with the kernel switched off, ggml's own flash-attention
  paths (what llama-server runs with the same cache types);
- ``matmul``: flash attention off, attention as matrix products (Tandem's CPU rule before
  the kernel).

At each context every path's cache holds the same tokens; then, round after round, each
path verifies a chain of n tokens for every n (interleaved, so a noisy moment slows every
path alike) and takes it back. Medians with the range of the rounds; c(n)/c(1) is the
verification's price in one-token decodes (engine.decoding.budget.VerifyCostModel). The
prompt's own time (reset, then read the whole context) is measured per path and round as
well. Results are saved after each context and a rerun resumes (32k takes long).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.runtime.draft_tree import DraftTree
from engine.runtime.llama_bindings import tiled_attention_on, use_tiled_attention
from engine.runtime.target import Target, TargetConfig

PATHS = ("tiled", "ggml-fa", "matmul")
SIZES = (1, 2, 4, 8, 16)


def _verify_once(target: Target, root: int, draft: list[int], n_keep: int) -> float:
    t0 = time.perf_counter()
    ver = target.verify(root, DraftTree.chain(draft))
    seconds = time.perf_counter() - t0
    target.commit(ver, [0], [root])
    target.rollback(n_keep)
    return seconds


def _prefill_once(target: Target, tokens: list[int]) -> float:
    target.reset(cold=True)  # nothing kept: the F16 context would hand the prompt back
    t0 = time.perf_counter()
    target.prefill(tokens)
    return time.perf_counter() - t0


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_context(targets: dict[str, Target], tokens: list[int], context: int,
                    repeats: int, on_round: Callable[[str], None] | None = None
                    ) -> dict[str, Any]:
    """Every path at ``context`` tokens: prompt seconds and c(n) seconds per round."""
    prompt = tokens[:context]
    root, draft = tokens[context], tokens[context + 1:context + max(SIZES)]
    verify: dict[str, dict[int, list[float]]] = {p: {n: [] for n in SIZES} for p in targets}
    prefill: dict[str, list[float]] = {p: [] for p in targets}
    for rep in range(repeats):
        for path, target in targets.items():
            use_tiled_attention(path != "ggml-fa")
            try:
                prefill[path].append(_prefill_once(target, prompt))
                _verify_once(target, root, draft, context)  # warm-up
                for n in SIZES:
                    verify[path][n].append(_verify_once(target, root, draft[:n - 1], context))
            finally:
                use_tiled_attention(True)
            if on_round is not None:
                on_round(f"{context} tokens, round {rep + 1}, {path}")
    out: dict[str, Any] = {"context": context, "paths": {}}
    for path in targets:
        c1 = statistics.median(verify[path][1])
        out["paths"][path] = {
            "prefill_s": _stats(prefill[path]),
            "verify_ms": {str(n): {k: v * 1000 for k, v in _stats(verify[path][n]).items()}
                          for n in SIZES},
            "price": {str(n): statistics.median(verify[path][n]) / c1 for n in SIZES},
        }
    return out


def run_attention_bench(model_path: Path, tokens: list[int], contexts: list[int],
                        repeats: int, n_threads: int, out_path: Path | None = None,
                        on_round: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every context in turn (those already in ``out_path`` are kept: a rerun resumes)."""
    if not tiled_attention_on():
        raise RuntimeError("this build has no tiled attention kernel "
                           "(packaging/llama-cpp/tiled-attention.patch), or "
                           "TANDEM_TILED_ATTENTION=0 turned it off")
    payload: dict[str, Any] = {"meta": {"model": str(model_path), "threads": n_threads,
                                        "repeats": repeats, "sizes": list(SIZES)},
                               "contexts": []}
    if out_path is not None and out_path.exists():
        payload = json.loads(out_path.read_text())
    done = {c["context"] for c in payload["contexts"]}
    n_ctx = max(contexts) + 2 * max(SIZES)
    todo = [c for c in contexts if c not in done]
    if todo:
        need = max(todo) + max(SIZES)
        if len(tokens) < need:
            raise ValueError(f"the text has {len(tokens)} tokens, {need} are needed")
        targets = {
            "tiled": Target(model_path, TargetConfig(n_ctx=n_ctx, n_threads=n_threads,
                                                     flash_attn=True)),
            "matmul": Target(model_path, TargetConfig(n_ctx=n_ctx, n_threads=n_threads,
                                                      flash_attn=False)),
        }
        paths = {"tiled": targets["tiled"], "ggml-fa": targets["tiled"],
                 "matmul": targets["matmul"]}
        try:
            for context in todo:
                payload["contexts"].append(measure_context(paths, tokens, context, repeats,
                                                           on_round))
                payload["contexts"].sort(key=lambda c: c["context"])
                if out_path is not None:
                    out_path.write_text(json.dumps(payload, indent=1))
        finally:
            for target in targets.values():
                target.close()
    return payload


def _ratio(ours: dict[str, Any], theirs: dict[str, Any], n: str) -> float:
    """Median c(n) (or, for n == "", the prompt's seconds) of ours over theirs."""
    if not n:
        return ours["prefill_s"]["median"] / theirs["prefill_s"]["median"]
    return ours["verify_ms"][n]["median"] / theirs["verify_ms"][n]["median"]


def format_attention_table(payload: dict[str, Any]) -> str:
    """Per context: each path's c(1), c(16) (ms, median and range) and price c(16)/c(1),
    the prompt's seconds, and the tiled kernel's ratios to the other two."""
    lines = ["verification and prompt cost by attention path (medians; [min-max] of the "
             "rounds)", ""]
    head = (f"{'context':>8} {'path':<8} {'c(1) ms':>18} {'c(16) ms':>20} {'c16/c1':>7} "
            f"{'prompt s':>16}")
    lines += [head, "-" * len(head)]
    for ctx in payload["contexts"]:
        for path, p in ctx["paths"].items():
            c1, c16 = p["verify_ms"]["1"], p["verify_ms"]["16"]
            pf = p["prefill_s"]
            lines.append(
                f"{ctx['context']:>8} {path:<8} "
                f"{c1['median']:>6.1f} [{c1['min']:.1f}-{c1['max']:.1f}]".ljust(37)
                + f"{c16['median']:>7.1f} [{c16['min']:.0f}-{c16['max']:.0f}]".rjust(20)
                + f"{p['price']['16']:>8.2f}"
                + f"{pf['median']:>8.2f} [{pf['min']:.1f}-{pf['max']:.1f}]".rjust(17))
    lines += ["", "tiled against the others (ratios of medians; < 1 is faster)"]
    for ctx in payload["contexts"]:
        paths = ctx["paths"]
        t = paths.get("tiled")
        if t is None:
            continue
        cells = []
        for other in ("ggml-fa", "matmul"):
            o = paths.get(other)
            if o is None:
                continue
            cells.append(f"vs {other}: c(1) {_ratio(t, o, '1'):.2f} "
                         f"c(16) {_ratio(t, o, '16'):.2f} prompt {_ratio(t, o, ''):.2f}")
        lines.append(f"{ctx['context']:>8}  " + "; ".join(cells))
    return "\n".join(lines)
