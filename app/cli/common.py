"""What several commands share: the model, head, plan and sampling flags, the engine they
open, and the lines they print."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.conversation import AnswerService
from engine.decoding.generation import GenerationConfig
from engine.decoding.json_grammar import json_schema_text_grammar
from engine.decoding.sampling import CHAT_DEFAULTS, SamplingParams
from engine.decoding.stats import GenerationStats
from engine.drafters.kinds import CHOICES, DrafterKind, is_plain
from engine.planning.measure_progress import Measuring
from engine.planning.planner import LAYOUTS, Overrides
from engine.session import Engine, EngineConfig
from engine.session_process import EngineProcess
from engine.workers.endpoints import parse_workers

MEASURE_STEPS = 1000  # the measurement's bar: 0.1% a step


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF target (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: cores)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length in tokens (default: 4096, or the model's trained "
                        "context if less)")
    p.add_argument("--workers", default=None, metavar="HOST:PORT[,...]",
                   help="put the target's layers and KV cache on workers (`tandem worker` on "
                        "another machine; loopback or an SSH tunnel: the protocol has no "
                        "authentication); drafts are made here")
    p.add_argument("--worker-layers", type=int, default=None,
                   help="how many of the target's layers go to the workers (-1: all; "
                        "default: as many as their free memory holds)")
    p.add_argument("--kv-cache", choices=("exact", "fast"), default="exact",
                   help="exact: output identical to plain decoding (Q8_0 K); fast: F16 "
                        "K/V, a faster first token on long prompts (tandem plan says more)")
    p.add_argument("--flash-attn", choices=tuple(FLASH_ATTN), default="auto",
                   help="llama.cpp's flash attention (auto: off where the target runs on "
                        "this machine's CPU with the exact cache, which decodes long "
                        "contexts faster and verifies chains only; on elsewhere)")


# --flash-attn's choices, as EngineConfig.flash_attn takes them.
FLASH_ATTN: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def add_head_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-head", type=Path, default=None,
                   help="draft head directory, Tandem's or a public EAGLE-1 checkpoint, "
                        "or an EAGLE-3 head GGUF with --drafter eagle3 (default: the one "
                        "trained for the bundled model)")
    p.add_argument("--head-device", default="cpu", help="where the draft head runs: cpu, cuda, mps")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="a small GGUF of the target's family to draft with (--drafter draft); "
                        "its vocabulary must match the target's")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="override the planner's layout (with --drafter auto)")
    p.add_argument("--budget", type=int, default=None,
                   help="draft tokens verified per step at most (0: no drafting)")
    p.add_argument("--depth", type=int, default=None, help="draft depth at most")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure this machine again instead of using the cached costs")


def overrides_from(args: argparse.Namespace) -> Overrides:
    return Overrides(layout=getattr(args, "layout", None), max_draft=getattr(args, "budget", None),
                     depth=getattr(args, "depth", None))


def engine_config(args: argparse.Namespace, drafter: DrafterKind | str | None = None
                  ) -> EngineConfig:
    return EngineConfig(model_path=args.model, drafter=drafter or args.drafter,
                        head_dir=getattr(args, "draft_head", None),
                        head_device=getattr(args, "head_device", "cpu"),
                        overrides=overrides_from(args), n_ctx=args.ctx, n_threads=args.threads,
                        recalibrate=getattr(args, "recalibrate", False),
                        kv_cache=args.kv_cache,
                        flash_attn=FLASH_ATTN[getattr(args, "flash_attn", "auto")],
                        draft_model=getattr(args, "draft_model", None),
                        workers=parse_workers(getattr(args, "workers", None)),
                        worker_layers=getattr(args, "worker_layers", None))


class LoadProgress:
    """The engine's progress on stderr: a line per message, and a bar (with the time
    left) while it measures this machine, on a first start with auto
    (engine.planning.measure_progress); lines only where stderr is no terminal."""

    def __init__(self) -> None:
        self.bar: Any = None
        self._said = ""

    def __call__(self, what: str) -> None:
        if not isinstance(what, Measuring):
            self._line(what)
            return
        if what.done >= 1.0:
            if self.bar is not None:
                self.bar.n = MEASURE_STEPS
                self.bar.close()
                self.bar = None
            self._line(what)
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=MEASURE_STEPS, desc="tandem: measuring this machine",
                            file=sys.stderr, disable=None,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                                       "[{elapsed}<{remaining}]{postfix}")
        if not self.bar.disable:
            self.bar.n = round(what.done * MEASURE_STEPS)
            self.bar.set_postfix_str(what)
        elif what != self._said:
            self._line(what)

    def _line(self, what: str) -> None:
        self._said = what
        print(f"tandem: {what}...", file=sys.stderr, flush=True)


def _say(note: str) -> None:
    print(f"tandem: {note}", file=sys.stderr, flush=True)


def open_service(args: argparse.Namespace, drafter: DrafterKind | str | None = None
                 ) -> AnswerService:
    """The engine as asked (``auto``: as planned) behind the one answer path, its notes
    on stderr; a lost worker's model reopens here, said on stderr too."""
    service = AnswerService.open(engine_config(args, drafter), LoadProgress(), on_note=_say)
    engine = service.engine
    assert engine is not None
    if engine.plan is not None and getattr(args, "verbose", False):
        print(engine.plan.describe(), file=sys.stderr)
    for note in engine.notes:
        _say(note)
    return service


def open_engine(args: argparse.Namespace, drafter: DrafterKind | str | None = None
                ) -> Engine | EngineProcess:
    """The engine alone, for the commands that look into it (plan, bench)."""
    engine = open_service(args, drafter).engine
    assert engine is not None
    return engine


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", choices=CHOICES, default=DrafterKind.AUTO.value,
                   help="auto: the planner picks layout, drafter and budget (tandem plan)")
    add_head_args(p)
    add_plan_args(p)
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
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                       help="answer as JSON matching this JSON schema (compact JSON)")
    shape.add_argument("--grammar", type=Path, default=None, metavar="FILE",
                       help="answer in this GBNF grammar (llama.cpp's)")


def _grammar_of(args: argparse.Namespace) -> str | None:
    if getattr(args, "grammar", None) is not None:
        return args.grammar.read_text(encoding="utf-8")
    if getattr(args, "json_schema", None) is not None:
        return json_schema_text_grammar(args.json_schema.read_text(encoding="utf-8"),
                                        f"--json-schema {args.json_schema}")
    return None


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty,
                              frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty,
                              penalty_last_n=args.penalty_last_n)
    return GenerationConfig(max_tokens=args.max_tokens, sampling=sampling,
                            grammar=_grammar_of(args))


def stats_line(stats: GenerationStats) -> str:
    line = (f"[{stats.n_new} tokens, {stats.tok_per_s:.1f} tok/s, "
            f"first token {stats.ttft_s * 1000:.0f} ms")
    if not is_plain(stats.drafter):
        line += f", {stats.mean_accepted:.2f} tokens per verification"
    return line + "]"


def progress_to(bar: Any) -> Callable[[int, int, str], None]:
    """A (done, total, what) progress callback that moves a tqdm bar."""
    def progress(i: int, total: int, what: str) -> None:
        bar.n = i
        bar.set_postfix_str(what)
        bar.refresh()
    return progress
