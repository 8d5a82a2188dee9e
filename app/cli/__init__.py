"""The ``tandem`` command: one module per command, each with its own flags and checks."""

from __future__ import annotations

import argparse
import logging
import sys

from app.cli import (
    bench,
    chat,
    check_cpu,
    generate,
    models,
    plan,
    profile,
    serve,
    synth,
    train,
    worker,
)
from engine.errors import InvalidSettingError, TandemError

COMMANDS = (chat, generate, serve, plan, bench, train, models, profile, synth, worker,
            check_cpu)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: local chat, lossless speculative decoding on "
        "llama.cpp (chat, generate, serve, plan, bench, models, profile, synth, train-draft, "
        "worker, check-cpu).")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
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
