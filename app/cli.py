"""The ``tandem`` command: chat, generate, bench."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.profile_cli import print_candidates
from engine.errors import InvalidSettingError, TandemError
from engine.generation import GenerationConfig
from engine.planner import LAYOUTS, Overrides
from engine.sampling import CHAT_DEFAULTS, SamplingParams
from engine.session import ENGINE_DRAFTERS, Engine, EngineConfig
from engine.stats import GenerationStats
from engine.target import Target


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF target (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: cores)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length in tokens (default: 4096, or the model's trained "
                        "context if less)")
    p.add_argument("--kv-cache", choices=("exact", "fast"), default="exact",
                   help="exact: output identical to plain decoding (Q8_0 K); fast: F16 "
                        "K/V, a faster first token on long prompts (tandem plan says more)")


def _add_head_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-head", type=Path, default=None,
                   help="draft head directory, Tandem's or a public EAGLE-1 checkpoint "
                        "(default: the one trained for the bundled model)")
    p.add_argument("--head-device", default="cpu", help="where the draft head runs: cpu, cuda, mps")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="a small GGUF of the target's family to draft with (--drafter draft); "
                        "its vocabulary must match the target's")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="override the planner's layout (with --drafter auto)")
    p.add_argument("--budget", type=int, default=None,
                   help="draft tokens verified per step at most (0: no drafting)")
    p.add_argument("--depth", type=int, default=None, help="draft depth at most")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure this machine again instead of using the cached costs")


def _overrides(args: argparse.Namespace) -> Overrides:
    return Overrides(layout=getattr(args, "layout", None), max_draft=getattr(args, "budget", None),
                     depth=getattr(args, "depth", None))


def _engine_config(args: argparse.Namespace, drafter: str | None = None) -> EngineConfig:
    return EngineConfig(model_path=args.model, drafter=drafter or args.drafter,
                        head_dir=getattr(args, "draft_head", None),
                        head_device=getattr(args, "head_device", "cpu"),
                        overrides=_overrides(args), n_ctx=args.ctx, n_threads=args.threads,
                        recalibrate=getattr(args, "recalibrate", False),
                        kv_cache=args.kv_cache,
                        draft_model=getattr(args, "draft_model", None))


def _open_engine(args: argparse.Namespace, drafter: str | None = None) -> Engine:
    """The engine as asked (``auto``: as planned), its notes on stderr."""
    def progress(what: str) -> None:
        print(f"tandem: {what}...", file=sys.stderr, flush=True)

    engine = Engine(_engine_config(args, drafter), progress=progress)
    if engine.plan is not None and args.verbose:
        print(engine.plan.describe(), file=sys.stderr)
    for note in engine.notes:
        print(f"tandem: {note}", file=sys.stderr)
    return engine


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", choices=ENGINE_DRAFTERS, default="auto",
                   help="auto: the planner picks layout, drafter and budget (tandem plan)")
    _add_head_args(p)
    _add_plan_args(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--min-p", type=float, default=CHAT_DEFAULTS.min_p,
                   help="drop tokens below this fraction of the most likely one (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=CHAT_DEFAULTS.repeat_penalty,
                   help=f"penalise tokens of the last --penalty-last-n (1 = off; default "
                        f"{CHAT_DEFAULTS.repeat_penalty}: the bundled model loops without)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="lower a token's logit per occurrence in the window (-2..2)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="lower a token's logit once if it is in the window (-2..2)")
    p.add_argument("--penalty-last-n", type=int, default=CHAT_DEFAULTS.penalty_last_n,
                   help="how many tokens before each position the penalties look at")
    p.add_argument("--max-tokens", type=int, default=512)


def _gen_config(args: argparse.Namespace) -> GenerationConfig:
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty,
                              frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty,
                              penalty_last_n=args.penalty_last_n)
    return GenerationConfig(max_tokens=args.max_tokens, sampling=sampling)


def cmd_generate(args: argparse.Namespace) -> int:
    config = _gen_config(args)
    with _open_engine(args) as engine:
        prompt = (engine.target.tokenize(args.prompt) if args.raw
                  else engine.chat_prompt([{"role": "user", "content": args.prompt}]))
        stream = None if args.json else (lambda s: print(s, end="", flush=True))
        result = engine.generate(prompt, config, on_text=stream)
        plan = engine.plan.to_json() if engine.plan is not None else None
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens,
                          "finish_reason": result.finish_reason,
                          "stats": result.stats.summary(), "plan": plan}))
    else:
        print()
        print(_stats_line(result.stats), file=sys.stderr)
    return 0


def _stats_line(stats: GenerationStats) -> str:
    line = (f"[{stats.n_new} tokens, {stats.tok_per_s:.1f} tok/s, "
            f"first token {stats.ttft_s * 1000:.0f} ms")
    if stats.drafter != "none":
        line += f", {stats.mean_accepted:.2f} tokens per verification"
    return line + "]"


def cmd_chat(args: argparse.Namespace) -> int:
    config = _gen_config(args)
    with _open_engine(args) as engine:
        print(f"Tandem chat on {engine.describe()}. /reset clears, /quit or Ctrl-D leaves.")
        messages: list[dict[str, str]] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        n_fixed = len(messages)
        while True:
            try:
                user = input("\nyou> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not user:
                continue
            if user in ("/quit", "/exit"):
                return 0
            if user == "/reset":
                del messages[n_fixed:]
                print("(conversation cleared)")
                continue
            messages.append({"role": "user", "content": user})
            print("tandem> ", end="", flush=True)
            try:
                result = engine.generate(engine.chat_prompt(messages), config,
                                         on_text=lambda s: print(s, end="", flush=True))
            except KeyboardInterrupt:
                print("\n(stopped)")
                messages.pop()
                continue
            except TandemError as exc:
                print(f"\n(error: {exc})")
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": result.text})
            print("\n" + _stats_line(result.stats))


def cmd_serve(args: argparse.Namespace) -> int:
    import threading

    from app.server.serve import ApiServer, check_binding

    check_binding(args.host, args.port, args.api_key)  # before the model loads
    if args.queue < 1 or args.max_tokens < 1:
        raise ValueError("--queue and --max-tokens must be at least 1")
    with _open_engine(args) as engine:
        server = ApiServer(lambda: engine, threading.Lock(), args.host, args.port,
                           args.api_key, args.queue, min(args.max_tokens, engine.target.n_ctx))
        print(f"Tandem serving {engine.describe()} at {server.url} "
              f"(OpenAI API; Ctrl-C stops)", flush=True)
        server.run()
    return 0


def _progress_to(bar: Any) -> Callable[[int, int, str], None]:
    """A (done, total, what) progress callback that moves a tqdm bar."""
    def progress(i: int, total: int, what: str) -> None:
        bar.n = i
        bar.set_postfix_str(what)
        bar.refresh()
    return progress


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from app.bench import (
        engine_runner,
        format_table,
        load_prompts,
        parse_drafter_list,
        run_bench,
        runner_engine_config,
        sharegpt_prompts,
        sweep_specs,
        warm_memories,
    )
    from app.bench_baselines import (
        BASELINE_NAMES,
        SERVER_NAMES,
        baseline_runner,
        server_runner,
    )

    if args.sweep:
        from engine.hardware import probe_hardware

        hw = probe_hardware()
        layouts = ["plain", "cpu"] + (["dovetail"] if hw.has_gpu else []) + (
            ["duodecoding"] if hw.has_gpu and hw.llama_gpu_offload else [])
        args.drafters = ",".join(sweep_specs(layouts))
    names = parse_drafter_list(args.drafters, (*ENGINE_DRAFTERS, *BASELINE_NAMES,
                                               *SERVER_NAMES))
    if any(n in SERVER_NAMES for n in names) and not args.llama_server:
        raise ValueError("the server baselines need --llama-server PATH")
    prompts = load_prompts(args.prompts, args.per_category)
    # Tandem's memory starts empty (or warmed, --warm-memory) and fills as the run goes
    # (as llama-server's n-gram pool does); it lives beside the results so a resumed run
    # keeps it.
    memory_dir = (args.json.with_name(args.json.name + ".memory") if args.json
                  else Path(tempfile.mkdtemp(prefix="tandem-bench-memory-")))
    if args.fresh or not (args.json and args.json.exists()):
        shutil.rmtree(memory_dir, ignore_errors=True)
    base = replace(_engine_config(args, drafter="none"), memory_dir=memory_dir)
    engines: dict[str, Engine] = {}
    try:
        # One engine per Tandem runner (its own target where its plan puts it, drafter,
        # governor and cost model); the baselines run the first one's model file.
        for n in names:
            if n not in BASELINE_NAMES and n not in SERVER_NAMES:
                engines[n] = Engine(runner_engine_config(n, base))
                for note in engines[n].notes:
                    print(f"tandem: {n}: {note}", file=sys.stderr)
        target = next(iter(engines.values())).target if engines else None
        if target is None:
            engines["none"] = Engine(base)
            target = engines["none"].target
        runners = {}
        for n in names:
            if n in BASELINE_NAMES:
                runners[n] = baseline_runner(n, target)
            elif n in SERVER_NAMES:
                runners[n] = server_runner(n, target, args.llama_server)
            else:
                runners[n] = engine_runner(engines[n])
        meta = {"model": str(target.path), "threads": target.n_threads,
                "max_tokens": args.max_tokens, "prompts": str(args.prompts),
                "per_category": args.per_category, "drafters": names, "repeat": args.repeat,
                "pause_s": args.pause,
                "kv_cache": args.kv_cache,
                "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        if args.warm_memory and not (args.json and args.json.exists() and not args.fresh):
            # Only the runners that remember: Tandem's with a memory, llama-server's pool.
            remembering = {n: runners[n] for n in names if n == "server-ngram" or (
                n in engines and engines[n].memory is not None)}
            warm = sharegpt_prompts(target, args.warm_memory)
            meta["warm_memory"] = {"prompts": len(warm), "runners": list(remembering)}
            with tqdm(total=len(warm) * len(remembering), unit="answer",
                      file=sys.stderr) as warm_bar:
                warm_memories(remembering, warm, args.max_tokens, _progress_to(warm_bar))
        bar = tqdm(total=len(prompts) * len(names) * args.repeat, unit="run",
                   file=sys.stderr)
        payload = run_bench(target, prompts, runners, args.max_tokens, args.json,
                            meta, _progress_to(bar), resume=not args.fresh, repeat=args.repeat,
                            pause_s=args.pause)
        bar.close()
    finally:
        for engine in engines.values():
            engine.close()
    print(format_table(payload["summary"]))
    if args.json:
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def _measure_acceptance(args: argparse.Namespace, target: Target) -> int:
    """Write the head's acceptance by depth on real prompts next to its weights: the
    planner's prior (the governor corrects it online)."""
    from app.bench import load_prompts
    from engine.calibration import measure_acceptance
    from engine.drafters import DEFAULT_HEAD_DIR

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


