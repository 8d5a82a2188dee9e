"""Repetition, frequency and presence penalties and min-p: the maths, and that speculative
decoding stays lossless with them on (each drafted position is penalised with its own
prefix), on the real bundled model."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.sampling import CHAT_DEFAULTS, SamplingParams, penalised, target_distribution
from engine.drafters.memory import MemoryDrafter
from engine.errors import InvalidSamplingError
from tests.conftest import pick_per_category
from tests.test_lossless import NoisyDrafter

PENALTIES = SamplingParams(repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                           penalty_last_n=32)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target(model_path):
    """A target that verifies the noisy drafter's trees: flash attention through ggml's
    own one-row kernel (the CPU's default, Tandem's tiled kernel, verifies their best
    chain: native_policy.trees_exact)."""
    from engine.runtime.llama_bindings import use_tiled_attention
    from engine.runtime.target import Target, TargetConfig

    use_tiled_attention(False)
    try:
        with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2, flash_attn=True)) as t:
            assert t.trees
            yield t
    finally:
        use_tiled_attention(True)


def test_penalties_follow_llama_cpp():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = penalised(logits, [0, 1, 1], p)
    # token 0 once: 2/2 - 0.5 - 0.25; token 1 twice: -1*2 - 1.0 - 0.25; others untouched
    np.testing.assert_allclose(out, [0.25, -3.25, 0.5, 3.0])
    assert logits[0] == 2.0  # the input is not modified
    assert penalised(logits, [0], SamplingParams()) is logits  # off: no copy


def test_min_p_drops_the_unlikely_tail():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    probs = target_distribution(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert probs[3] == 0.0 and probs[2] > 0.0  # 0.05 < 0.2 * 0.5 <= 0.15
    np.testing.assert_allclose(probs.sum(), 1.0)


@pytest.mark.parametrize("bad", [dict(repeat_penalty=0.0), dict(repeat_penalty=float("nan")),
                                 dict(frequency_penalty=2.5), dict(presence_penalty=-3.0),
                                 dict(min_p=1.0), dict(min_p=-0.1), dict(penalty_last_n=-1)])
def test_invalid_penalties_are_refused(bad):
    with pytest.raises(InvalidSamplingError, match=next(iter(bad))):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def rows_and_plain(target, dev_prompts):
    rows = pick_per_category(dev_prompts, 1)[::2]  # every other category: 7 prompts
    plain = {}
    for row in rows:
        target.reset()
        prompt = target.chat_prompt([{"role": "user", "content": row["turns"][0]}])
        cfg = GenerationConfig(MAX_TOKENS, sampling=PENALTIES)
        plain[row["question_id"]] = (prompt, generate(target, prompt, None, cfg).tokens)
    return rows, plain


def test_penalties_change_the_answer(target, rows_and_plain):
    """Otherwise the lossless tests below would prove nothing."""
    rows, plain = rows_and_plain
    changed = 0
    for row in rows:
        prompt, ref = plain[row["question_id"]]
        target.reset()
        changed += generate(target, prompt, None, GenerationConfig(MAX_TOKENS)).tokens != ref
    assert changed >= len(rows) // 2


def test_greedy_with_penalties_equals_plain_with_drafted_trees(target, rows_and_plain):
    rows, plain = rows_and_plain
    cfg = GenerationConfig(MAX_TOKENS, sampling=PENALTIES)
    for seed, row in enumerate(rows):
        prompt, ref = plain[row["question_id"]]
        target.reset()
        out = generate(target, prompt, NoisyDrafter(ref, seed), cfg)
        assert out.tokens == ref, f"question {row['question_id']} ({row['category']})"
        assert any(s.n_accepted >= 2 for s in out.stats.steps)  # deep paths were penalised
        assert any(s.n_accepted < s.n_proposed for s in out.stats.steps)  # its dead branch


def test_greedy_with_penalties_equals_plain_drafting_from_memory(target, rows_and_plain):
    """The memory drafter proposes the unpenalised answer it remembers; the target's
    penalised choice decides, exactly as plain decoding with the same penalties."""
    rows, plain = rows_and_plain
    memory = MemoryDrafter()
    accepted = proposed = 0
    for row in rows[:6]:
        prompt, ref = plain[row["question_id"]]
        target.reset()
        unpenalised = generate(target, prompt, memory, GenerationConfig(MAX_TOKENS))
        assert unpenalised.tokens  # remembered for the next run
        target.reset()
        # a fixed verification curve: one learnt under load can decline every draft
        out = generate(target, prompt, memory, GenerationConfig(MAX_TOKENS, sampling=PENALTIES),
                       cost=VerifyCostModel(slope=0.35, learn=False))
        assert out.tokens == ref, f"question {row['question_id']} ({row['category']})"
        accepted += sum(s.n_accepted for s in out.stats.steps)
        proposed += sum(s.n_proposed for s in out.stats.steps)
    # the answers agree up to the first penalised repeat, then the remembered one is refused
    assert 0 < accepted < proposed


def test_sampling_with_penalties_gives_plain_sampling_answer(target, rows_and_plain):
    """A seed fixes each position's uniform: with penalties, every drafter gives the answer
    plain sampling gives, so each token is a draw from the penalised target."""
    rows, plain = rows_and_plain
    params = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.05, repeat_penalty=1.2,
                            frequency_penalty=0.3, penalty_last_n=48)
    for seed, row in enumerate(rows[:5]):
        prompt, _ = plain[row["question_id"]]
        cfg = GenerationConfig(MAX_TOKENS, sampling=SamplingParams(
            **{**params.__dict__, "seed": seed}))
        target.reset()
        ref = generate(target, prompt, None, cfg).tokens
        target.reset()
        out = generate(target, prompt, NoisyDrafter(ref, seed), cfg)
        assert out.tokens == ref
        assert any(s.n_accepted for s in out.stats.steps)


def test_chat_defaults_stop_the_bundled_model_looping(target):
    """Asked for a poem at temperature 0, the bundled model repeats a few lines until the
    token limit; the chat defaults break the loop. (Where it then stops depends on the
    CPU's kernels: with AVX-512 it ends the poem, on an AVX2-only EPYC it still ran to 400
    tokens, 18 distinct lines of 37 against 9 of 39.)"""
    prompt = target.chat_prompt([{"role": "user", "content": "Write a poem about the sea."}])

    def lines(params: SamplingParams) -> tuple[str, list[str]]:
        target.reset()
        out = generate(target, prompt, None, GenerationConfig(400, sampling=params))
        return out.finish_reason, [ln for ln in out.text.splitlines() if ln.strip()]

    reason, looped = lines(SamplingParams())
    assert reason == "length" and len(set(looped)) < len(looped) / 3
    _, poem = lines(CHAT_DEFAULTS)
    assert len(set(poem)) / len(poem) > len(set(looped)) / len(looped) + 0.15
