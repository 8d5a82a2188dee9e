"""``tandem generate``: answer one prompt, streamed or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from app.cli.common import (
    add_model_args,
    add_sampling_args,
    generation_config,
    open_engine,
    stats_line,
)


def cmd_generate(args: argparse.Namespace) -> int:
    config = generation_config(args)
    with open_engine(args) as engine:
        prompt = (engine.target.tokenize(args.prompt) if args.raw
                  else engine.chat_prompt([{"role": "user", "content": args.prompt}]))
        stream = None if args.json else (lambda s: print(s, end="", flush=True))
        result = engine.generate(prompt, config, on_text=stream)
        plan = engine.plan.to_json() if engine.plan is not None else None
        exactness = engine.kernels.to_json() if engine.kernels is not None else None
        architecture = engine.architecture
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens,
                          "finish_reason": result.finish_reason,
                          "stats": result.stats.summary(), "plan": plan,
                          "exactness": exactness, "architecture": architecture}))
    else:
        print()
        print(stats_line(result.stats), file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``generate`` to the ``tandem`` command's sub-parsers."""
    p = subparsers.add_parser("generate", help="answer one prompt")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--json", action="store_true", help='print {"text", "tokens", "stats"}')
    p.set_defaults(func=cmd_generate)
