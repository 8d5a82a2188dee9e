"""The tool-loop benchmark (``tandem bench --tool-loop``): questions about a folder of
files the model answers through a real MCP server (app.tools.files_server: list, read,
search), each runner on the same loop, tokens per second over the whole loop and by turn.

A scripted loop: each question's first ``rounds`` answers must call a tool (a grammar
holds them to a call, as the window's "Every answer calls a tool"), which tool and which
arguments the model's own; then it answers with what the tools returned. Greedy decoding
makes the loop the same for every runner, so the ratios compare the same tokens; the
answers are checked equal, turn by turn.

The folder is written for the run: a timetable, notes, a config module, and a copy of the
standard library's ``textwrap.py`` (every machine has it).
"""

from __future__ import annotations

import inspect
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.tools.mcp_host import McpHost, ToolCallError
from app.tools.turns import DONE, FAILED, expand, for_model, new_call
from engine.conversation import AnswerService, Question
from engine.decoding.generation import GenerationConfig
from engine.tool_syntax import tool_syntax_of

TOOL_TASKS = (
    "When does the first ferry leave on Saturday, and from which pier? Look it up in the "
    "files.",
    "What does the lighthouse note say about the keeper's duties? Quote it.",
    "Read config.py and explain each setting in DEFAULTS.",
    "How does textwrap.dedent work? Read its source in textwrap.py and explain it.",
    "Which files mention the tide? Summarise what they say.",
)
TOOL_ROUNDS = 2
SERVER_NAME = "files"


def make_tool_folder(root: Path) -> Path:
    """The files the questions are about."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "notes").mkdir(exist_ok=True)
    rows = ["day,departure,pier,destination,notes"]
    for day in ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                "Sunday"):
        for hour, pier, where in ((7, "North pier", "Isle of Brae"),
                                  (9, "South pier", "Carrick"),
                                  (13, "North pier", "Isle of Brae"),
                                  (17, "East pier", "Port Allan")):
            first = hour + (1 if day in ("Saturday", "Sunday") else 0)
            note = "no service at low tide" if hour == 13 else ""
            rows.append(f"{day},{first:02d}:15,{pier},{where},{note}")
    (root / "timetable.csv").write_text("\n".join(rows) + "\n")
    (root / "notes" / "lighthouse.md").write_text(textwrap.dedent("""\
        # Carrick lighthouse

        The lighthouse stands on the rocks north of the harbour. It was built in 1857 and
        automated in 1991, but the keeper's cottage is still lived in.

        ## The keeper's duties
        - Light the lamp half an hour before sunset and put it out at sunrise.
        - Wind the clockwork of the lens every four hours through the night.
        - Record the weather, the sea state and the height of the tide at six and at
          eighteen o'clock in the log.
        - Keep the fog signal ready and sound it when the far buoy cannot be seen.
        - Report any ship in difficulty to the coastguard at once.
        """))
    (root / "notes" / "harbour.md").write_text(textwrap.dedent("""\
        # Harbour notes

        The harbour dries at low tide: boats of more than a metre's draught wait outside
        until two hours after low water. The tide tables are posted at the harbour office.
        The north pier is the longest and takes the larger ferry; the south pier is for
        fishing boats and the small ferry to Carrick; the east pier has the fuel berth.
        Berths are let by the week; ask the harbour master, whose office opens at eight.
        """))
    (root / "config.py").write_text(textwrap.dedent('''\
        """Settings of the harbour booking service."""

        DEFAULTS = {
            "max_berth_days": 7,        # a berth is let for a week at most
            "deposit_percent": 20,      # paid when a berth is booked
            "low_tide_closure": True,   # the 13:15 ferry does not run at low tide
            "office_opens": "08:00",
            "office_closes": "18:00",
            "currency": "GBP",
        }


        def berth_price(days: int, daily_rate: float) -> float:
            """The price of a berth, with a tenth off for a full week."""
            if days > DEFAULTS["max_berth_days"]:
                raise ValueError("a berth is let for a week at most")
            price = days * daily_rate
            return price * 0.9 if days == 7 else price
        '''))
    (root / "textwrap.py").write_text(_textwrap_source())
    return root


def _textwrap_source() -> str:
    """The standard library's ``textwrap.py``; in a packaged build, which keeps no
    sources, its functions' signatures and docstrings."""
    try:
        return Path(inspect.getsourcefile(textwrap) or "").read_text()
    except (OSError, TypeError):
        parts = [f'"""{textwrap.__doc__}"""\n']
        for name in ("wrap", "fill", "shorten", "dedent", "indent"):
            fn = getattr(textwrap, name)
            parts.append(f'def {name}{inspect.signature(fn)}:\n    """{fn.__doc__}"""\n')
        return "\n\n".join(parts)


@dataclass
class LoopTurn:
    text: str
    n_new: int
    decode_s: float  # after the first token
    total_s: float
    mean_accepted: float
    n_proposed: int = 0  # draft tokens sent to the target
    n_accepted: int = 0  # of them kept
    calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LoopRun:
    turns: list[LoopTurn]

    @property
    def texts(self) -> list[str]:
        return [t.text for t in self.turns]


