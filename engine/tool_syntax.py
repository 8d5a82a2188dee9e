"""How a model is offered functions and writes its calls: in its chat template's own
syntax where the engine knows it, in a generic one (engine.tool_calls) where not.

A template that reads ``tools`` and writes Hermes' ``<tool_call>`` blocks (Qwen 2.5 and
3, Hermes 2 and 3, SmolLM3...) or Llama 3.1's JSON calls (``<|python_tag|>``, the
``ipython`` role) gets the tools and the earlier calls and results in the format the
model was trained on, and its answer is read back in that format. Any other template
gets the generic system message and JSON object, which works on any instruct model.

Messages come in as the API sends them, checked: ``{"role", "content"}``, an assistant's
``tool_calls`` (``[{"id", "name", "arguments": dict}]``) and ``tool`` messages
(``{"role": "tool", "content", "tool_call_id", "name"}``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.decoding.json_grammar import json_schema_grammar
from engine.errors import InvalidSamplingError
from engine.tool_calls import (
    RESULT_OPEN,
    Tool,
    ToolCall,
    call_text,
    calls_grammar,
    read_calls,
    result_block,
    tools_prompt,
)

Message = dict[str, Any]
# How each syntax's calls open (an answer cut inside one holds no call to read).
_GENERIC_OPEN = '{"tool_calls"'
_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ReadCalls:
    """An answer that calls functions: the text written before the calls (None when
    there is none) and the calls."""

    content: str | None
    calls: list[ToolCall]


class ToolSyntax:
    """The generic syntax: the tools described in the system message, a call written as
    ``{"tool_calls": [...]}``, a function's result in a ``<tool_result>`` block in the
    next turn (engine.tool_calls.result_block)."""

    name = "generic"
    native = False

    def prepare(self, messages: list[Message], tools: list[Tool], offer: bool,
                required: bool) -> tuple[list[Message], list[dict] | None]:
        """The conversation for the chat template and the tools the template is given
        (None: it is given none). ``offer``: the model may call ``tools`` now."""
        out: list[Message] = []
        called: dict[str, str] = {}
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                for c in m["tool_calls"]:
                    called[c["id"]] = c["name"]
                sent = [{"function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in m["tool_calls"]]
                out.append({"role": "assistant", "content": call_text(sent)})
            elif m["role"] == "tool":
                # Templates want turns to alternate (and not every one has a tool role):
                # results in a row make one turn, each in a block that says it is a
                # function's output, which the offer tells the model is not the user.
                name = m.get("name") or called.get(m.get("tool_call_id", ""), "the function")
                text = result_block(name, m["content"])
                if out and out[-1]["role"] == "user" and \
                        out[-1]["content"].startswith(RESULT_OPEN):
                    out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
                else:
                    out.append({"role": "user", "content": text})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        if offer and tools:
            offer_text = tools_prompt(tools, required,
                                      any(m["role"] == "tool" for m in messages))
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + offer_text}
            else:
                out.insert(0, {"role": "system", "content": offer_text})
        return out, None

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """GBNF admitting only calls of ``tools`` (several where ``parallel``)."""
        return calls_grammar(tools, parallel)

    def read(self, text: str, tools: list[Tool]) -> ReadCalls | None:
        """The calls ``text`` makes, or None when it is a plain answer."""
        calls = read_calls(text, tools)
        return ReadCalls(None, calls) if calls is not None else None

    def call_start(self, text: str) -> int | None:
        """Where, in an answer cut short (max_tokens, a stop string) that ``read`` does not
        take, an unfinished call begins (or may: the text ends in its opening's start);
        None where the answer is plain text."""
        start = len(text) - len(text.lstrip())
        head = re.sub(r"\s+", "", text[start:start + 64])
        return start if head and _GENERIC_OPEN.startswith(head[:len(_GENERIC_OPEN)]) \
            else None


class _NativeSyntax(ToolSyntax):
    """A template's own syntax: tools, calls and results go to the template as the
    OpenAI-shaped structures templates read (arguments as objects, as transformers and
    llama.cpp hand them over)."""

    native = True

    def prepare(self, messages: list[Message], tools: list[Tool], offer: bool,
                required: bool) -> tuple[list[Message], list[dict] | None]:
        out: list[Message] = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                out.append({"role": "assistant", "content": m.get("content") or "",
                            "tool_calls": [{"id": c["id"], "type": "function",
                                            "function": {"name": c["name"],
                                                         "arguments": c["arguments"]}}
                                           for c in m["tool_calls"]]})
            elif m["role"] == "tool":
                out.append({"role": "tool", "content": m["content"],
                            "tool_call_id": m.get("tool_call_id", ""),
                            "name": m.get("name", "")})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        offered = [{"type": "function", "function": {"name": t.name,
                                                     "description": t.description,
                                                     "parameters": t.parameters}}
                   for t in tools] if offer and tools else None
        return out, offered


def _call_object_grammar(tools: list[Tool], arguments_key: str) -> str:
    """The GBNF of one call object ``{"name": ..., arguments_key: {...}}`` of any of
    ``tools``, its root rule named ``tool-call-object``."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, arguments_key: t.parameters},
                "required": ["name", arguments_key]} for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    gbnf = json_schema_grammar(schema, "tools")
    if re.search(r"^tool-call-object ::=", gbnf, re.MULTILINE) or \
            re.search(r"::=[^\n]*(?<![\w\"-])root(?![\w\"-])", gbnf):
        # A rule of that name, or a schema referring to its own root: renaming would
        # change what the grammar admits.
        raise InvalidSamplingError("tools", "cannot build the call grammar for these "
                                   "function schemas", [t.name for t in tools])
    return re.sub(r"^root ::=", "tool-call-object ::=", gbnf, count=1, flags=re.MULTILINE)


