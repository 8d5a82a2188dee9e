"""The draft head and drafts from memory as one drafter: the union of their trees, lossless
greedy output across conversations (on the F32 target, where auto plans the head), the
target's distribution under sampling, and the session choosing it when auto plans the
head."""

from __future__ import annotations

import pytest

from engine.drafters import make_drafter
from engine.drafters.merged import MergedDrafter, merge_trees
from engine.runtime.draft_tree import DraftTree
from tests.conftest import (
    drafted_equals_plain,
    pick_per_category,
    plain_answers,
    second_token_counts,
)
from tests.stats_helpers import two_sample_z
from tests.tree_helpers import paths

MAX_TOKENS = 48


def test_merged_tree_is_the_best_scored_union():
    memory = DraftTree()
    a = memory.add(5, -1, 0.9)
    b = memory.add(6, a, 0.8)
    memory.add(7, b, 0.7)
    head = DraftTree()
    c = head.add(5, -1, 0.5)  # the same first token, scored lower: memory's score stays
    head.add(9, c, 0.45)
    head.add(4, -1, 0.3)
    merged = merge_trees([memory, head], 10)
    assert paths(merged) == {(5,): 0.9, (5, 6): 0.8, (5, 6, 7): 0.7, (5, 9): 0.45,
                              (4,): 0.3}
    for i, parent in enumerate(merged.parents):
        assert parent < i and (parent < 0 or merged.scores[parent] >= merged.scores[i])
    assert paths(merge_trees([memory, head], 3)) == {(5,): 0.9, (5, 6): 0.8,
                                                       (5, 6, 7): 0.7}
    assert len(merge_trees([], 4)) == 0


@pytest.fixture(scope="module")
def rows_and_plain(f32_target, dev_prompts):
    # Every other category (7 prompts, the long RAG one among them): the suite's time.
    rows = pick_per_category(dev_prompts, 1)[::2]
    return rows, plain_answers(f32_target, rows, MAX_TOKENS)


def test_head_with_memory_greedy_equals_plain_across_conversations(f32_target,
                                                                   rows_and_plain):
    """One memory for the run: later prompts draft from earlier answers and from the
    head; every budget-kept node is verified and the output is the target's own. The
    second pass asks every question again, so memory drafts whole answers."""
    rows, plain = rows_and_plain
    assert len(rows) == 7 and len({r["category"] for r in rows}) == 7
    drafter = make_drafter("head+memory", target=f32_target)
    assert isinstance(drafter, MergedDrafter)
    first = drafted_equals_plain(f32_target, drafter, rows, plain, MAX_TOKENS,
                                 free_verification=False)
    again = drafted_equals_plain(f32_target, drafter, rows, plain, MAX_TOKENS,
                                 free_verification=False)
    accepted = [sum(s.n_accepted for out in outs for s in out.stats.steps)
                for outs in (first, again)]
    assert accepted[0] > 0 and accepted[1] > 2 * accepted[0]  # memory drafts repeats
    assert drafter.memory.memory.n_sequences == 2 * len(rows)


@pytest.mark.slow
def test_head_with_memory_sampling_keeps_the_target_distribution(fresh_target):
    t = fresh_target
    prompt = t.chat_prompt([{"role": "user", "content": "Name a colour and say why you like it."}])
    drafter = make_drafter("head+memory", target=t)
    n_runs = 150
    # Every answer is remembered, so memory drafts from earlier samples too.
    plain, spec, n_proposed = second_token_counts(t, prompt, drafter, n_runs)
    assert n_proposed > n_runs
    assert drafter.memory.memory.n_sequences > 0
    assert plain.sum() > 0.9 * n_runs and spec.sum() > 0.9 * n_runs
    assert two_sample_z(plain, spec) < 4.0


def test_a_tree_keeps_its_best_leaves_within_the_targets_sequences():
    tree = DraftTree()
    a = tree.add(1, -1, 0.9)
    tree.add(2, a, 0.5)
    tree.add(3, a, 0.2)
    b = tree.add(4, -1, 0.6)
    tree.add(5, b, 0.4)
    tree.add(6, -1, 0.1)
    assert len(tree.leaves()) == 4
    cut = tree.with_leaves_at_most(2)
    assert paths(cut) == {(1,): 0.9, (1, 2): 0.5, (4,): 0.6, (4, 5): 0.4}
    assert len(cut.leaves()) == 2
    assert tree.with_leaves_at_most(4) is tree


def test_head_with_memory_stays_within_a_small_targets_sequences(model_path, dev_prompts):
    """A merged tree can have more leaves than the target has KV sequences (the bench on
    an H200 stopped with 'a tree of 16 leaves exceeds the 15 sequences available'). On a
    target with 3, every node the budget keeps is verified and the answers stay plain
    decoding's."""
    from engine.runtime.target import Target, TargetConfig

    rows = pick_per_category(dev_prompts, 1)[:4]
    with Target(model_path, TargetConfig(n_ctx=2048, n_seq_max=4)) as small:
        assert small.max_leaves == 3
        plain = plain_answers(small, rows, MAX_TOKENS)
        drafter = make_drafter("head+memory", target=small)
        for _ in range(2):  # the second pass drafts whole answers from memory too
            outs = drafted_equals_plain(small, drafter, rows, plain, MAX_TOKENS)
        assert sum(s.n_accepted for out in outs for s in out.stats.steps) > 0
