"""``tandem chat``: a conversation in the terminal."""

from __future__ import annotations

import argparse

from app.cli.common import (
    add_model_args,
    add_sampling_args,
    generation_config,
    open_engine,
    stats_line,
)
from engine.errors import TandemError


def cmd_chat(args: argparse.Namespace) -> int:
    config = generation_config(args)
    with open_engine(args) as engine:
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
            print("\n" + stats_line(result.stats))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``chat`` to the ``tandem`` command's sub-parsers."""
    p = subparsers.add_parser("chat", help="chat in the terminal")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default="", help="system prompt")
    p.set_defaults(func=cmd_chat)
