import pytest

from engine.decoding.budget import VerifyCost, VerifyCostModel, best_node_count, trim_to_budget
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
from engine.runtime.draft_tree import DraftTree


def test_proposes_what_followed_the_last_ngram():
    d = PromptLookupDrafter(LookupConfig(max_branches=1, max_depth=4))
    d.begin([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], None)
    tree = d.draft(8)
    assert tree.tokens == [4, 5, 6, 9] and tree.is_chain()


def test_nothing_proposed_without_a_match():
    d = PromptLookupDrafter()
    d.begin([1, 2, 3, 4, 5], None)
    assert len(d.draft(8)) == 0


def test_different_continuations_become_distinct_siblings():
    d = PromptLookupDrafter(LookupConfig(max_branches=3, max_depth=3))
    d.begin([7, 8, 1, 7, 8, 2, 5, 7, 8, 1, 6, 7, 8], None)
    tree = d.draft(16)
    roots = [t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == -1]
    assert sorted(roots) == [1, 2]  # the two "7 8 1 ..." matches share a branch
    for parent in set(tree.parents):
        kids = [t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == parent]
        assert len(kids) == len(set(kids))


def test_budget_is_respected_and_context_tracks_accepts():
    d = PromptLookupDrafter()
    d.begin([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], None)
    assert len(d.draft(3)) == 3
    d.accept([3, 4, 10], None)
    assert d.context[-3:] == [3, 4, 10]


def test_scores_are_path_products_that_learn_from_the_target():
    d = PromptLookupDrafter(LookupConfig(max_branches=1, max_depth=4))
    ctx = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    d.begin(ctx, None)
    tree = d.draft(8)
    assert all(a > b for a, b in zip(tree.scores, tree.scores[1:], strict=False))
    before = list(tree.scores)
    d.accept([4, 7], None)  # the target took the first token, then went its own way
    d.begin(ctx, None)
    after = d.draft(8).scores
    assert after[0] > before[0]  # depth 1 succeeded
    assert after[1] / after[0] < before[1] / before[0]  # depth 2 failed


def test_draft_tree_helpers():
    t = DraftTree.chain([4, 5, 6])
    assert t.depths() == [1, 2, 3] and t.is_chain() and t.leaves() == [2]
    t.add(9, -1)
    assert not t.is_chain() and t.children() == [[1, 4], [2], [3], [], []]


def test_budget_keeps_only_nodes_that_pay_for_their_verification():
    model = VerifyCostModel(slope=0.35)
    model.observe(100, 1, 0.010)
    cost = model.at(100)
    assert best_node_count([0.9, 0.8, 0.05], cost) == 2
    assert best_node_count([0.2, 0.1], cost) == 0
    tree = DraftTree()
    a = tree.add(5, -1, 0.9)
    tree.add(6, a, 0.8)
    tree.add(7, -1, 0.05)
    kept = trim_to_budget(tree, cost)
    assert kept.tokens == [5, 6] and kept.parents == [-1, 0]
    model.observe(100, 3, 0.040)  # verifying three turned out to be expensive
    assert len(trim_to_budget(tree, model.at(100))) < 2
    model.observe(1500, 1, 0.020)  # a longer context: its own single-token time...
    assert model.at(1500).t1 == 0.020
    assert model.at(1500).ratio(3) == pytest.approx(1.7)  # ...and the prior until batches
    assert model.at(100).t1 == 0.010 and model.at(100).ratio(3) == pytest.approx(4.0)


def test_one_slow_decode_cannot_stop_drafting_for_good():
    """A verification the OS slowed 6x once must not price drafts out forever: sizes
    verified again are judged on a median, and a ratio nobody re-measures is forgotten."""
    model = VerifyCostModel.from_curve({1: 0.010, 2: 0.0134, 3: 0.017, 4: 0.020})
    for _ in range(5):
        model.observe(100, 1, 0.010)
    assert best_node_count([0.8, 0.6], model.at(100)) == 2
    model.observe(100, 2, 0.080)  # one hiccup while verifying two tokens
    model.observe(100, 3, 0.017)
    model.observe(100, 3, 0.017)
    assert best_node_count([0.8], model.at(100)) == 0  # priced out for now...
    for _ in range(model.max_age):
        model.observe(100, 1, 0.010)  # ...while plain steps go on
    assert best_node_count([0.8], model.at(100)) == 1  # ...but not for good
    for _ in range(3):  # and re-measured, the median forgets the hiccup
        model.observe(100, 2, 0.0134)
    assert model.at(100).ratio(2) == pytest.approx(1.34)


