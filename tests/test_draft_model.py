"""The draft-model drafter on a real pair with one vocabulary: the bundled model in
Q4_0 drafting for the same model in F32. Greedy output equals plain decoding token for
token (chain and multi-sequence), sampling keeps the target's distribution, the draft's
KV cache follows what the target accepted, and a draft with another vocabulary is
refused naming the fields."""

from __future__ import annotations

import json

import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.stats import StepStats
from engine.drafters.draft_model import DraftModelConfig, DraftModelDrafter
from engine.errors import IncompatibleDraftError
from engine.gguf.draft_compat import check_draft_model, mismatches
from engine.planning.draft_record import DraftRecord, pair_key
from engine.planning.planner import DRAFT_MODEL_ACCEPTANCE
from engine.runtime.model_info import read_vocab_facts
from engine.session import Engine, EngineConfig
from tests.conftest import drafted_equals_plain, pick_per_category, plain_answers, second_turn
from tests.hub_server import write_tiny_gguf

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def prompts_and_plain(f32_target, dev_prompts):
    # Every other category (7 prompts, the long RAG one among them): the suite's time.
    rows = pick_per_category(dev_prompts, 1)[::2]
    return rows, plain_answers(f32_target, rows, MAX_TOKENS)


def _drafter(model_path, target, **options) -> DraftModelDrafter:  # noqa: ANN001
    return DraftModelDrafter(model_path, target.n_ctx + 32, 2, DraftModelConfig(**options))


@pytest.mark.parametrize("sequences", [1, 3], ids=["chain", "multi-sequence"])
def test_q4_draft_for_an_f32_target_equals_plain(f32_target, model_path, prompts_and_plain,
                                                sequences):
    rows, plain = prompts_and_plain
    drafter = _drafter(model_path, f32_target, max_sequences=sequences)

    def cache_follows(prompt: list[int], out) -> None:  # noqa: ANN001
        # The draft's cache holds a prefix of what the target committed, no more.
        committed = prompt + out.tokens
        assert drafter.cached == committed[:len(drafter.cached)]

    try:
        outs = drafted_equals_plain(f32_target, drafter, rows, plain, MAX_TOKENS,
                                    free_verification=False, after=cache_follows)
        steps = [s for out in outs for s in out.stats.steps if s.n_proposed]
        side_sequences = drafter.stats()["side_sequences_per_call"]
    finally:
        drafter.close()
    # Same weights at another precision: most steps that drafted kept a draft token. (A
    # share, not a count: how many nodes the budget verifies follows this machine's costs.)
    kept = sum(s.n_accepted > 0 for s in steps)
    print(f"\n{len(steps)} drafting steps, {kept} kept a draft token, "
          f"{sum(s.n_accepted for s in steps)} of {sum(s.n_proposed for s in steps)} accepted")
    assert len(steps) >= len(rows) and kept > 0.6 * len(steps)
    assert (side_sequences > 0) == (sequences > 1)  # DuoDecoding's sequences were drafted


def test_drafting_ahead_during_verification_equals_plain(f32_target, model_path,
                                                        prompts_and_plain):
    """DuoDecoding's overlap: the next chain is drafted while the target verifies (here
    both on the CPU, in the engine's worker thread); a guess that held is served, one
    that failed is dropped, and the answers stay the target's."""
    rows, plain = prompts_and_plain
    drafter = _drafter(model_path, f32_target, draft_ahead=True)
    try:
        assert drafter.drafts_ahead
        # Verification priced as free: every step's tree is verified whole, so which
        # guesses hold does not depend on this machine's timings.
        outs = drafted_equals_plain(f32_target, drafter, rows[:6], plain, MAX_TOKENS)
        n_ahead = sum(out.stats.n_drafted_ahead for out in outs)
        n_steps = sum(out.stats.n_steps for out in outs)
        # The cache holds what was committed, then at most the chain drafted ahead.
        prompt = plain[rows[5]["question_id"]][0]
        committed = prompt + outs[-1].tokens
        n = min(len(drafter.cached), len(committed))
        assert drafter.cached[:n] == committed[:n]
        assert len(drafter.cached) <= len(committed) + drafter.config.max_depth + 1
        assert drafter.stats()["served_ahead"] == n_ahead
    finally:
        drafter.close()
    # Same weights at another precision: the guess held, and failed, on the way (how
    # often depends on this CPU's rounding: 19 of 99 steps on a Zen 3, more elsewhere).
    assert 0 < n_ahead < n_steps, (n_ahead, n_steps)


