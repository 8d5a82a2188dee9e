"""``tandem generate``: answer one prompt, streamed or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from app.cli.common import (
    add_model_args,
    add_sampling_args,
    generation_config,
    open_service,
    stats_line,
)
from engine.conversation import Question


def cmd_generate(args: argparse.Namespace) -> int:
    config = generation_config(args)
    with open_service(args) as service:
        engine = service.current()
        assert engine is not None
        question = (Question.completion(args.prompt, config, special=True) if args.raw
                    else Question.chat([{"role": "user", "content": args.prompt}], config))
        stream = None if args.json else (lambda s: print(s, end="", flush=True))
        result = service.answer(question, on_text=stream).result
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
