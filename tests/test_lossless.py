"""Greedy speculative output equals plain decoding, token for token, on real prompts."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.base import Drafter
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
from engine.drafters.memory import MemoryDrafter
from engine.runtime.draft_tree import DraftTree
from engine.runtime.target import Target, TargetConfig
from tests.conftest import drafted_equals_plain, pick_per_category, plain_answers, second_turn

MAX_TOKENS = 40


def fixed_cost() -> VerifyCostModel:
    """Verification priced by a fixed curve: one learnt from a busy machine's decodes
    can decline every draft, and the tests below assert that drafts were accepted."""
    return VerifyCostModel(slope=0.35, learn=False)


@pytest.fixture(scope="module")
def prompts_and_plain(target, dev_prompts):
    rows = pick_per_category(dev_prompts, 1)  # one per category: 13 prompts
    return rows, plain_answers(target, rows, MAX_TOKENS)


class NoisyDrafter(Drafter):
    """Proposes trees that mix the right continuation with wrong tokens, so every
    acceptance length and both the first-leaf and other-leaf commit paths are exercised."""

    name = "noisy"

    def __init__(self, oracle: list[int], seed: int) -> None:
        self.oracle = oracle
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def begin(self, context, features):
        self.n = 1  # the first token is already out

    def draft(self, max_tokens, token_time_s=0.0):
        truth = self.oracle[self.n:self.n + 4]
        r = int(self.rng.integers(1, 1000))
        tree = DraftTree()
        tree.add((truth[0] + r) % 49152 if truth else r, -1)  # a dead first branch
        node = -1
        for tok in truth[: int(self.rng.integers(0, len(truth) + 1))]:
            node = tree.add(tok, node)
        if node >= 0:
            tree.add(r, node)  # usually wrong after the right ones
        return tree.truncated(max_tokens)

    def accept(self, new_tokens, features):
        self.n += len(new_tokens)


@pytest.mark.parametrize("branches", [1, 3], ids=["chain", "tree"])
def test_lookup_greedy_equals_plain(target, prompts_and_plain, branches):
    rows, plain = prompts_and_plain
    assert len(rows) == 13 and len({r["category"] for r in rows}) == 13
    n_accepted = n_proposed = 0
    for row in rows:
        prompt, ref = plain[row["question_id"]]
        target.reset()
        drafter = PromptLookupDrafter(LookupConfig(max_branches=branches))
        out = generate(target, prompt, drafter, GenerationConfig(MAX_TOKENS),
                       cost=fixed_cost())
        assert out.tokens == ref, f"question {row['question_id']} ({row['category']})"
        n_accepted += sum(s.n_accepted for s in out.stats.steps)
        n_proposed += sum(s.n_proposed for s in out.stats.steps)
    assert n_accepted > 0  # the drafts were really used
    assert n_proposed > n_accepted  # and some were wrong, so rejection was exercised


@pytest.fixture()
def tree_target(model_path):
    """A target that verifies trees: flash attention through ggml's own one-row kernel
    (Tandem's tiled kernel sums by cell layout, so a CPU target with it verifies each
    tree's best chain: Target.trees)."""
    from engine.runtime.llama_bindings import use_tiled_attention

    use_tiled_attention(False)
    try:
        with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2, flash_attn=True)) as t:
            yield t
    finally:
        use_tiled_attention(True)


@pytest.mark.parametrize("trees", [False, True], ids=["best-chain", "tree"])
def test_noisy_tree_drafts_equal_plain(request, target, prompts_and_plain, trees):
    verifier = request.getfixturevalue("tree_target") if trees else target
    assert verifier.trees is trees
    rows = prompts_and_plain[0][:10]
    # Flash attention sums otherwise: the tree target's own plain answers.
    plain = plain_answers(verifier, rows, MAX_TOKENS) if trees else prompts_and_plain[1]
    for seed, row in enumerate(rows):
        prompt, ref = plain[row["question_id"]]
        verifier.reset()
        out = generate(verifier, prompt, NoisyDrafter(ref, seed), GenerationConfig(MAX_TOKENS))
        assert out.tokens == ref, f"question {row['question_id']}"
        if trees:  # every leaf and commit path (a best chain may be the dead branch)
            assert any(s.n_accepted for s in out.stats.steps)
            assert any(s.n_accepted < s.n_proposed for s in out.stats.steps)


