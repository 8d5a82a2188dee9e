"""Every drafter on the most downloaded quantization: the bundled model requantized to
Q4_K_M, run with each of the kernel settings the exactness probe may choose for K-quants
(repacking off; repacked with verifications of at most 3 tokens: tests/test_exactness.py),
gives plain decoding's tokens with each drafter, chains and trees, greedy and seeded
sampling, with drafts accepted."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.sampling import SamplingParams
from engine.drafters import make_drafter
from engine.drafters.draft_model import DraftModelConfig, DraftModelDrafter
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
from engine.drafters.memory import MemoryDrafter
from engine.runtime.draft_tree import DraftTree
from engine.runtime.prompt_weights import prompts_prefer_repacked
from engine.runtime.target import Target, TargetConfig
from tests.conftest import (
    drafted_equals_plain,
    follow_up_with_features,
    pick_per_category,
    plain_answers,
)

MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["no-repack", "repacked-short"])
def k_quant_target(quantized, request):
    config = TargetConfig(n_ctx=2048, n_threads=2, repack=False)
    if request.param == "repacked-short":
        config = TargetConfig(n_ctx=2048, n_threads=2, repack=True, max_batch=3)
    with Target(quantized("q4_k_m"), config) as target:
        yield target


@pytest.fixture(scope="module")
def prompts_and_plain(k_quant_target, dev_prompts):
    rows = pick_per_category(dev_prompts, 1)[::2]  # every other category: 7 prompts
    return rows, plain_answers(k_quant_target, rows, MAX_TOKENS)


def _accepted(outs) -> int:  # noqa: ANN001
    return sum(s.n_accepted for out in outs for s in out.stats.steps)


@pytest.mark.parametrize("drafter_name", ["lookup-chain", "lookup-tree", "head-chain",
                                          "head-tree", "draft-model"])
def test_every_drafter_on_q4_k_m_equals_plain(k_quant_target, prompts_and_plain, model_path,
                                              drafter_name):
    rows, plain = prompts_and_plain
    kind, shape = drafter_name.split("-")
    if kind == "lookup":
        drafter = PromptLookupDrafter(LookupConfig(max_branches=1 if shape == "chain" else 3))
    elif kind == "head":
        drafter = make_drafter("head", target=k_quant_target, mode=shape)
    else:  # the bundled Q4_0 file drafts for its own weights at Q4_K_M
        drafter = DraftModelDrafter(model_path, k_quant_target.n_ctx + 32, 2,
                                    DraftModelConfig())
    try:
        outs = drafted_equals_plain(k_quant_target, drafter, rows, plain, MAX_TOKENS)
    finally:
        if isinstance(drafter, DraftModelDrafter):
            drafter.close()
    assert _accepted(outs) > (20 if kind != "lookup" else 0), drafter_name


def test_memory_drafts_on_q4_k_m_equal_plain(k_quant_target, prompts_and_plain):
    """Memory drafts (trees from an index of earlier answers): each question asked twice,
    the second time drafted from the first answer."""
    rows, plain = prompts_and_plain
    drafter = MemoryDrafter()
    for _ in range(2):
        outs = drafted_equals_plain(k_quant_target, drafter, rows[:4], plain, MAX_TOKENS)
    assert _accepted(outs) > 4 * MAX_TOKENS // 2


def test_a_seed_gives_the_same_answer_with_any_drafter_on_q4_k_m(k_quant_target,
                                                                prompts_and_plain):
    rows, plain = prompts_and_plain
    prompt = plain[rows[0]["question_id"]][0]
    cfg = GenerationConfig(max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=7))
    k_quant_target.reset()
    reference = generate(k_quant_target, prompt, None, cfg).tokens
    memory = MemoryDrafter()
    accepted = rejected = 0
    for drafter in (memory, memory, make_drafter("head", target=k_quant_target),
                    PromptLookupDrafter(LookupConfig(max_branches=3))):
        k_quant_target.reset()
        out = generate(k_quant_target, prompt, drafter, cfg,
                       cost=VerifyCostModel(slope=0.0, learn=False))
        assert out.tokens == reference, drafter.name
        accepted += sum(s.n_accepted for s in out.stats.steps)
        rejected += sum(s.n_proposed - s.n_accepted for s in out.stats.steps)
    # Drafts were really accepted on the way, and others rejected: the identity above
    # was tested on both outcomes (how many of each depends on this CPU's rounding).
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_long_prompts_are_prefilled_by_plain_weights_and_answers_stay_plain(
        k_quant_target, dev_prompts):
    """Q4_K_M prompts are fastest on plain weights, through the tiled matmul (2.6 s
    instead of 4.2 s repacked for 660 tokens at a 1.7B shape): a repacked target prefills
    its F16 context with a plain, mmapped copy, an unrepacked one with its own weights.
    Drafted answers from that cache are plain decoding's."""
    t = k_quant_target
    assert prompts_prefer_repacked(t.path) is False
    assert (t.prompts.f16.prefill_model is not None) == t.model.repack
    assert not (t.prompts.f16.prefill_model or t.model).repack
    row = next(r for r in dev_prompts if r["category"] == "rag")
    prompt = t.chat_prompt([{"role": "user", "content": row["turns"][0]}])
    assert len(prompt) > 400
    outs = []
    for drafter in (None, PromptLookupDrafter(LookupConfig(max_branches=3))):
        t.reset(cold=True)
        outs.append(generate(t, prompt, drafter, GenerationConfig(MAX_TOKENS),
                             cost=VerifyCostModel(slope=0.0, learn=False)))
        if t.prompts.f16.ctx is not None:  # (without flash attention and a copy: none)
            assert len(t.prompts.f16.tokens) > 400  # the prompt went through it
    assert outs[1].tokens == outs[0].tokens
    assert _accepted(outs[1:]) > 0


