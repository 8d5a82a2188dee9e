"""The OpenAI request bodies Tandem serves, checked field by field, and the OpenAI error
shape. Pure functions on parsed JSON: no HTTP and no engine here.

Known fields of the wrong type or out of range are refused (400, naming the field);
fields Tandem does not know are ignored, as clients send many optional ones.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from engine.decoding.json_grammar import json_object_grammar, json_schema_grammar
from engine.decoding.sampling import CHAT_DEFAULTS, SamplingParams
from engine.errors import InvalidSamplingError
from engine.runtime.context_fit import CONTEXT_POLICIES
from engine.tool_calls import Tool
from engine.tool_syntax import GENERIC, ToolSyntax

ROLES = ("system", "developer", "user", "assistant", "tool")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
# A prediction may hold up to this many contexts of text (one answer repeats at most one),
# measured in characters at about this many a token: the tokenizer is the engine's.
PREDICTION_CONTEXTS = 4
PREDICTION_CHARS_PER_TOKEN = 4


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # the most a request may ask for
    max_body_bytes: int = 1 << 20
    n_ctx: int | None = None  # the loaded model's context (None: no cap on a prediction)

    @property
    def max_prediction_chars(self) -> int | None:
        """The longest ``prediction``: PREDICTION_CONTEXTS contexts of text."""
        if self.n_ctx is None:
            return None
        return PREDICTION_CONTEXTS * self.n_ctx * PREDICTION_CHARS_PER_TOKEN


@dataclass(frozen=True)
class CompletionRequest:
    """One chat or text completion, validated."""

    model: str
    # For chat, checked (engine.tool_syntax: Message) and then in the form the chat
    # template takes; empty for text
    messages: tuple[dict[str, Any], ...]
    prompt: str | None  # the text to continue for /v1/completions; None for chat
    stream: bool
    include_usage: bool
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    # Tandem's extension: "drop_oldest" fits a long chat by leaving out its oldest turns;
    # "stop" (the default, as OpenAI's API) refuses it with context_length_exceeded.
    context_policy: str = "stop"
    # llama-server's and vLLM's chat_template_kwargs.enable_thinking (None: the default)
    enable_thinking: bool | None = None
    grammar: str | None = None  # GBNF every token obeys (response_format, grammar, tools)
    tools: tuple[Tool, ...] = ()  # functions an answer may call (read back from it)
    # OpenAI's parallel_tool_calls: False (and a named tool_choice) means at most one call
    parallel_tool_calls: bool = True
    # How many likeliest alternatives to report with each token's log probability
    # (None: no log probabilities).
    logprobs: int | None = None
    # How the offered tools reach the model and its calls come back (the template's)
    tool_syntax: ToolSyntax = GENERIC
    template_tools: tuple[dict, ...] = ()  # the tools the chat template is given
    # OpenAI's Predicted Outputs: text the answer is expected to repeat, drafted from
    prediction: str = ""

    @property
    def is_chat(self) -> bool:
        return self.prompt is None


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param, code="invalid_value")


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"must be a number, got {v!r}")
    if not low <= v <= high:
        raise _bad(name, f"must be between {low} and {high}, got {v!r}")
    return float(v)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {v!r}")
    if not low <= v <= high:
        raise _bad(name, f"must be between {low} and {high}, got {v!r}")
    return v


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"must be true or false, got {v!r}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} strings of at most "
                           f"{MAX_STOP_CHARS} characters")
    return tuple(stops)


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise _bad(where, "only text parts are supported "
                                  "({'type': 'text', 'text': ...})")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(where, f"must be a string or a list of text parts, got {type(content).__name__}")


def _messages(body: dict) -> list[dict[str, Any]]:
    """The conversation, checked: engine.tool_syntax's messages."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of {role, content}")
    out: list[dict[str, Any]] = []
    called: dict[str, str] = {}  # tool call id -> function name
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        where = f"messages[{i}].content"
        if role == "assistant" and m.get("tool_calls"):
            calls = _calls_sent(m["tool_calls"], f"messages[{i}].tool_calls")
            called.update((c["id"], c["name"]) for c in calls)
            content = m.get("content")
            out.append({"role": "assistant", "tool_calls": calls,
                        "content": "" if content is None else _text_of(content, where)})
        elif role == "tool":
            call_id = str(m.get("tool_call_id", ""))
            out.append({"role": "tool", "content": _text_of(m.get("content"), where),
                        "tool_call_id": call_id,
                        "name": called.get(call_id, str(m.get("name") or ""))})
        else:
            # Templates know "system"; OpenAI's newer "developer" role means the same.
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(m.get("content"), where)})
    return out


