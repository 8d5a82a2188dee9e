"""OpenAI's rules for tool calls and predictions as the API's request checks and each
tool syntax apply them: a named tool_choice and ``parallel_tool_calls: false`` are one
call, a call cut short is found (not read, not sent as text), and a prediction has a cap.
The served answers are in tests/test_server.py."""

from __future__ import annotations

import pytest

from app.server.schema import (
    PREDICTION_CHARS_PER_TOKEN,
    PREDICTION_CONTEXTS,
    ApiError,
    Limits,
    parse_request,
)
from engine.tool_calls import Tool, ToolCall
from engine.tool_syntax import GENERIC, HERMES, LLAMA3, ReadCalls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
TOOLS = [Tool("get_weather"), Tool("get_time")]


def _chat(**fields) -> dict:  # noqa: ANN003
    return {"messages": ASK, "tools": [WEATHER, TIME], **fields}


@pytest.mark.parametrize("syntax", [GENERIC, HERMES, LLAMA3], ids=lambda s: s.name)
def test_a_named_function_is_one_call_of_it(syntax) -> None:  # noqa: ANN001
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = parse_request(_chat(tool_choice=named), Limits(256), True, syntax)
    assert [t.name for t in req.tools] == ["get_weather"]
    assert not req.parallel_tool_calls
    assert req.grammar == syntax.grammar(list(req.tools), parallel=False)


def test_parallel_tool_calls_false_is_one_call_and_must_be_a_boolean() -> None:
    req = parse_request(_chat(tool_choice="required", parallel_tool_calls=False),
                        Limits(256), True)
    assert not req.parallel_tool_calls
    assert req.grammar == GENERIC.grammar(list(req.tools), parallel=False)
    assert req.grammar != GENERIC.grammar(list(req.tools), parallel=True)
    assert parse_request(_chat(), Limits(256), True).parallel_tool_calls
    with pytest.raises(ApiError) as err:
        parse_request(_chat(parallel_tool_calls="no"), Limits(256), True)
    assert err.value.param == "parallel_tool_calls"


def test_a_prediction_longer_than_its_cap_is_refused() -> None:
    limits = Limits(256, n_ctx=1024)
    cap = PREDICTION_CONTEXTS * 1024 * PREDICTION_CHARS_PER_TOKEN
    assert limits.max_prediction_chars == cap
    fits = parse_request({"messages": ASK, "prediction": {"type": "content",
                                                          "content": "x" * cap}},
                         limits, True)
    assert len(fits.prediction) == cap
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": "a", "prediction": {"type": "content",
                                                     "content": [{"type": "text",
                                                                  "text": "x" * (cap + 1)}]}},
                      limits, False)
    assert err.value.status == 400 and err.value.param == "prediction"
    assert "prediction" in err.value.message and str(cap) in err.value.message
    # Without a loaded model there is no context to measure against.
    assert Limits(256).max_prediction_chars is None


@pytest.mark.parametrize("syntax, cut, start", [
    (GENERIC, '{"tool_calls":[{"name":"get_weather","argu', 0),
    (GENERIC, '  {"tool_', 2),
    (GENERIC, "{", 0),
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_wea', 13),
    (HERMES, "Let me look.\n<tool_", 13),
    (LLAMA3, '<|python_tag|>{"name": "get_', 0),
    (LLAMA3, "<|python", 0),
], ids=lambda v: v.name if hasattr(v, "name") else None)
def test_an_answer_cut_inside_a_call_is_found_and_not_read(syntax, cut: str,  # noqa: ANN001
                                                           start: int) -> None:
    assert syntax.read(cut, TOOLS) is None
    assert syntax.call_start(cut) == start


@pytest.mark.parametrize("syntax, text", [
    (GENERIC, "It is sunny in Oslo."), (GENERIC, '{"answer": 1'), (GENERIC, ""),
    (HERMES, "It is sunny in Oslo."), (LLAMA3, "It is sunny."),
], ids=lambda v: v.name if hasattr(v, "name") else None)
def test_plain_text_cut_short_is_no_call(syntax, text: str) -> None:  # noqa: ANN001
    assert syntax.call_start(text) is None


def test_hermes_calls_followed_by_an_unfinished_one_are_not_read() -> None:
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert HERMES.read(one, TOOLS) == ReadCalls(None, [ToolCall("get_time", {})])
    assert HERMES.read(one + '\n<tool_call>\n{"name": "get_ti', TOOLS) is None
    assert HERMES.call_start(one + "\n<tool_call>") == 0