def run_loop(service: AnswerService, host: McpHost, question: str, rounds: int,
             max_tokens: int, plain: bool = False, call_timeout_s: float = 60.0) -> LoopRun:
    """One question through the loop: ``rounds`` answers that call tools (run on
    ``host``'s servers), then one that answers. ``plain``: no drafting."""
    engine = service.engine
    assert engine is not None
    syntax = tool_syntax_of(engine.target.template.source)
    infos = host.tools()
    tools = [t.as_tool() for t in infos]
    by_name = {t.public_name: t for t in infos}
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    turns: list[LoopTurn] = []
    for r in range(rounds + 1):
        required = r < rounds
        turn = for_model(messages, tools if required else [], syntax, required)
        answer = service.answer(Question.chat(
            turn.messages, GenerationConfig(max_tokens=max_tokens, grammar=turn.grammar),
            tools=turn.template_tools), plain=plain)
        s = answer.result.stats
        done = LoopTurn(answer.result.text, s.n_new, s.t_total_s - s.ttft_s, s.t_total_s,
                        s.mean_accepted, sum(st.n_proposed for st in s.steps),
                        sum(st.n_accepted for st in s.steps))
        turns.append(done)
        read = syntax.read(answer.result.text, tools) if required else None
        if read is None:
            break
        for i, call in enumerate(read.calls):
            info = by_name[call.name]
            record = new_call(r + 1, i, call.name, info.server, info.name, call.arguments)
            try:
                outcome = host.call(info.server, info.name, call.arguments
                                    ).result(call_timeout_s)
                record.update(state=DONE, result=outcome.text, is_error=outcome.is_error)
            except (ToolCallError, TimeoutError) as exc:
                record.update(state=FAILED, result=str(exc) or "the tool took too long")
            done.calls.append(record)
        messages += expand("assistant", read.content or "", {"tool_calls": done.calls})
    return LoopRun(turns)


def _figures(runs: list[LoopRun]) -> dict[str, Any]:
    def rate(turns: list[LoopTurn]) -> float:
        seconds = sum(t.decode_s for t in turns)
        return sum(max(0, t.n_new - 1) for t in turns) / seconds if seconds > 0 else 0.0

    every = [t for run in runs for t in run.turns]
    calls = [t for run in runs for t in run.turns if t.calls]
    answers = [t for run in runs for t in run.turns if not t.calls]
    steps = sum(max(0, t.n_new - 1) / max(t.mean_accepted, 1.0) for t in every) or 1.0
    return {"tokens": sum(t.n_new for t in every),
            "seconds": round(sum(t.total_s for t in every), 3),
            "tok_per_s": round(rate(every), 2), "calls_tok_per_s": round(rate(calls), 2),
            "answers_tok_per_s": round(rate(answers), 2),
            "tokens_per_verification": round(sum(max(0, t.n_new - 1) for t in every)
                                             / steps, 3)}


def run_tool_bench(services: dict[str, AnswerService], host: McpHost, tasks: list[str],
                   rounds: int, max_tokens: int,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every task's loop with every runner (in turns, the order changing per task);
    figures per runner and per task, and whether each runner's loop equals the first's."""
    names = list(services)
    runs: dict[str, list[LoopRun]] = {n: [] for n in names}
    for k, task in enumerate(tasks):
        order = names[k % len(names):] + names[:k % len(names)]
        for n in order:
            runs[n].append(run_loop(services[n], host, task, rounds, max_tokens))
            if progress is not None:
                progress(f"{n}: task {k + 1}")
    ref = names[0]
    out: dict[str, Any] = {"runners": {}, "tasks": []}
    for n in names:
        fig = _figures(runs[n])
        fig["identical"] = all(a.texts == b.texts for a, b in zip(runs[n], runs[ref],
                                                                   strict=True))
        out["runners"][n] = fig
    for k, task in enumerate(tasks):
        out["tasks"].append({"question": task, "turns": [
            {"calls": [(c["tool"], c["arguments"]) for c in t.calls], "text": t.text}
            for t in runs[ref][k].turns],
            "tok_per_s": {n: _figures([runs[n][k]])["tok_per_s"] for n in names}})
    return out


def format_tool_table(payload: dict[str, Any]) -> str:
    runners = payload["runners"]
    ref = next(iter(runners))
    base = runners[ref]["tok_per_s"] or 1.0
    lines = [f"{'runner':<14}{'tok/s loop':>11}{'vs ' + ref:>10}{'calls tok/s':>13}"
             f"{'answers tok/s':>15}{'t/verify':>10}{'tokens':>8}{'answering s':>13}  same",
             "-" * 101]
    for n, f in runners.items():
        lines.append(f"{n:<14}{f['tok_per_s']:>11.1f}{f['tok_per_s'] / base:>9.2f}x"
                     f"{f['calls_tok_per_s']:>13.1f}{f['answers_tok_per_s']:>15.1f}"
                     f"{f['tokens_per_verification']:>10.2f}{f['tokens']:>8}"
                     f"{f['seconds']:>13.2f}  {'yes' if f['identical'] else 'NO'}")
    lines.append("(tok/s: after each turn's first token; answering s: every turn's prompt "
                 "and answer, the tools' time not counted)")
    lines.append("")
    lines.append("per task, tok/s over its loop: " + "; ".join(
        f"{k + 1}: " + ", ".join(f"{n} {v:.1f}" for n, v in t["tok_per_s"].items())
        for k, t in enumerate(payload["tasks"])))
    return "\n".join(lines)


def bench_meta(model: str, threads: int, rounds: int, max_tokens: int,
               names: list[str]) -> dict[str, Any]:
    return {"model": model, "threads": threads, "rounds": rounds, "max_tokens": max_tokens,
            "drafters": names, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
