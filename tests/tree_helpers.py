"""Checks on draft trees shared by the drafter tests."""

from __future__ import annotations

from engine.runtime.draft_tree import DraftTree


def assert_well_formed(tree: DraftTree) -> None:
    """Parents first, distinct siblings, scores in (0, 1] never above the parent's."""
    assert len(tree.scores) == len(tree.tokens) == len(tree.parents)
    seen: set[tuple[int, int]] = set()
    for i, (tok, parent, score) in enumerate(zip(tree.tokens, tree.parents, tree.scores,
                                                 strict=True)):
        assert -1 <= parent < i
        assert (parent, tok) not in seen
        seen.add((parent, tok))
        assert 0.0 < score <= 1.0
        if parent >= 0:
            assert score <= tree.scores[parent]


def paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    keys: list[tuple[int, ...]] = []
    for tok, parent, score in zip(tree.tokens, tree.parents, tree.scores, strict=True):
        keys.append((*keys[parent], tok) if parent >= 0 else (tok,))
        out[keys[-1]] = score
    return out