def test_sizes_between_and_beyond_the_known_ones_lie_on_straight_lines():
    cost = VerifyCost(0.01, {2: 1.5, 4: 2.0}, slope=0.35)
    assert cost.ratio(3) == pytest.approx(1.75)
    assert cost.ratio(8) == pytest.approx(2.0 + 4 * (1.0 / 3))  # the chord from 1 through 4
    assert VerifyCost(0.01, {}, slope=0.35).ratio(5) == pytest.approx(2.4)


def test_sizes_not_verified_lately_keep_the_calibrated_price():
    """Verifying only chains of 4 must not leave longer chains priced by a guess, which
    the budget would then never test: they keep the calibrated curve, scaled by how much
    dearer the sizes verified lately came out (a longer context)."""
    curve = {1: 0.010, 2: 0.016, 3: 0.020, 4: 0.019, 8: 0.031, 16: 0.051, 33: 0.099}
    model = VerifyCostModel.from_curve(curve)
    for _ in range(5):
        model.observe(100, 1, 0.010)
        model.observe(100, 2, 0.016)
        model.observe(100, 4, 0.019)
    cost = model.at(100)
    assert cost.ratio(16) == pytest.approx(5.1) and cost.ratio(33) == pytest.approx(9.9)
    assert best_node_count([0.99] * 15, cost) == 15  # a long sure repeat is verified whole
    for _ in range(5):  # later, at a context where batches cost twice the extra
        model.observe(700, 1, 0.010)
        model.observe(700, 4, 0.010 + 2 * 0.009)
    assert model.at(700).ratio(16) == pytest.approx(1 + 2 * 4.1)


def test_a_long_context_without_batches_measured_prices_attention_in_every_row():
    """At a context whose batches were never verified, a batch is dearer than the
    calibrated curve says by the attention each row pays there (measured on the bundled
    model: c(16) 7.2 at 256 tokens, 10.7 at 3,000); once batches are measured there,
    they decide."""
    model = VerifyCostModel.from_curve({1: 0.005, 8: 0.005 * 4.47, 16: 0.005 * 7.22})
    model.observe(100, 1, 0.005)
    assert model.at(100).ratio(16) == pytest.approx(7.22)
    model.observe(3000, 1, 0.0121)  # a token costs 7.1 ms more at 3,000 tokens
    priced = model.at(3000).ratio(16)
    assert priced == pytest.approx((7.22 * 0.005 + 16 * 0.0071) / 0.0121)
    assert priced > 10.7  # never cheaper than measured there
    model.observe(3000, 16, 0.0121 * 10.7)
    assert model.at(3000).ratio(16) == pytest.approx(10.7)


def test_rows_that_read_the_cache_together_pay_a_share_of_its_attention():
    """Through the tiled CPU kernel a batch's rows read the cache together: past the
    first, each row pays ``row_share`` of a token's attention (the session sets
    TILED_ROW_SHARE for such targets)."""
    from engine.decoding.budget import TILED_ROW_SHARE

    model = VerifyCostModel.from_curve({1: 0.005, 8: 0.005 * 4.47, 16: 0.005 * 7.22})
    model.row_share = TILED_ROW_SHARE
    model.observe(100, 1, 0.005)
    model.observe(3000, 1, 0.0121)
    extra = 0.0121 - 0.005
    priced = model.at(3000).ratio(16)
    assert priced == pytest.approx((7.22 * 0.005 + (1 + TILED_ROW_SHARE * 15) * extra) / 0.0121)
    assert 0 < TILED_ROW_SHARE < 1
    alone = VerifyCostModel.from_curve({1: 0.005, 8: 0.005 * 4.47, 16: 0.005 * 7.22})
    alone.observe(3000, 1, 0.0121)
    assert priced < alone.at(3000).ratio(16)  # cheaper than every row reading alone