def cmd_plan(args: argparse.Namespace) -> int:
    if args.profile is not None:
        from app.profile_cli import show_profile_plan

        return show_profile_plan(args.profile, args.acceptance, args.json)
    if args.measure_acceptance:
        with _open_engine(args, drafter="none") as engine:
            return _measure_acceptance(args, engine.target)
    with _open_engine(args, drafter="auto") as engine:
        plan, costs, hardware = engine.plan, engine.costs, engine.hardware
        notes, calibrated_now = engine.notes, engine.calibrated_now
        kv_text = engine.kv_cache_text
    assert plan is not None and costs is not None
    if args.json:
        print(json.dumps({"plan": plan.to_json(), "costs": costs.to_json(),
                          "hardware": hardware.to_json(), "notes": notes,
                          "kv_cache": kv_text},
                         indent=1))
        return 0
    print(plan.describe())
    print(kv_text[:1].upper() + kv_text[1:] + ". --kv-cache exact|fast chooses.")
    cached = "measured now" if calibrated_now else "cached; --recalibrate measures again"
    t1 = costs.verify_s.get("cpu", {}).get(1)
    curve = ", ".join(f"{n}: {t / t1:.2f}x" for n, t in sorted(costs.verify_s["cpu"].items())
                      if n > 1) if t1 else ""
    print(f"\nCosts ({cached}):")
    if t1:
        print(f"  target, one token: {t1 * 1000:.1f} ms; n tokens, relative: {curve}")
    for dev, lvl in costs.head_level_s.items():
        print(f"  draft head on {dev}: {lvl * 1000:.2f} ms per level, "
              f"{costs.head_update_s[dev] * 1000:.2f} ms per step to read accepted tokens")
    for dev, tok in costs.draft_token_s.items():
        print(f"  draft model on the {dev.upper()}: {tok * 1000:.2f} ms per token, "
              f"{costs.draft_sync_s.get(dev, 0) * 1000:.2f} ms per step to catch up")
    for note in notes:
        print(f"  note: {note}")
    print_candidates(plan)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="chat in the terminal")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", default="", help="system prompt")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("generate", help="answer one prompt")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--json", action="store_true", help='print {"text", "tokens", "stats"}')
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="an OpenAI-compatible API for other programs")
    _add_model_args(p)
    p.add_argument("--drafter", choices=ENGINE_DRAFTERS, default="auto",
                   help="auto: the planner picks layout, drafter and budget (tandem plan)")
    _add_head_args(p)
    _add_plan_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (anything but loopback needs --api-key)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--queue", type=int, default=8,
                   help="requests that may wait for the model; more get 429")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="the most new tokens one request may ask for")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plan", help="what this machine runs where, and why")
    _add_model_args(p)
    _add_head_args(p)
    _add_plan_args(p)
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

    p = sub.add_parser("bench", help="drafters side by side on benchmark prompts")
    _add_model_args(p)
    p.add_argument("--prompts", type=Path, required=True, help="Spec-Bench style JSONL")
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--drafters", default="none,lookup",
                   help="comma-separated: auto (the plan), auto@LAYOUT, none, memory, "
                        "lookup, head, head-chain, head-multi, head-ahead, head+memory, "
                        "NAME:N (fixed budget of N); "
                        "baselines: lcp, lcp-lookup (llama-cpp-python's "
                        "own), server, server-ngram (llama.cpp's llama-server, with "
                        "Tandem's KV-cache types), server-f16 (llama-server with its "
                        "default F16 cache)")
    p.add_argument("--sweep", action="store_true",
                   help="the automatic plan next to fixed budgets and every possible layout")
    p.add_argument("--max-tokens", type=int, default=128)
    _add_head_args(p)
    p.add_argument("--json", type=Path, default=None, help="write results here (resumes)")
    p.add_argument("--fresh", action="store_true", help="ignore results already in --json")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per prompt and drafter; the fastest is kept (noisy machines)")
    p.add_argument("--pause", type=float, default=0.25,
                   help="seconds of rest before each run, so none starts while the last "
                        "one's threads (another process's, for llama-server) still spin")
    p.add_argument("--llama-server", default=None,
                   help="llama.cpp's llama-server binary, for the server and server-ngram "
                        "baselines")
    p.add_argument("--warm-memory", type=int, default=0, metavar="N",
                   help="before a fresh run, the runners that remember (Tandem's memory, "
                        "server-ngram's pool) answer N ShareGPT prompts untimed, as after "
                        "some use of the app (default 0: they start empty)")
    p.set_defaults(func=cmd_bench)

    from app.train_cli import register as register_train

    register_train(sub)
    from app.models_cli import register as register_models

    register_models(sub)
    from app.profile_cli import register as register_profile

    register_profile(sub)
    return parser


# The engine's setting names whose flag is not the name with dashes.
_FLAGS = {"n_ctx": "--ctx", "n_threads": "--threads", "max_draft": "--budget"}


def flag_of(setting: str) -> str:
    return _FLAGS.get(setting, "--" + setting.replace("_", "-"))


def error_line(exc: BaseException) -> str:
    """One line for the terminal; a setting's error names its flag."""
    text = exc.named(flag_of(exc.setting)) if isinstance(exc, InvalidSettingError) else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except (TandemError, ValueError, OSError, MemoryError) as exc:
        print(f"tandem: error: {error_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: stop quietly, as a terminal program does
        print("\ntandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