def test_a_second_turn_reuses_the_draft_cache(f32_target, model_path, prompts_and_plain):
    rows, plain = prompts_and_plain
    row = next(r for r in rows if len(r["turns"]) == 2)
    prompt, first = plain[row["question_id"]]
    second, cold = second_turn(f32_target, row, first, MAX_TOKENS)
    drafter = _drafter(model_path, f32_target)
    try:
        f32_target.reset()
        generate(f32_target, prompt, drafter, GenerationConfig(MAX_TOKENS))
        evals = drafter.stats()["draft_evals_per_call"]
        warm = generate(f32_target, second, drafter, GenerationConfig(MAX_TOKENS),
                        cost=VerifyCostModel(slope=0.0, learn=False))
        assert warm.tokens == cold
        assert sum(s.n_accepted for s in warm.stats.steps) > 0  # the warm turn drafted
        # The shared prefix was not evaluated again: far fewer than one eval per token.
        assert drafter.stats()["draft_evals_per_call"] < evals + 2
    finally:
        drafter.close()


@pytest.mark.slow
def test_sampling_with_a_draft_model_keeps_the_target_distribution(f32_target, model_path):
    from engine.decoding.sampling import SamplingParams

    from .stats_helpers import two_sample_z

    t = f32_target
    t.reset()
    prompt = t.chat_prompt([{"role": "user", "content": "Write one sentence about the sea."}])
    drafter = _drafter(model_path, t, p_min=0.0, max_depth=2)  # always a draft to judge
    plain, spec, n_drafted = [], [], 0
    try:
        for seed in range(160):
            params = dict(temperature=1.0, top_k=50)
            out_p = generate(t, prompt, None, GenerationConfig(
                3, sampling=SamplingParams(seed=seed, **params))).tokens
            out_s = generate(t, prompt, drafter, GenerationConfig(
                3, sampling=SamplingParams(seed=10_000 + seed, **params)), remember=False,
                cost=VerifyCostModel(slope=0.0, learn=False))  # every draft judged
            n_drafted += sum(s.n_proposed for s in out_s.stats.steps)
            plain += out_p[1:2]
            spec += out_s.tokens[1:2]
    finally:
        drafter.close()
    assert n_drafted > 80  # the draft model's tokens really were verified
    import numpy as np

    counts = [np.bincount(x, minlength=t.n_vocab) for x in (plain, spec)]
    assert two_sample_z(*counts) < 4.0


def test_a_draft_with_another_vocabulary_is_refused_naming_the_fields(model_path, tmp_path,
                                                                      f32_model_path):
    other = write_tiny_gguf(tmp_path / "other-vocab.gguf", n_vocab=300)
    target = read_vocab_facts(f32_model_path)
    assert mismatches(read_vocab_facts(model_path), target) == []  # the real pair fits
    with pytest.raises(IncompatibleDraftError) as caught:
        check_draft_model(read_vocab_facts(other), target)
    message = str(caught.value)
    for field in ("vocabulary type: the draft has SentencePiece, the target BPE",
                  "vocabulary size: the draft has 300, the target 49152",
                  "text of token 5: the draft has t5, the target <file_sep>"):
        assert field in message, message
    # The engine falls back to drafts from memory and says why; answers go on.
    config = EngineConfig(model_path=model_path, drafter="draft", draft_model=other,
                          n_ctx=512, n_threads=2, cache_dir=tmp_path, memory_dir=tmp_path)
    with Engine(config) as engine:
        assert engine.drafter_name == "memory"
        assert any("other-vocab.gguf" in n and "vocabulary size" in n for n in engine.notes)
        prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
        assert engine.generate(prompt, GenerationConfig(4)).tokens


