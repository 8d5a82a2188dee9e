"""Tool calls as a conversation keeps them: each answer that called tools holds its calls
in its ``info["tool_calls"]`` (tool, arguments, the user's decision, the result), and the
model is given them back as the API's messages: the assistant's ``tool_calls``, then one
``tool`` message per call (engine.tool_syntax writes both in the model's syntax).

No Qt and no MCP here: the window's loop (app.gui.tool_loop), its worker, the tool-loop
benchmark and the tests share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidSamplingError
from engine.tool_calls import Tool
from engine.tool_syntax import ToolSyntax

# A call's state in the card.
WAITING = "waiting"  # for the user's approval
RUNNING = "running"
DONE = "done"  # the tool answered (maybe with is_error: the tool said it failed)
FAILED = "failed"  # no answer: the server is gone, it took too long, it refused the call
REFUSED = "refused"  # the user said no
STOPPED = "stopped"  # Stop ended the loop before it answered
REPLAYED = "replayed"  # an earlier identical call's result, given again (no new call)
OPEN = (WAITING, RUNNING)
ANSWERED = (DONE, REPLAYED)

REFUSED_TEXT = "The user did not allow this call."
STOPPED_TEXT = "The call was stopped before it answered."


def new_call(message_id: int, index: int, public_name: str, server: str, tool: str,
             arguments: dict) -> dict[str, Any]:
    return {"id": f"call_{message_id}_{index}", "message_id": message_id,
            "name": public_name, "server": server,
            "tool": tool, "arguments": arguments, "state": WAITING, "result": "",
            "is_error": False}


def result_for_model(call: dict[str, Any]) -> str:
    """What the model reads back for ``call``."""
    state = call.get("state")
    if state in ANSWERED:
        text = str(call.get("result", ""))
        return f"Error: {text}" if call.get("is_error") else text
    if state == FAILED:
        return f"Error: {call.get('result', 'the call failed')}"
    if state == REFUSED:
        return REFUSED_TEXT
    return STOPPED_TEXT


def _well_formed(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("id"), str) and \
        isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)


def calls_of(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The calls an answer's info keeps (records of another shape, from an edited export
    say, are left out rather than break every later turn)."""
    found = info.get("tool_calls")
    return [c for c in found if _well_formed(c)] if isinstance(found, list) else []


def expand(role: str, content: str, info: dict[str, Any]) -> list[dict[str, Any]]:
    """One stored message as the API's messages: an answer that called tools becomes the
    assistant's calls and a ``tool`` message per call."""
    calls = calls_of(info) if role == "assistant" else []
    if not calls:
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = [{
        "role": "assistant", "content": content,
        "tool_calls": [{"id": c["id"], "name": c["name"], "arguments": c["arguments"]}
                       for c in calls]}]
    out += [{"role": "tool", "content": result_for_model(c), "tool_call_id": c["id"],
             "name": c["name"]} for c in calls]
    return out


def call_key(server: str, tool: str, arguments: dict) -> str:
    """Identical calls share a key (the arguments in a canonical order)."""
    return json.dumps([server, tool, arguments], sort_keys=True, separators=(",", ":"))


def replayable(calls: list[dict[str, Any]], before_message: int
               ) -> dict[str, dict[str, Any]]:
    """The calls among ``calls`` (every version of a conversation's messages) that made
    before message ``before_message`` (the loop in progress does not replay itself) and
    got a result that was not an error, by key: a regenerate or an edit that makes the
    same call gets this result back."""
    found: dict[str, dict[str, Any]] = {}
    for c in calls:
        if not _well_formed(c) or not isinstance(c.get("message_id"), int):
            continue
        made_before = c["message_id"] < before_message
        if made_before and c.get("state") in ANSWERED and not c.get("is_error"):
            found.setdefault(call_key(c.get("server", ""), c.get("tool", ""),
                                      c.get("arguments", {})), c)
    return found


def rounds_since_user(infos: list[tuple[str, dict[str, Any]]]) -> int:
    """How many answers in a row called tools at the end of a conversation (role, info
    of each message, oldest first): the rounds of the loop in progress."""
    n = 0
    for role, info in reversed(infos):
        if role != "assistant" or not calls_of(info):
            break
        n += 1
    return n


def describe_call(call: dict[str, Any]) -> str:
    """The card's Markdown for one call: tool, server, arguments, state and result."""
    args = json.dumps(call.get("arguments", {}), ensure_ascii=False)
    if len(args) > 300:
        args = args[:299] + "…"
    state = call.get("state", "")
    # (Symbols every desktop font has: emoji are boxes on a bare Linux.)
    badge = {WAITING: "… waiting for your approval", RUNNING: "… running",
             DONE: "✓ done" if not call.get("is_error") else "✖ the tool reported an error",
             FAILED: "✖ failed", REFUSED: "✖ refused", STOPPED: "■ stopped",
             REPLAYED: "↺ earlier result (not run again)"}.get(state, state)
    lines = [f"Tool **{call.get('tool', call.get('name', ''))}** · {call.get('server', '')}"
             f" · {badge}", f"`{args}`"]
    result = str(call.get("result", ""))
    if state in (*ANSWERED, FAILED) and result:
        shown = result if len(result) <= 600 else result[:600] + "…"
        lines.append("```\n" + shown.replace("```", "ʼʼʼ") + "\n```")
    return "\n\n".join(lines)


@dataclass(frozen=True)
class ModelTurn:
    """A conversation as the chat template takes it: the messages (earlier calls and
    results in the model's syntax), the tools the template is given, and the grammar that
    holds the answer to a call where one is required (None: free)."""

    messages: list[dict[str, Any]]
    template_tools: tuple[dict, ...]
    grammar: str | None


def for_model(messages: list[dict[str, Any]], tools: list[Tool], syntax: ToolSyntax,
              required: bool) -> ModelTurn:
    """``messages`` (the API's, as ``expand`` writes them) ready for the model, offered
    ``tools`` (none: it answers), a call ``required`` or not."""
    messages = [dict(m) for m in messages]
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return ModelTurn(messages, (), None)
    grammar = None
    if required and tools:
        grammar = _call_grammar(tools, syntax)
        if grammar is None:  # no tool's schema makes a grammar: the model chooses
            required = False
    prepared, offered = syntax.prepare(messages, tools, bool(tools), required)
    return ModelTurn(prepared, tuple(offered or ()), grammar)


def _call_grammar(tools: list[Tool], syntax: ToolSyntax) -> str | None:
    """The grammar of one call of ``tools``; a tool whose schema makes no grammar is left
    out of it rather than fail every answer (None when none makes one)."""
    try:
        return syntax.grammar(tools, False)
    except InvalidSamplingError:
        usable = []
        for tool in tools:
            try:
                syntax.grammar([tool], False)
                usable.append(tool)
            except InvalidSamplingError:
                continue
        return syntax.grammar(usable, False) if usable else None
