from engine.draft_tree import DraftTree
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter


def test_proposes_what_followed_the_last_ngram():
    d = PromptLookupDrafter(LookupConfig(max_branches=1, adaptive=False, max_depth=4))
    d.begin([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], None)
    tree = d.draft(8)
    assert tree.tokens == [4, 5, 6, 9] and tree.is_chain()


def test_nothing_proposed_without_a_match():
    d = PromptLookupDrafter()
    d.begin([1, 2, 3, 4, 5], None)
    assert len(d.draft(8)) == 0


def test_different_continuations_become_distinct_siblings():
    d = PromptLookupDrafter(LookupConfig(max_branches=3, adaptive=False, max_depth=3))
    d.begin([7, 8, 1, 7, 8, 2, 5, 7, 8, 1, 6, 7, 8], None)
    tree = d.draft(16)
    roots = [t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == -1]
    assert sorted(roots) == [1, 2]  # the two "7 8 1 ..." matches share a branch
    for parent in set(tree.parents):
        kids = [t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == parent]
        assert len(kids) == len(set(kids))


def test_budget_is_respected_and_context_tracks_accepts():
    d = PromptLookupDrafter(LookupConfig(adaptive=False))
    d.begin([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], None)
    assert len(d.draft(3)) == 3
    d.accept([3, 4, 10], None)
    assert d.context[-3:] == [3, 4, 10]


def test_adaptive_length_shrinks_after_rejections():
    d = PromptLookupDrafter(LookupConfig(max_branches=1, max_depth=8))
    d.begin(list(range(20)) + [0, 1], None)
    assert len(d.draft(8)) == 8
    d.accept([50], None)  # the target rejected all eight
    assert len(d.draft(8)) == 0  # "1 50" never occurred
    d.accept([0, 1], None)
    assert 1 <= len(d.draft(8)) < 8


def test_draft_tree_helpers():
    t = DraftTree.chain([4, 5, 6])
    assert t.depths() == [1, 2, 3] and t.is_chain() and t.leaves() == [2]
    t.add(9, -1)
    assert not t.is_chain() and t.children() == [[1, 4], [2], [3], [], []]