def test_multi_turn_prefix_reuse_equals_cold_start(target, prompts_and_plain):
    """With every prompt prefilled in the Q8_0 cache by flash attention, the cache's
    history does not matter: a second turn on a warm cache writes what it writes from a
    cold one. (Without flash attention the prompt kernels sum a prompt's attention too,
    so cells read as a prompt differ from cells decoded, as the F16 context's do: drafted
    and plain sessions share the history, so they stay identical.)"""
    assert target.flash_attn  # the CPU rule: the one attention kernel
    rows = prompts_and_plain[0]
    row = next(r for r in rows if len(r["turns"]) == 2)
    prompt, first = plain_answers(target, [row], MAX_TOKENS)[row["question_id"]]
    second_prompt, _ = second_turn(target, row, first, MAX_TOKENS)
    target.f16_prefill_off = "test: every prompt in the Q8_0 cache"
    try:
        target.reset()
        cold = generate(target, second_prompt, None, GenerationConfig(MAX_TOKENS)).tokens
        target.reset()
        generate(target, prompt, PromptLookupDrafter(), GenerationConfig(MAX_TOKENS))
        warm = generate(target, second_prompt, PromptLookupDrafter(),
                        GenerationConfig(MAX_TOKENS), cost=fixed_cost())
    finally:
        target.f16_prefill_off = None
    assert warm.stats.n_prompt_reused > len(prompt) // 2
    assert warm.tokens == cold
    assert sum(s.n_accepted for s in warm.stats.steps) > 0  # drafted from the first answer


def test_memory_drafter_greedy_equals_plain_across_conversations(target, prompts_and_plain):
    """One memory for the whole run, as in the app: later prompts draft from the answers
    to earlier ones, every budget-kept node is verified, and the output stays the
    target's own."""
    rows, plain = prompts_and_plain
    assert len(rows) == 13 and len({r["category"] for r in rows}) == 13
    drafter = MemoryDrafter()
    outs = drafted_equals_plain(target, drafter, rows, plain, MAX_TOKENS,
                                free_verification=False)
    n_accepted = sum(s.n_accepted for out in outs for s in out.stats.steps)
    assert n_accepted > 0
    # other questions' answers are often not this one's: some drafts were rejected
    assert sum(s.n_proposed for out in outs for s in out.stats.steps) > n_accepted
    assert drafter.memory.n_sequences == len(rows)  # every answer was remembered


def test_memory_drafts_a_repeated_question_from_the_earlier_answer(target, prompts_and_plain):
    """Asked again in a new conversation, the model's earlier answer is drafted whole."""
    rows, plain = prompts_and_plain
    prompt, ref = plain[rows[0]["question_id"]]
    drafter = MemoryDrafter()
    target.reset()
    first = generate(target, prompt, drafter, GenerationConfig(MAX_TOKENS), cost=fixed_cost())
    target.reset()
    again = generate(target, prompt, drafter, GenerationConfig(MAX_TOKENS), cost=fixed_cost())
    assert first.tokens == again.tokens == ref
    assert again.stats.mean_accepted > max(2.0, first.stats.mean_accepted)


def test_memory_multi_turn_equals_plain(target, prompts_and_plain):
    """A second turn drafts from the first answer (in the prompt and in memory)."""
    rows, plain = prompts_and_plain
    drafter = MemoryDrafter()
    n_accepted = 0
    for row in [r for r in rows if len(r["turns"]) == 2][:4]:
        prompt, first = plain[row["question_id"]]
        second_prompt, cold = second_turn(target, row, first, MAX_TOKENS)
        target.reset()
        generate(target, prompt, drafter, GenerationConfig(MAX_TOKENS))
        warm = generate(target, second_prompt, drafter, GenerationConfig(MAX_TOKENS),
                        cost=fixed_cost())
        assert warm.tokens == cold, f"question {row['question_id']}"
        n_accepted += sum(s.n_accepted for s in warm.stats.steps)
    assert n_accepted > 0  # the second turns drafted from the first answers
