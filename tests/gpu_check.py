"""``python -m tests.gpu_check --out DIR``: the GPU runbook's first checks, on a machine
with a CUDA build of llama.cpp (docs/gpu.md). Each step writes its figures to
``DIR/gpu_check.json`` as it ends, so a run cut short keeps what it measured.

1. What the hardware probe sees (GPU, free VRAM, whether llama.cpp offloads).
2. The exactness probe with the target on the GPU and on the CPU: whether a verified
   batch's logits equal one-token decoding's (the lossless contract's premise).
3. Greedy lossless on the GPU-resident target: plain decoding's tokens with lookup, the
   head on the GPU and memory drafts, drafts accepted.
4. The verification curve (seconds for a batch of n tokens) on the GPU and on the CPU at
   several thread counts, for the default model and synthetic real shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

# libllama before numpy: a llama.cpp built with cmake on the GPU image (2026-11-26)
# segfaulted in init_tokenizer when numpy or torch was loaded first (docs/gpu.md).
import llama_cpp

from engine.runtime.target import Target, TargetConfig

MAX_TOKENS = 48


def _save(out: Path, results: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))


def _step(out: Path, results: dict, name: str, fn) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # noqa: BLE001 - one failing step must not lose the others
        results[name] = {"error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc()[-2000:]}
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    print(f"== {name} ({results['seconds'][name]} s): "
          f"{json.dumps(results[name], default=str)[:1500]}", flush=True)
    _save(out, results)


def hardware() -> dict:

    from engine.runtime.hardware import probe_hardware

    return {"probe": probe_hardware().to_json(),
            "llama_supports_gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}


def exactness(model: Path, placements: list[tuple[str, int, int]],
              contexts: tuple[int, ...] = (0, 1024)) -> dict:
    from engine.runtime.exactness import probe_exactness

    out = {}
    for label, gpu_layers, threads in placements:
        for repack in (True, False):
            config = TargetConfig(n_ctx=2048, n_threads=threads, n_gpu_layers=gpu_layers,
                                  repack=repack)
            with Target(model, config) as target:
                for ctx in contexts:
                    probe = probe_exactness(target, context=ctx)
                    out[f"{label} repack={repack} ctx={ctx}"] = probe.to_json()
            if gpu_layers:
                break  # repacking is a CPU matter
    return out


def lossless_on_gpu(model: Path, prompts: Path, gpu_layers: int = 99, threads: int = 8) -> dict:
    from engine.drafters import make_drafter
    from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
    from engine.drafters.memory import MemoryDrafter
    from tests.conftest import drafted_equals_plain, pick_per_category, plain_answers

    rows = pick_per_category([json.loads(x) for x in prompts.read_text().splitlines()
                              if x.strip()], 1)
    out: dict = {"prompts": len(rows), "max_tokens": MAX_TOKENS, "gpu_layers": gpu_layers,
                 "threads": threads}
    config = TargetConfig(n_ctx=2048, n_threads=threads, n_gpu_layers=gpu_layers)
    with Target(model, config) as target:
        t0 = time.perf_counter()
        plain = plain_answers(target, rows, MAX_TOKENS)
        out["plain_s"] = time.perf_counter() - t0
        drafters = {
            "lookup-tree": lambda: PromptLookupDrafter(LookupConfig(max_branches=3)),
            "head-chain-cuda": lambda: make_drafter("head", target=target, device="cuda",
                                                    mode="chain"),
            "head-tree-cuda": lambda: make_drafter("head", target=target, device="cuda",
                                                   mode="tree"),
        }
        for name, build in drafters.items():
            try:
                drafter = build()
                t0 = time.perf_counter()
                outs = drafted_equals_plain(target, drafter, rows, plain, MAX_TOKENS)
                out[name] = {"identical": True, "seconds": time.perf_counter() - t0,
                             "accepted": sum(s.n_accepted for o in outs for s in o.stats.steps)}
            except AssertionError as exc:
                out[name] = {"identical": False, "where": str(exc)}
            except Exception as exc:  # noqa: BLE001 - e.g. no torch in this process
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        memory = MemoryDrafter()
        for _ in range(2):
            outs = drafted_equals_plain(target, memory, rows[:4], plain, MAX_TOKENS)
        out["memory"] = {"identical": True,
                         "accepted": sum(s.n_accepted for o in outs for s in o.stats.steps)}
    return out


def verify_curves(model: Path, placements: list[tuple[str, int, int]],
                  context: int = 256) -> dict:
    from engine.planning.calibration import measure_verify_curve

    out = {}
    for label, gpu_layers, threads in placements:
        config = TargetConfig(n_ctx=context + 128, n_threads=threads, n_gpu_layers=gpu_layers)
        with Target(model, config) as target:
            timings: dict[str, float] = {}
            curve = measure_verify_curve(target, context, repeats=3, timings=timings)
            out[label] = {"verify_s": curve, "prefill_s": timings.get("prefill_s")}
    return out


def synthetic_shape_curves(shape_name: str, workdir: Path, tokenizer_from: Path,
                           placements: list[tuple[str, int, int]]) -> dict:
    from engine.gguf.model_shapes import shape_named
    from engine.gguf.synthetic import write_synthetic_gguf

    shape = shape_named(shape_name)
    path = workdir / f"{shape.name}.gguf"
    workdir.mkdir(parents=True, exist_ok=True)
    write_synthetic_gguf(shape, path, tokenizer_from)
    try:
        out = verify_curves(path, placements)
        out["exactness_gpu"] = exactness(path, [("gpu", 99, 8)], contexts=(0,))
        return out
    finally:
        path.unlink(missing_ok=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--gpu-layers", type=int, default=99, help="the target's, for step 3")
    p.add_argument("--steps", default="exactness,lossless,verify", help="which steps to run")
    p.add_argument("--no-hardware", action="store_true", help="skip the hardware probe")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/gpu-check"))
    p.add_argument("--model", type=Path, default=None,
                   help="the target (default: the bundled model's Q4_0); the synthetic "
                        "shapes take its tokenizer")
    args = p.parse_args()
    from engine.hub.model_store import bundled_model_path, default_model_path

    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or default_model_path()
    tokenizer_from = args.model or bundled_model_path()
    results: dict = {"model": str(model), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    cpu_and_gpu = [("gpu", 99, 8), ("cpu16", 0, 16)]
    curves = [("gpu", 99, 8), ("cpu16", 0, 16), ("cpu8", 0, 8), ("cpu4", 0, 4)]
    if not args.no_hardware:
        _step(args.out, results, "hardware", hardware)
    steps = args.steps.split(",")
    if "exactness" in steps:
        _step(args.out, results, "exactness", lambda: exactness(model, cpu_and_gpu))
    if "lossless" in steps:
        _step(args.out, results, "lossless", lambda: lossless_on_gpu(model, args.prompts,
                                                                    args.gpu_layers))
    if "verify" in steps:
        _step(args.out, results, "verify_default", lambda: verify_curves(model, curves))
    for name in filter(None, args.shapes.split(",")):
        _step(args.out, results, f"shape {name}",
              lambda n=name: synthetic_shape_curves(n, args.workdir, tokenizer_from,
                                                    curves))
    failed = lossless_failures(results)
    for line in failed:
        print(f"!! {line}", file=sys.stderr)
    return 1 if failed else 0


def lossless_failures(results: dict) -> list[str]:
    """What broke the lossless contract: a drafter whose answers differed from plain
    decoding, or a lossless step that did not run at all. (Drafters this process cannot
    build, torch's CUDA heads without torch, are reported, not failures.)"""
    lossless = results.get("lossless")
    if lossless is None:
        return []
    if "error" in lossless and "prompts" not in lossless:
        return [f"the lossless step failed: {lossless['error']}"]
    return [f"{name}: drafted answers differ from plain decoding ({row.get('where', '')})"
            for name, row in lossless.items()
            if isinstance(row, dict) and row.get("identical") is False]


if __name__ == "__main__":
    raise SystemExit(main())
