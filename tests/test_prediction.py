"""Drafts from a prediction (OpenAI's Predicted Outputs): where they come from, what they
count, and that the answer is plain decoding's whatever the prediction says."""

from __future__ import annotations

import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.sampling import SamplingParams
from engine.drafters.lookup import PromptLookupDrafter
from engine.drafters.prediction import PredictionConfig, PredictionDrafter, PredictionSource
from engine.runtime.draft_tree import DraftTree

from .conftest import pick_per_category, plain_answers
from .stats_helpers import two_sample_z


def test_the_longest_match_nearest_the_cursor_is_followed():
    # "1 2 3" occurs twice; what follows the answer's tail depends on the longer match.
    source = PredictionSource([9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 6, 7], PredictionConfig())
    assert source.find([0, 9, 1, 2, 3]) == (4, 4)  # "9 1 2 3" matches the first
    assert source.find([0, 8, 1, 2, 3]) == (10, 4)
    # The same 3 tokens only: the occurrence at or after the cursor wins.
    source.cursor = 6
    assert source.find([0, 0, 1, 2, 3])[0] == 10
    source.cursor = 0
    assert source.find([0, 0, 1, 2, 3])[0] == 4
    assert source.find([5, 5, 5]) is None and source.find([1, 2]) is None


def test_drafts_the_unchanged_rest_and_resumes_after_a_change():
    pred = list(range(100, 140))
    d = PredictionDrafter(pred, None)
    d.begin([1, 2, 100, 101, 102], None)
    d.n_prompt = 2  # an answer that does not start as predicted: drafts from matches
    tree = d.draft(8, 0.01)
    assert tree.tokens == list(range(103, 111)) and tree.is_chain()
    assert all(a >= b for a, b in zip(tree.scores, tree.scores[1:], strict=False))
    d.verifying(tree)
    d.accept([103, 104, 105, 999], None)  # 3 kept, then the answer changed a token
    assert (d.accepted, d.rejected) == (3, 5)
    assert len(d.draft(8, 0.01)) == 0  # "104 105 999" is not in the prediction
    d.accept([107, 108, 109], None)  # the answer comes back to the prediction
    assert d.draft(4, 0.01).tokens == [110, 111, 112, 113]


def test_an_answer_that_starts_as_predicted_drafts_from_its_first_token():
    d = PredictionDrafter([40, 41, 42, 43], None)
    d.begin([1, 2, 3, 40], None)  # the prompt, then the answer's first token
    assert d.draft(8, 0.01).tokens == [41, 42, 43]
    d.begin([1, 2, 3, 39], None)
    assert len(d.draft(8, 0.01)) == 0


def test_scores_learn_from_the_target():
    d = PredictionDrafter(list(range(100, 140)), None)
    d.begin([100, 101, 102], None)
    first = d.draft(4, 0.01).scores[0]
    for _ in range(6):  # the answer never follows the prediction
        tree = d.draft(4, 0.01)
        d.verifying(tree)
        d.accept([7], None)
        d.accept([100, 101, 102], None)
    assert d.draft(4, 0.01).scores[0] < first / 2


def test_the_base_drafters_tree_is_merged_in():
    base = PromptLookupDrafter()
    d = PredictionDrafter([50, 51, 52, 53], base)
    d.begin([7, 8, 9, 6, 7, 8, 50, 51, 52], None)
    assert d.name == "lookup+prediction" and d.kind == base.kind
    tree = d.draft(16, 0.01)
    roots = {t for t, p in zip(tree.tokens, tree.parents, strict=True) if p < 0}
    assert 53 in roots  # the prediction's next token
    d.close()  # the engine's drafter stays usable
    base.begin([1, 2, 1], None)


def _edited(tokens: list[int], every: int = 5) -> list[int]:
    """``tokens`` with every ``every``-th token changed: a prediction about 80% right."""
    return [t if i % every else (t + 1) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("free_verification", [True, False], ids=["all", "budget"])
def test_drafted_equals_plain_with_predictions_right_wrong_and_partly_right(
        target, dev_prompts, free_verification):
    rows = pick_per_category(dev_prompts, 1)[:3]
    plain = plain_answers(target, rows, 40)
    totals = {"accepted": 0, "rejected": 0}
    for make in (lambda ref: ref, _edited, lambda ref: [5, 6, 7] * 10):
        for row in rows:
            prompt, ref = plain[row["question_id"]]
            for base in (None, PromptLookupDrafter()):
                target.reset()
                drafter = PredictionDrafter(make(ref), base)
                cost = VerifyCostModel(slope=0.0 if free_verification else 0.35, learn=False)
                out = generate(target, prompt, drafter, GenerationConfig(40, max_draft=12),
                               cost=cost)
                assert out.tokens == ref, f"question {row['question_id']}"
                assert not out.stats.drafter_failed_in, out.stats.fallback
                totals["accepted"] += drafter.accepted
                totals["rejected"] += drafter.rejected
    # The check can fail: drafts were taken and turned down on the way.
    assert totals["accepted"] > 60 and totals["rejected"] > 10


def test_sampling_with_a_prediction_follows_the_target(fresh_target):
    """The prediction is the greedy answer, drafted at every step; sampled output's
    second token must still follow the target's distribution, and a seed gives the same
    answer with and without the prediction."""
    t = fresh_target
    prompt = t.chat_prompt([{"role": "user", "content": "Write one sentence about the sea."}])
    greedy = generate(t, prompt, None, GenerationConfig(max_tokens=8)).tokens
    cfg = GenerationConfig(max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=7))
    t.reset()
    seeded = generate(t, prompt, None, cfg).tokens
    t.reset()
    assert generate(t, prompt, PredictionDrafter(seeded, None), cfg).tokens == seeded
    plain, spec = [0] * t.n_vocab, [0] * t.n_vocab
    n_drafted = 0
    for seed in range(150):
        for counts, run_seed, drafter in ((plain, seed, None),
                                          (spec, 5000 + seed, PredictionDrafter(greedy, None))):
            sampling = SamplingParams(temperature=1.0, top_k=50, seed=run_seed)
            out = generate(t, prompt, drafter, GenerationConfig(3, sampling=sampling),
                           cost=VerifyCostModel(slope=0.0, learn=False))
            if drafter is not None:
                n_drafted += sum(s.n_proposed for s in out.stats.steps)
            if len(out.tokens) > 1:
                counts[out.tokens[1]] += 1
    assert n_drafted > 100
    import numpy as np
    assert two_sample_z(np.array(plain), np.array(spec)) < 4.0


def test_an_empty_prediction_tree_is_a_plain_step():
    d = PredictionDrafter([], None)
    d.begin([1, 2, 3], None)
    assert d.draft(8, 0.01) == DraftTree()