def _known_call(value: Any, tools: list[Tool], arguments_keys: tuple[str, ...]
                ) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in {t.name for t in tools}:
        return None
    for key in arguments_keys:
        args = value.get(key)
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if isinstance(args, dict):
            return ToolCall(value["name"], args)
    return None


class HermesSyntax(_NativeSyntax):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
    call, after any text the model writes first."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        block = r'"<tool_call>\n" tool-call-object "\n</tool_call>"'
        more = r' ("\n" ' + block + ")*" if parallel else ""
        return f"root ::= {block}{more}\n" + _call_object_grammar(tools, "arguments")

    def read(self, text: str, tools: list[Tool]) -> ReadCalls | None:
        start = text.find("<tool_call>")
        if start < 0:
            return None
        calls, end = [], start
        for found in self._BLOCK.finditer(text, start):
            try:
                call = _known_call(json.loads(found.group(1)), tools, ("arguments",))
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
            end = found.end()
        if not calls or _HERMES_OPEN in text[end:]:  # none, or the last one unfinished
            return None
        content = text[:start].strip()
        return ReadCalls(content or None, calls)

    def call_start(self, text: str) -> int | None:
        start = text.find(_HERMES_OPEN)
        if start >= 0:
            return start
        return next((len(text) - n for n in range(len(_HERMES_OPEN) - 1, 0, -1)
                     if text.endswith(_HERMES_OPEN[:n])), None)


class Llama3Syntax(_NativeSyntax):
    """Llama 3.1-3.3's JSON call, ``{"name": ..., "parameters": {...}}``, maybe after
    ``<|python_tag|>``; one call an answer (its template refuses more)."""

    name = "llama3"

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        return "root ::= tool-call-object\n" + _call_object_grammar(tools, "parameters")

    def read(self, text: str, tools: list[Tool]) -> ReadCalls | None:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return None
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        call = _known_call(value, tools, ("parameters", "arguments"))
        return ReadCalls(None, [call]) if call is not None else None

    def call_start(self, text: str) -> int | None:
        start = len(text) - len(text.lstrip())
        body = text[start:]
        opens = body.startswith(("{", _PYTHON_TAG)) or bool(body) and _PYTHON_TAG.startswith(body)
        return start if opens else None


GENERIC = ToolSyntax()
HERMES = HermesSyntax()
LLAMA3 = Llama3Syntax()


def tool_syntax_of(template_source: str) -> ToolSyntax:
    """The syntax a chat template writes tool calls in; GENERIC where the template reads
    no ``tools`` or writes calls in a syntax the engine does not read."""
    if not re.search(r"\btools\b", template_source):
        return GENERIC
    if "<tool_call>" in template_source:
        return HERMES
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return LLAMA3
    return GENERIC
