"""The generation loop's end conditions, streaming and stats, on the real model."""

from __future__ import annotations

import pytest

from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.lookup import PromptLookupDrafter
from engine.errors import ContextFullError, InvalidSamplingError

COUNT = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
COPY = [{"role": "user", "content": "Repeat this sentence three times: the quick brown fox "
                                    "jumps over the lazy dog near the old river bank."}]


@pytest.mark.parametrize("drafter", [None, "lookup"])
def test_streamed_text_is_the_result_and_stats_add_up(fresh_target, drafter):
    t = fresh_target
    pieces: list[str] = []
    steps = []
    out = generate(t, t.chat_prompt(COPY), PromptLookupDrafter() if drafter else None,
                   GenerationConfig(max_tokens=48), on_text=pieces.append,
                   on_step=steps.append)
    assert "".join(pieces) == out.text == t.detokenize(out.tokens)
    s = out.stats
    assert s.n_new == len(out.tokens) <= 48
    assert out.finish_reason in ("length", "eos")
    assert s.steps == steps and 0 < s.ttft_s <= s.t_total_s
    # one token from the prefill, then each step adds its accepted drafts and one more
    n_from_steps = sum(st.n_accepted + 1 for st in s.steps)
    assert n_from_steps + 1 >= s.n_new
    if drafter:
        assert s.mean_accepted > 1.0  # copying is what prompt lookup is good at


def test_max_tokens_is_exact_even_when_drafts_overshoot(fresh_target):
    t = fresh_target
    for n in (1, 2, 7):
        out = generate(t, t.chat_prompt(COUNT), PromptLookupDrafter(), GenerationConfig(n))
        assert len(out.tokens) == n and out.finish_reason == "length"


def test_stop_string_ends_and_is_not_included(fresh_target):
    t = fresh_target
    full = generate(t, t.chat_prompt(COUNT), None, GenerationConfig(40)).text
    assert "5" in full
    stop = full[full.index("5"):full.index("5") + 2]
    out = generate(t, t.chat_prompt(COUNT), PromptLookupDrafter(),
                   GenerationConfig(40, stop=(stop,)))
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(stop)]


def test_eos_ends_generation(fresh_target):
    t = fresh_target
    short = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    out = generate(t, t.chat_prompt(short), None, GenerationConfig(200))
    assert out.finish_reason == "eos" and len(out.tokens) < 200


def test_cancel_between_steps_keeps_partial_text(fresh_target):
    t = fresh_target
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) > 3

    out = generate(t, t.chat_prompt(COUNT), PromptLookupDrafter(), GenerationConfig(200),
                   should_stop=should_stop)
    assert out.finish_reason == "cancelled"
    assert 1 <= len(out.tokens) < 200 and out.text
    # The engine is usable straight after.
    again = generate(t, t.chat_prompt(COUNT), None, GenerationConfig(4))
    assert len(again.tokens) == 4


def test_context_full_prompt_is_refused_and_engine_survives(fresh_target):
    t = fresh_target
    huge = [{"role": "user", "content": "word " * (t.n_ctx + 10)}]
    with pytest.raises(ContextFullError):
        generate(t, t.chat_prompt(huge), PromptLookupDrafter(), GenerationConfig(8))
    assert len(generate(t, t.chat_prompt(COUNT), None, GenerationConfig(3)).tokens) == 3


def test_generation_stops_cleanly_when_the_context_fills(model_path):
    from engine.runtime.target import Target, TargetConfig

    with Target(model_path, TargetConfig(n_ctx=96, n_threads=2)) as t:
        prompt = t.chat_prompt(COUNT)
        out = generate(t, prompt, PromptLookupDrafter(), GenerationConfig(500))
        assert out.finish_reason in ("context", "eos")
        assert t.n_used <= t.n_ctx


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_draft=-1)])
def test_invalid_generation_settings(bad):
    with pytest.raises(InvalidSamplingError):
        GenerationConfig(**bad)
