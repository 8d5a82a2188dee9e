"""Function calling's engine side: the calls grammar, reading calls back, and calls
drafted equal to plain decoding under that grammar."""

from __future__ import annotations

import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.memory import MemoryDrafter
from engine.tool_calls import Tool, ToolCall, call_text, calls_grammar, read_calls, tools_prompt

WEATHER = Tool("get_weather", "The weather in a city now",
               {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]})
TIME = Tool("get_time", "The local time in a city",
            {"type": "object", "properties": {"city": {"type": "string"}},
             "required": ["city"]})


def test_calls_are_read_back_only_when_the_answer_is_a_call() -> None:
    assert read_calls('{"tool_calls":[{"name":"get_time","arguments":{"city":"Oslo"}}]}',
                      [WEATHER, TIME]) == [ToolCall("get_time", {"city": "Oslo"})]
    for text in ("It is sunny.", '{"tool_calls":[]}', '{"tool_calls":[{"name":"rm",'
                 '"arguments":{}}]}', '{"tool_calls":[{"name":"get_time"}]}', "{oops"):
        assert read_calls(text, [WEATHER, TIME]) is None, text
    sent = [{"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"city":"Oslo"}'}}]
    assert read_calls(call_text(sent), [TIME]) == [ToolCall("get_time", {"city": "Oslo"})]


@pytest.fixture(scope="module")
def attention_target(model_path):  # noqa: ANN001, ANN201
    """The bundled model with flash attention: its sums end this call where the CPU's
    default (without it) repeats the calls to the token limit, a weak model's loop."""
    from engine.runtime.target import Target, TargetConfig

    with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2, flash_attn=True)) as t:
        yield t


def test_a_required_call_is_valid_and_drafting_changes_nothing(attention_target) -> None:  # noqa: ANN001
    target = attention_target
    grammar = calls_grammar([WEATHER, TIME])
    messages = [{"role": "system", "content": tools_prompt([WEATHER, TIME], True)},
                {"role": "user", "content": "What is the weather in Paris?"}]
    prompt = target.chat_prompt(messages)
    config = GenerationConfig(80, grammar=grammar)
    target.reset()
    plain = generate(target, prompt, None, config)
    calls = read_calls(plain.text, [WEATHER, TIME])
    assert plain.finish_reason == "eos" and calls, plain.text
    assert isinstance(calls[0].arguments["city"], str)
    assert memory_drafts_the_call_as_plain(target, prompt, config, plain.tokens) >= 10


def memory_drafts_the_call_as_plain(target, prompt: list[int], config: GenerationConfig,  # noqa: ANN001
                                    plain: list[int]) -> int:
    """Answer ``prompt`` twice with memory drafts (the second time it drafts the whole
    call), asserting plain decoding's tokens; the draft tokens accepted."""
    memory = MemoryDrafter()
    accepted = 0
    for _ in range(2):
        target.reset()
        out = generate(target, prompt, memory, config,
                       cost=VerifyCostModel(slope=0.0, learn=False))
        assert out.tokens == plain
        accepted += sum(s.n_accepted for s in out.stats.steps)
    return accepted
