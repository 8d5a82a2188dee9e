"""``tandem bench``: drafters and llama.cpp's peers side by side on benchmark prompts."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from app.cli.common import add_head_args, add_model_args, engine_config, progress_to
from engine.drafters.kinds import DrafterKind
from engine.runtime.hardware import default_threads
from engine.runtime.target import Target
from engine.session import ENGINE_DRAFTERS, Engine
from training.spec_bench import BenchPrompt


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from app.benchmarks.bench import (
        PREDICTING,
        engine_runner,
        format_table,
        parse_drafter_list,
        run_bench,
        runner_engine_config,
        sharegpt_prompts,
        sweep_specs,
        warm_memories,
    )
    from app.benchmarks.bench_baselines import (
        BASELINE_NAMES,
        SERVER_NAMES,
        baseline_runner,
        server_runner,
    )
    from training.spec_bench import load_prompts

    if args.attention is not None:
        return _attention(args)
    if args.heal:
        return _heal(args)
    if args.workers_trend:
        return _workers_trend(args)
    if args.sweep:
        from engine.runtime.hardware import probe_hardware

        hw = probe_hardware()
        layouts = ["plain", "cpu"] + (["dovetail"] if hw.has_gpu else []) + (
            ["duodecoding"] if hw.has_gpu and hw.llama_gpu_offload else [])
        args.drafters = ",".join(sweep_specs(layouts))
    if args.drafters is None:
        args.drafters = ("none,auto" + (",server" if args.llama_server else "")
                         if args.long_context is not None else
                         "none,auto" if args.tool_loop else "none,lookup")
    names = parse_drafter_list(args.drafters, (*ENGINE_DRAFTERS, *BASELINE_NAMES,
                                               *SERVER_NAMES))
    if any(n in SERVER_NAMES for n in names) and not args.llama_server:
        raise ValueError("the server baselines need --llama-server PATH")
    if args.long_context is not None:
        return _long_context(args, names)
    if args.tool_loop:
        return _tool_loop(args, names)
    if args.documents is None and args.prompts is None:
        raise ValueError("give --prompts FILE, --documents for the document tasks, or "
                         "--long-context")
    if args.documents is not None and args.ctx is None:
        args.ctx = DOCUMENTS_CTX  # the largest documents and an edited file's answer
    memory_dir = _runs_memory_dir(args)
    if args.threads is None:
        # A fixed count for every runner: following the machine's load would read the
        # peer's spinning threads (llama-server's, after its run) as a busy machine and
        # decode on one thread.
        args.threads = default_threads()
    base = replace(engine_config(args, drafter=DrafterKind.NONE), memory_dir=memory_dir)
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
            engines[DrafterKind.NONE] = Engine(base)
            target = engines[DrafterKind.NONE].target
        prompts = (document_tasks(target, args.documents) if args.documents is not None
                   else load_prompts(args.prompts, args.per_category))
        runners = {}
        for n in names:
            if n in BASELINE_NAMES:
                runners[n] = baseline_runner(n, target)
            elif n in SERVER_NAMES:
                runners[n] = server_runner(n, target, args.llama_server)
            else:
                runners[n] = engine_runner(engines[n], n.endswith(PREDICTING))
        meta = {"model": str(target.path), "threads": target.n_threads,
                "max_tokens": args.max_tokens,
                "prompts": str(args.prompts) if args.documents is None
                else f"document tasks ({args.documents or 'all'})",
                "per_category": args.per_category, "drafters": names, "repeat": args.repeat,
                "pause_s": args.pause, "turns": args.turns,
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
                warm_memories(remembering, warm, args.max_tokens, progress_to(warm_bar))
        bar = tqdm(total=len(prompts) * len(names) * args.repeat, unit="run",
                   file=sys.stderr)
        payload = run_bench(target, prompts, runners, args.max_tokens, args.json,
                            meta, progress_to(bar), resume=not args.fresh, repeat=args.repeat,
                            pause_s=args.pause, all_turns=args.turns == "all")
        bar.close()
        switches = {n: len(e.plan_check.changes) for n, e in engines.items()
                    if e.plan_check is not None}
    finally:
        for engine in engines.values():
            engine.close()
    if args.turns == "all":
        print("first turns")
    print(format_table(payload["summary"]))
    if args.turns == "all":
        print("\nfollow-up turns (each runner continues its own conversation, the turns "
              "before cached)")
        print(format_table(payload["summary_follow_up"]))
    for n, count in switches.items():
        print(f"{n}: {count} plan change(s) during the run")
    if args.json and switches:
        data = json.loads(args.json.read_text())
        data["plan_changes"] = switches
        args.json.write_text(json.dumps(data, indent=1))
    if args.json:
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def _runs_memory_dir(args: argparse.Namespace) -> Path:
    """Where the runners' memories live: Tandem's memory starts empty and fills as the run
    goes (as llama-server's n-gram pool does), never the user's own (which may hold these
    very answers); beside the results, so a resumed run keeps it."""
    memory_dir = (args.json.with_name(args.json.name + ".memory") if args.json
                  else Path(tempfile.mkdtemp(prefix="tandem-bench-memory-")))
    if args.fresh or not (args.json and args.json.exists()):
        shutil.rmtree(memory_dir, ignore_errors=True)
    return memory_dir


# The document tasks' context: their largest documents (~7k tokens) and answers fit.
DOCUMENTS_CTX = 8192


def document_tasks(target: Target, categories: str) -> list[BenchPrompt]:
    """The document tasks (app.benchmarks.document_tasks), only ``categories`` (comma-
    separated) when given."""
    from app.benchmarks.document_tasks import document_prompts

    wanted = {c.strip() for c in categories.split(",") if c.strip()}
    prompts = document_prompts(lambda text: len(target.tokenize(text, special=False)))
    return [p for p in prompts if not wanted or p.category in wanted]


def _attention(args: argparse.Namespace) -> int:
    """``--attention``: verification and prompt cost through each CPU attention path at
    long contexts (app.benchmarks.attention_bench)."""
    from tqdm import tqdm

    from app.benchmarks.attention_bench import (
        PATHS,
        format_attention_table,
        run_attention_bench,
    )
    from app.benchmarks.long_context import long_text
    from engine.hub.model_store import default_model_path
    from engine.runtime.native import NativeModel

    contexts = sorted(int(s) for s in args.attention.split(",") if s.strip())
    path = args.model or default_model_path()
    model = NativeModel(path)
    try:
        tokens = model.tokenize(long_text(), add_special=False, parse_special=False)
    finally:
        model.close()
    repeats = max(args.repeat, 1)
    bar = tqdm(total=len(contexts) * repeats * len(PATHS), unit="round", file=sys.stderr)

    def on_round(what: str) -> None:
        bar.set_description(what)
        bar.update()
    try:
        payload = run_attention_bench(Path(path), tokens, contexts, repeats,
                                      args.threads or default_threads(), args.json, on_round)
    finally:
        bar.close()
    print(format_attention_table(payload))
    return 0


def _long_context(args: argparse.Namespace, names: list[str]) -> int:
    """``--long-context``: a question after 2-32k tokens (as the model allows), each
    runner's prompt and decode speed, and the peak memory at the largest prompt
    (app.benchmarks.long_context)."""
    from tqdm import tqdm

    from app.benchmarks.bench import engine_runner, run_bench, runner_engine_config
    from app.benchmarks.bench_baselines import SERVER_NAMES, server_runner
    from app.benchmarks.long_context import (
        LONG_SIZES,
        bench_context,
        engine_peak,
        format_long_table,
        long_prompts,
        peak_bytes,
    )
    from engine.runtime.model_info import read_model_info

    sizes = tuple(int(s) for s in args.long_context.split(",") if s.strip()) or LONG_SIZES
    if args.threads is None:
        args.threads = default_threads()
    base = engine_config(args, drafter=DrafterKind.NONE)
    from engine.hub.model_store import default_model_path

    info = read_model_info(base.model_path or default_model_path())
    n_train = info.header.context_length or max(sizes) + args.max_tokens
    base = replace(base, n_ctx=args.ctx or bench_context(n_train, args.max_tokens, sizes),
                   memory_dir=_runs_memory_dir(args))
    if args.fresh and args.json and args.json.exists():
        args.json.unlink()
    engines: dict[str, Engine] = {}
    servers: dict[str, int] = {}
    try:
        tandem = [n for n in names if n not in SERVER_NAMES]
        for n in tandem or [DrafterKind.NONE]:
            engines[n] = Engine(runner_engine_config(n, base))
        target = next(iter(engines.values())).target
        prompts = long_prompts(lambda text: len(target.tokenize(text, special=False)),
                               n_train, args.max_tokens, sizes)
        runners = {}
        for n in names:
            if n in SERVER_NAMES:
                runners[n] = server_runner(n, target, args.llama_server)
                servers[n] = runners[n].pid  # type: ignore[attr-defined]
            else:
                runners[n] = engine_runner(engines[n])
        meta = {"model": str(target.path), "threads": target.n_threads, "n_ctx": target.n_ctx,
                "max_tokens": args.max_tokens, "prompts": "long context", "sizes": sizes,
                "drafters": names, "repeat": args.repeat, "kv_cache": args.kv_cache,
                "flash_attn": target.flash_attn, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        bar = tqdm(total=len(prompts) * len(names) * args.repeat, unit="run", file=sys.stderr)
        payload = run_bench(target, prompts, runners, args.max_tokens, args.json, meta,
                            progress_to(bar), resume=not args.fresh, repeat=args.repeat,
                            pause_s=args.pause)
        bar.close()
        memory = {n: {"peak_bytes": peak_bytes(pid)} for n, pid in servers.items()}
        largest = target.chat_prompt([{"role": "user", "content": prompts[-1].turns[0]}])
    finally:
        for engine in engines.values():
            engine.close()
    if not args.no_memory:
        for n in tandem:
            print(f"tandem: {n}: peak memory at {len(largest)} tokens, in a child process",
                  file=sys.stderr)
            memory[n] = engine_peak(n, base, largest, args.max_tokens)
    print(format_long_table(payload, memory))
    if args.json:
        data = json.loads(args.json.read_text())
        data["memory"] = memory
        args.json.write_text(json.dumps(data, indent=1))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def _tool_loop(args: argparse.Namespace, names: list[str]) -> int:
    """``--tool-loop``: questions answered through an MCP server over a folder made for
    them, each runner on the same loop (app.benchmarks.tool_loop)."""
    from tqdm import tqdm

    from app.benchmarks.bench import runner_engine_config
    from app.benchmarks.tool_loop import (
        SERVER_NAME,
        TOOL_ROUNDS,
        TOOL_TASKS,
        bench_meta,
        format_tool_table,
        make_tool_folder,
        run_tool_bench,
    )
    from app.tools.mcp_host import RUNNING, McpHost
    from app.tools.server_config import ServerConfig
    from engine.conversation import AnswerService

    if args.threads is None:
        args.threads = default_threads()
    base = replace(engine_config(args, drafter=DrafterKind.NONE),
                   memory_dir=_runs_memory_dir(args))
    folder = make_tool_folder(Path(tempfile.mkdtemp(prefix="tandem-tool-loop-")) / "files")
    host = McpHost()
    services: dict[str, AnswerService] = {}
    try:
        host.start(ServerConfig(SERVER_NAME, sys.executable,
                                ("-m", "app.tools.files_server", str(folder))))
        status = host.wait_started(SERVER_NAME)
        if status.state != RUNNING:
            raise RuntimeError(f"the files server did not start: {status.message}")
        for n in names:
            config = runner_engine_config(n, base)
            services[n] = AnswerService(Engine(config), config)
        tasks = list(TOOL_TASKS)
        with tqdm(total=len(tasks) * len(names), unit="loop", file=sys.stderr) as bar:
            out = run_tool_bench(services, host, tasks, TOOL_ROUNDS, args.max_tokens,
                                 lambda _what: bar.update())
        first = next(iter(services.values())).engine
        assert first is not None
        out["meta"] = bench_meta(str(first.target.path), first.target.n_threads,
                                 TOOL_ROUNDS, args.max_tokens, names)
    finally:
        for service in services.values():
            service.close()
        host.close()
        shutil.rmtree(folder.parent, ignore_errors=True)
    print(format_tool_table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def _heal(args: argparse.Namespace) -> int:
    """``--heal N``: a plan made under load, then N answers on the quiet machine."""
    from app.benchmarks.heal_bench import format_heal, run_heal_bench
    from training.spec_bench import load_prompts

    base = engine_config(args, drafter=DrafterKind.AUTO)
    rows = load_prompts(args.prompts, 1)[:args.heal]
    workdir = Path(tempfile.mkdtemp(prefix="tandem-heal-"))
    try:
        with Engine(replace(base, drafter=DrafterKind.NONE, cache_dir=workdir / "tokens")) as e:
            prompts = [e.chat_prompt([{"role": "user", "content": r.turns[0]}]) for r in rows]
        out = run_heal_bench(base, prompts, args.max_tokens, workdir,
                             lambda what: print(f"tandem: {what}...", file=sys.stderr))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(format_heal(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def _workers_trend(args: argparse.Namespace) -> int:
    """``--workers-trend``: plain and auto, here and through a worker
    (app.benchmarks.worker_bench)."""
    from app.benchmarks.worker_bench import format_worker_table, run_worker_bench
    from engine.workers.endpoints import parse_workers
    from training.spec_bench import load_prompts

    base = replace(engine_config(args, drafter=DrafterKind.AUTO), workers=())
    rows = load_prompts(args.prompts, args.per_category)
    prompts = [[{"role": "user", "content": r.turns[0]}] for r in rows]
    if args.fresh and args.json and args.json.exists():
        args.json.unlink()
    workers = parse_workers(args.workers)
    out = run_worker_bench(base, prompts, args.max_tokens, args.json,
                           lambda what: print(f"tandem: {what}", file=sys.stderr, flush=True),
                           worker=workers[0] if workers else None)
    print(format_worker_table(out))
    if args.json:
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` to the ``tandem`` command's sub-parsers."""
    p = subparsers.add_parser("bench", help="drafters side by side on benchmark prompts")
    add_model_args(p)
    p.add_argument("--prompts", type=Path, default=None, help="Spec-Bench style JSONL")
    p.add_argument("--documents", nargs="?", const="", default=None, metavar="CATEGORIES",
                   help="the document tasks instead of --prompts (questions, extractions "
                        "and summaries over 1-8k-token documents, code edits sent with "
                        "the file as a prediction: give a runner NAME+prediction); "
                        "optionally only these comma-separated categories")
    p.add_argument("--long-context", nargs="?", const="", default=None, metavar="SIZES",
                   help="long prompts instead of --prompts: a question after 2k, 8k, 16k "
                        "and 32k tokens of source code (or these comma-separated sizes), "
                        "each where the model's context holds it; prompt and decode speed "
                        "and the process's peak memory (default runners none,auto,server "
                        "with --llama-server)")
    p.add_argument("--attention", default=None, metavar="CONTEXTS",
                   help="verification c(1..16) and the prompt's time at these "
                        "comma-separated contexts through each CPU attention path (the "
                        "tiled kernel, ggml's own, matrix products), interleaved "
                        "--repeat rounds; saved after each context to --json (resumes)")
    p.add_argument("--tool-loop", action="store_true",
                   help="questions about a folder of files answered through a real MCP "
                        "server (list, read, search): the first answers of each call "
                        "tools, the last answers; tok/s over the whole loop and by turn "
                        "(default runners none,auto)")
    p.add_argument("--no-memory", action="store_true",
                   help="with --long-context: skip the peak-memory runs")
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--drafters", default=None,
                   help="comma-separated (default none,lookup): auto (the plan), "
                        "auto@LAYOUT, none, memory, "
                        "lookup, head, head-chain, head-multi, head-ahead, head+memory, "
                        "NAME:N (fixed budget of N); "
                        "baselines: lcp, lcp-lookup (llama-cpp-python's "
                        "own), server, server-ngram (llama.cpp's llama-server, with "
                        "Tandem's KV-cache types), server-f16 (llama-server with its "
                        "default F16 cache)")
    p.add_argument("--sweep", action="store_true",
                   help="the automatic plan next to fixed budgets and every possible layout")
    p.add_argument("--max-tokens", type=int, default=128)
    add_head_args(p)
    p.add_argument("--json", type=Path, default=None, help="write results here (resumes)")
    p.add_argument("--fresh", action="store_true", help="ignore results already in --json")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per prompt and drafter, interleaved; the median run is kept and the "
                        "spread of all shown (3 or more on a noisy machine)")
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
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="all: play each prompt's turns as one conversation per runner, "
                        "each continuing from its own answers with the turns before "
                        "cached (llama-server with cache_prompt on); first and follow-up "
                        "turns are reported apart")
    p.add_argument("--heal", type=int, default=0, metavar="N",
                   help="the healing benchmark: auto plans while another llama.cpp process "
                        "decodes on the same cores, then answers N prompts (one per "
                        "category) on the quiet machine; prints the plans and each "
                        "answer's speed")
    p.add_argument("--workers-trend", action="store_true",
                   help="the workers benchmark: plain and auto with the target here and on "
                        "a worker (one started on loopback, or the first of --workers), "
                        "also behind 1 ms and 5 ms of added round trip")
    p.set_defaults(func=cmd_bench)
