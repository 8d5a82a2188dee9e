"""``tandem chat``: a conversation in the terminal, exported with ``/export FILE`` and
continued from an export with ``--load FILE``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from app.cli.common import (
    add_model_args,
    add_sampling_args,
    generation_config,
    open_service,
    stats_line,
)
from app.conversation_export import read_import, write_export
from app.conversation_store import Conversation, Message
from engine.conversation import AnswerService, Question
from engine.decoding.generation import GenerationConfig, GenerationResult
from engine.errors import TandemError, WorkerLostError
from engine.runtime.context_fit import CONTEXT_POLICIES, DEFAULT_POLICY

HELP = "/reset clears, /export FILE.md|FILE.json saves, /quit or Ctrl-D leaves."


class TerminalChat:
    """The messages of a terminal conversation, with each answer's figures."""

    def __init__(self, system: str = "", title: str = "") -> None:
        self.system, self.title = system, title
        self.turns: list[Message] = []
        self.created_at = time.time()

    @classmethod
    def load(cls, path: Path) -> TerminalChat:
        """Raises ValueError naming the file and what is wrong."""
        imported = read_import(path)
        chat = cls(imported.system_prompt, imported.title)
        for m in imported.messages:
            chat.add(m.role, m.content, m.info)
        return chat

    def add(self, role: str, content: str, info: dict | None = None) -> None:
        self.turns.append(Message(len(self.turns), 0, len(self.turns), role, content,
                                  info=dict(info or {})))
        if not self.title and role == "user":
            self.title = content.strip().splitlines()[0][:60] if content.strip() else ""

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": m.role, "content": m.content} for m in self.turns]

    def export(self, path: Path) -> str:
        conv = Conversation(0, self.title or "Terminal chat", self.system,
                            created_at=self.created_at, updated_at=time.time())
        return write_export(conv, self.turns, path)


def cmd_chat(args: argparse.Namespace) -> int:
    config = generation_config(args)
    chat = TerminalChat(args.system)
    if args.load is not None:
        try:
            chat = TerminalChat.load(args.load)
        except ValueError as exc:
            print(f"tandem: {exc}", file=sys.stderr)
            return 2
    with open_service(args) as service:
        return _chat_loop(service, chat, config, args)


def _chat_loop(service: AnswerService, chat: TerminalChat, config: GenerationConfig,
               args: argparse.Namespace) -> int:
    engine = service.current()
    assert engine is not None
    print(f"Tandem chat on {engine.describe()}. {HELP}")
    if chat.turns:
        print(f"(continuing “{chat.title}”: {len(chat.turns)} messages)")
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
            chat.turns.clear()
            print("(conversation cleared)")
            continue
        if user.startswith("/export"):
            _export(chat, user.removeprefix("/export").strip())
            continue
        chat.add("user", user)
        print("tandem> ", end="", flush=True)
        result = _answer(service, chat, config, args)
        if result is None:
            chat.turns.pop()
            if service.engine is None:
                return 1
            continue
        summary = stats_line(result.stats)
        chat.add("assistant", result.text, {"summary": summary,
                                            "finish_reason": result.finish_reason,
                                            "stats": result.stats.summary()})
        print("\n" + summary)


def _answer(service: AnswerService, chat: TerminalChat, config: GenerationConfig,
            args: argparse.Namespace) -> GenerationResult | None:
    """The answer to the conversation so far, None when there is none (what went wrong is
    printed). A lost worker: the question is asked again of the model opened here."""
    question = Question.chat(chat.messages(), config, args.context_policy)

    def started(_n_prompt: int, n_dropped: int) -> None:
        if n_dropped:
            print(f"(the {n_dropped} oldest messages are left out to fit the context) ",
                  end="")

    for _attempt in range(2):
        if service.current() is None:
            print("(no model is loaded: the worker was lost and the model does not fit here)")
            return None
        try:
            return service.answer(question, on_start=started,
                                  on_text=lambda s: print(s, end="", flush=True)).result
        except KeyboardInterrupt:
            print("\n(stopped)")
            return None
        except WorkerLostError as exc:
            print(f"\n(error: {exc}; answering on this machine)\ntandem> ", end="", flush=True)
        except TandemError as exc:
            print(f"\n(error: {exc})")
            return None
    return None


def _export(chat: TerminalChat, name: str) -> None:
    if not name:
        print("(usage: /export FILE.md or /export FILE.json)")
        return
    try:
        kind = chat.export(Path(name).expanduser())
    except OSError as exc:
        print(f"(could not export: {exc.strerror or exc})")
        return
    print(f"(exported to {name}, {kind})")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``chat`` to the ``tandem`` command's sub-parsers."""
    p = subparsers.add_parser("chat", help="chat in the terminal")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--context-policy", choices=CONTEXT_POLICIES, default=DEFAULT_POLICY,
                   help="when the chat outgrows the context: drop_oldest turns (keeping "
                        "the system prompt) or stop with an error")
    p.add_argument("--load", type=Path, default=None, metavar="FILE.json",
                   help="continue a conversation exported as JSON (from the window, "
                        "/export, or an OpenAI message list)")
    p.set_defaults(func=cmd_chat)