def test_the_engine_drafts_with_a_draft_model(f32_model_path, model_path, tmp_path):
    config = EngineConfig(model_path=f32_model_path, drafter="draft", draft_model=model_path,
                          n_ctx=1024, n_threads=2, cache_dir=tmp_path, memory_dir=tmp_path)
    with Engine(config) as engine:
        assert engine.drafter_name == "draft" and not engine.notes
        # Verification priced by a fixed curve: learnt costs follow the machine's load and
        # may trim the drafts to one token (CI saw 1.46 tokens a step that way).
        engine.cost = VerifyCostModel(slope=0.35, learn=False)
        prompt = engine.chat_prompt([{"role": "user", "content": "Name three colours."}])
        out = engine.generate(prompt, GenerationConfig(24))
        proposed = sum(s.n_proposed for s in out.stats.steps)
        accepted = sum(s.n_accepted for s in out.stats.steps)
        assert out.stats.drafter == "draft" and proposed >= 8
        assert accepted >= 0.7 * proposed, (accepted, proposed)  # Q4_0 of the target itself


@pytest.mark.slow
def test_auto_prices_the_draft_model_and_drafts_with_it_when_it_pays(
        f32_model_path, model_path, tmp_path, prompts_and_plain):
    """auto measures the draft model, weighs it against the head and plain decoding, and
    runs it when its costs and this pair's record say it pays; the answer is still the
    target's own, and the record grows."""
    config = EngineConfig(model_path=f32_model_path, drafter="auto", draft_model=model_path,
                          n_ctx=1024, n_threads=2, cache_dir=tmp_path, memory_dir=tmp_path)
    with Engine(config) as engine:
        assert engine.costs.draft_token_s["cpu"] > 0
        assert engine.costs.draft_sync_s["cpu"] >= 0
        drafts = [c for c in engine.plan.candidates if c.drafter == "draft"]
        assert drafts and drafts[0].layout == "cpu" and drafts[0].budget.mode == "multi"
    # Costs set, not measured (a busy machine measures other ones): a verified batch as a
    # quiet CPU prices it, a head as dear as the target, a draft model 20x cheaper than
    # the target and a pair that was right almost every time: now it must be chosen.
    cache = json.loads((tmp_path / "calibration.json").read_text())
    (key, costs), = ((k, c) for k, c in cache.items() if not k.startswith("exactness-"))
    one = costs["verify_s"]["cpu"]["1"]
    costs["verify_s"]["cpu"] = {n: one * (1 + 0.15 * (int(n) - 1))
                                for n in costs["verify_s"]["cpu"]}
    costs["head_level_s"] = {dev: one for dev in costs["head_level_s"]}
    costs["draft_token_s"]["cpu"] = one / 20
    # Set as a quiet machine's: costs measured while busy would be measured again now.
    costs.update(busy=False, spread=0.0, others_cores=0.0)
    (tmp_path / "calibration.json").write_text(json.dumps({key: costs}))
    record = DraftRecord(tmp_path)
    pair = pair_key(f32_model_path, model_path)
    record.add(pair, [StepStats(0.001, 0.01, 8, 8)] * 200)
    acceptance, source = record.acceptance(pair, DRAFT_MODEL_ACCEPTANCE)
    assert acceptance[0] > 0.95 and "200 drafting steps" in source
    rows, plain = prompts_and_plain
    with Engine(config) as engine:
        assert engine.plan.drafter == "draft" and engine.drafter_name == "draft"
        assert "draft model SmolLM2" in engine.plan.reason and "200 drafting" in engine.plan.reason
        for row in rows[:2]:
            prompt, ref = plain[row["question_id"]]
            out = engine.generate(prompt, GenerationConfig(MAX_TOKENS))
            assert out.tokens == ref, f"question {row['question_id']} ({row['category']})"
    reached = json.loads((tmp_path / "draft_record.json").read_text())[pair]["reached"]
    assert reached[0] > 200  # the answers' steps were added


def test_auto_leaves_out_a_draft_model_of_another_vocabulary(model_path, tmp_path):
    other = write_tiny_gguf(tmp_path / "other-vocab.gguf", n_vocab=300)
    config = EngineConfig(model_path=model_path, drafter="auto", draft_model=other,
                          n_ctx=512, n_threads=2, cache_dir=tmp_path, memory_dir=tmp_path)
    with Engine(config) as engine:
        assert not [c for c in engine.plan.candidates if c.drafter == "draft"]
        assert any("other-vocab.gguf" in n and "the planner leaves it out" in n
                   for n in engine.notes)
        assert not engine.costs.draft_token_s  # nothing measured for it