def test_short_prompts_take_the_fast_kernels_and_a_regenerate_answers_the_same(
        k_quant_target, dev_prompts):
    """Short prompts (16+ tokens) are prefilled by the plain copy too where there is one,
    else here with the prompt kernels (either way the first token sooner); the same prompt
    asked again with its answer cached (a regenerate) and a drafted answer both give plain
    decoding's first answer, and a second turn that reuses the cache equals its plain
    twin."""
    t = k_quant_target
    copy = t.prompts.f16.prefill_model is not None
    rows = [r for r in dev_prompts if r["category"] in ("coding", "math_reasoning")][:2]
    for row in rows:
        prompt = t.chat_prompt([{"role": "user", "content": row["turns"][0]}])
        assert 16 <= len(prompt) < 128
        t.reset(cold=True)
        first = generate(t, prompt, None, GenerationConfig(MAX_TOKENS))
        assert (t.prompts.f16.tokens[:len(prompt)] == prompt) == copy  # the copy prefilled it
        again = generate(t, prompt, None, GenerationConfig(MAX_TOKENS))  # cache kept
        drafted = generate(t, prompt, PromptLookupDrafter(LookupConfig()),
                           GenerationConfig(MAX_TOKENS),
                           cost=VerifyCostModel(slope=0.0, learn=False))
        assert again.tokens == first.tokens == drafted.tokens, row["question_id"]
        follow = prompt + first.tokens + t.tokenize(" Explain more.", special=False)
        turns = [generate(t, follow, d, GenerationConfig(MAX_TOKENS),
                          cost=VerifyCostModel(slope=0.0, learn=False)).tokens
                 for d in (None, PromptLookupDrafter(LookupConfig()))]
        assert turns[0] == turns[1]


def test_freeing_parked_cells_keeps_plain_decodings_cache(k_quant_target, prompts_and_plain):
    """Parked cells are freed by evaluating the tokens after them again, in batches the
    kernels keep exact (3 rows where repacked Q4_K sums otherwise from 4 on): the next
    token's logits are plain decoding's bit for bit."""
    t = k_quant_target
    rows, plain = prompts_and_plain
    prompt = plain[rows[0]["question_id"]][0]
    t.reset()
    ref = [int(np.argmax(t.prefill(prompt).logits))]
    ref_logits = []
    for _ in range(8):  # plain decoding, one token at a time
        ver = t.verify(ref[-1], DraftTree())
        ref_logits.append(ver.logits[0].copy())
        t.commit(ver, [0], [ref[-1]])
        ref.append(int(np.argmax(ref_logits[-1])))
    t.reset()
    t.prefill(prompt)
    tree = DraftTree()
    tree.add((ref[1] + 1) % t.n_vocab, -1)  # rejected, and before the accepted node
    tree.add(ref[1], -1)
    ver = t.verify(ref[0], tree)
    t.commit(ver, [0, 2], [ref[0], ref[1]])
    assert t.n_parked == 1
    for token in ref[2:7]:
        t.commit(t.verify(token, DraftTree()), [0], [token])
    t.compact()  # six tokens evaluated again
    assert t.n_parked == 0 and t.tokens[-7:] == ref[:7]
    np.testing.assert_array_equal(t.verify(ref[7], DraftTree()).logits[0], ref_logits[7])


def test_a_regenerate_with_features_gets_plain_decodings_first_token_on_q4_k_m(
        k_quant_target, dev_prompts):
    """A 9-token follow-up read with the prompt kernels, then asked again with features
    on (a feature drafter's regenerate): the first-token logits are plain decoding's,
    not a decode of the last token alone (0.55 apart on Q4_K_M unrepacked before)."""
    t = k_quant_target
    if not t.prompts.fast_prompts:
        pytest.skip("this build lacks the prompt kernels: nothing is remembered")
    base = t.chat_prompt([{"role": "user", "content": dev_prompts[0]["turns"][0]}])
    prompt = base + t.tokenize(" Say it again in other words.", special=False)[:9]
    plain, (first, again) = follow_up_with_features(t, base, prompt, again=True)
    np.testing.assert_array_equal(first.logits, plain)
    np.testing.assert_array_equal(again.logits, plain)
    assert again.features is not None and len(again.features) == 32