def _calls_sent(calls: Any, where: str) -> list[dict[str, Any]]:
    """An earlier answer's calls as sent back: ``{id, name, arguments}`` with the
    arguments parsed (an unreadable JSON string becomes ``{}``, as the model may well
    have written it)."""
    if not isinstance(calls, list):
        raise _bad(where, "must be a list of calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}[{j}]", "must be {id, type: function, function: {name, "
                                        "arguments}}")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = {}
        out.append({"id": str(c.get("id", f"call_{j}")), "name": fn["name"],
                    "arguments": parsed if isinstance(parsed, dict) else {}})
    return out


def _tools(body: dict) -> tuple[tuple[Tool, ...], str]:
    """The functions offered and how one must be called: "none", "auto", "required" or
    a function's name."""
    raw = body.get("tools")
    if raw is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs tools")
        return (), "none"
    if not isinstance(raw, list):
        raise _bad("tools", "must be a list of {type: function, function: {...}}")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", "must be {type: function, function: {name, ...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 64 \
                or not set(name) <= _NAME_CHARS:
            raise _bad(f"tools[{i}].function.name", "must be 1-64 letters, digits, _ or -")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        tools.append(Tool(name, str(fn.get("description") or ""), params))
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if named not in {t.name for t in tools}:
            raise _bad("tool_choice", f"names no function in tools: {named!r}")
        return tuple(t for t in tools if t.name == named), "named"
    if choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", "must be none, auto, required or "
                                  "{type: function, function: {name}}")
    return tuple(tools), choice


def _prompt(body: dict) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise _bad("prompt", "must be a string (one prompt per request)")
    return p


def _sampling(body: dict) -> SamplingParams:
    seed = _integer(body, "seed", None, 0, 2**63 - 1)
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
            top_k=_integer(body, "top_k", 0, 0, 1 << 20) or 0,
            min_p=_number(body, "min_p", CHAT_DEFAULTS.min_p, 0.0, 1.0),
            repeat_penalty=_number(body, "repeat_penalty", CHAT_DEFAULTS.repeat_penalty,
                                   0.0, 10.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            penalty_last_n=_integer(body, "penalty_last_n", CHAT_DEFAULTS.penalty_last_n,
                                    0, 4096) or 0,
            seed=seed)
    except InvalidSamplingError as exc:  # the engine's names are the API's fields
        raise ApiError(400, exc.named(f"'{exc.setting}'"), param=exc.setting,
                       code="invalid_value") from None


def parse_request(body: Any, limits: Limits, chat: bool, syntax: ToolSyntax = GENERIC
                  ) -> CompletionRequest:
    """A chat (``chat``) or text completion request from its JSON body; ApiError if not.
    ``syntax``: how the loaded model's template offers tools (engine.tool_syntax)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise _bad("model", "must be a string")
    if _integer(body, "n", 1, 1, 1) != 1:
        raise _bad("n", "only n=1 is supported")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer({name: asked}, name, min(512, limits.max_tokens), 1,
                          limits.max_tokens)
    assert max_tokens is not None
    tools, choice = _tools(body) if chat else ((), "none")
    # A named function is one call of it, as OpenAI's API answers it.
    parallel = _boolean(body, "parallel_tool_calls", True) and choice != "named"
    messages, template_tools = syntax.prepare(_messages(body), list(tools), choice != "none",
                                              choice not in ("none", "auto")) \
        if chat else ([], None)
    grammar = _grammar(body)
    if choice not in ("none", "auto"):
        if grammar is not None:
            raise _bad("tool_choice", "a required call has its own grammar: give no "
                                      "response_format or grammar with it")
        try:
            grammar = syntax.grammar(list(tools), parallel)
        except InvalidSamplingError as exc:
            raise ApiError(400, exc.named("'tools'"), param="tools",
                           code="invalid_value") from None
    return CompletionRequest(
        model=model,
        messages=tuple(messages),
        prompt=None if chat else _prompt(body),
        stream=_boolean(body, "stream"),
        include_usage=_boolean(options, "include_usage"),
        max_tokens=max_tokens,
        sampling=_sampling(body),
        stop=_stop(body),
        context_policy=_context_policy(body),
        enable_thinking=_enable_thinking(body),
        grammar=grammar,
        tools=tools if choice != "none" else (),
        parallel_tool_calls=parallel,
        logprobs=_logprobs(body, chat),
        tool_syntax=syntax,
        template_tools=tuple(template_tools or ()),
        prediction=_prediction(body, limits.max_prediction_chars))


def _prediction(body: dict, max_chars: int | None) -> str:
    """OpenAI's ``prediction``: ``{"type": "content", "content": text or text parts}``,
    of at most ``max_chars`` characters."""
    given = body.get("prediction")
    if given is None:
        return ""
    if not isinstance(given, dict) or given.get("type") != "content":
        raise _bad("prediction", "must be {'type': 'content', 'content': ...}")
    if "content" not in given:
        raise _bad("prediction.content", "is missing")
    text = _text_of(given["content"], "prediction.content")
    if max_chars is not None and len(text) > max_chars:
        raise ApiError(400, f"'prediction': its content is {len(text)} characters; the limit "
                            f"is {max_chars} ({PREDICTION_CONTEXTS} times the "
                            f"{max_chars // PREDICTION_CONTEXTS // PREDICTION_CHARS_PER_TOKEN}"
                            f"-token context, at {PREDICTION_CHARS_PER_TOKEN} characters a "
                            "token)", param="prediction", code="prediction_too_large")
    return text


def _grammar(body: dict) -> str | None:
    """The grammar a request asks for: OpenAI's ``response_format`` (``json_object``,
    ``json_schema``), or llama-server's ``grammar`` (GBNF) and ``json_schema`` fields."""
    fmt = body.get("response_format")
    asked = [name for name in ("grammar", "json_schema") if body.get(name) is not None]
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        asked.append("response_format")
    if len(asked) > 1:
        raise _bad(asked[1], f"give one of response_format, grammar and json_schema, "
                             f"not {' and '.join(asked)}")
    try:
        if body.get("grammar") is not None:
            gbnf = body["grammar"]
            if not isinstance(gbnf, str) or not gbnf.strip():
                raise _bad("grammar", "must be a GBNF grammar (a non-empty string)")
            return gbnf
        if body.get("json_schema") is not None:
            return json_schema_grammar(body["json_schema"], "json_schema")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise _bad("response_format", "must be an object with a type")
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return json_object_grammar()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise _bad("response_format.json_schema",
                           "must be an object with the schema under 'schema'")
            return json_schema_grammar(spec["schema"], "response_format.json_schema")
        raise _bad("response_format.type",
                   f"must be text, json_object or json_schema, got {kind!r}")
    except InvalidSamplingError as exc:
        raise ApiError(400, exc.named(f"'{exc.setting}'"), param=exc.setting,
                       code="invalid_value") from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: ``logprobs`` true, ``top_logprobs`` 0-20 alternatives. Text completions:
    ``logprobs`` 0-5, the number of alternatives (OpenAI's two conventions)."""
    if chat:
        if not _boolean(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise _bad("top_logprobs", "needs logprobs: true")
            return None
        top = _integer(body, "top_logprobs", 0, 0, 20)
        return top
    v = body.get("logprobs")
    if v is None or v is False:
        return None
    return _integer(body, "logprobs", 0, 0, 5)


def _enable_thinking(body: dict) -> bool | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    value = kwargs.get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise _bad("chat_template_kwargs", "enable_thinking must be true or false")
    return value


def _context_policy(body: dict) -> str:
    value = body.get("context_policy", "stop")
    if value not in CONTEXT_POLICIES:
        raise _bad("context_policy", f"must be one of {', '.join(CONTEXT_POLICIES)}")
    return value
