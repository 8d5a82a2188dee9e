"""A draft head and drafts from memory as one drafter.

The two are good at different text: memory proposes long continuations where the answer
repeats the prompt, itself or an earlier answer (code edits, extraction, translation of
a repeated phrase), the head short guesses everywhere else. Each drafts its own tree and
learns from the target's tokens as it would alone; the union of the two trees (a path
both propose keeps the higher score) goes to the budget, which keeps the nodes worth
their verification. Lossless as each part is: ``draft`` depends only on the context.
"""

from __future__ import annotations

import numpy as np

from engine.drafters.base import Drafter
from engine.drafters.kinds import DrafterKind
from engine.runtime.draft_tree import DraftTree


def merge_trees(trees: list[DraftTree], max_tokens: int) -> DraftTree:
    """The ``max_tokens`` best-scored paths of the union of ``trees``. Within each tree a
    child never scores above its parent, so neither does the maximum over trees, and
    ranking by (score desc, depth) puts every parent before its children."""
    best: dict[tuple[int, ...], float] = {}
    for tree in trees:
        paths: list[tuple[int, ...]] = []
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
            path = (*paths[parent], token) if parent >= 0 else (token,)
            paths.append(path)
            score = tree.scores[i] if tree.scores else 0.0
            best[path] = max(score, best.get(path, score))
    ranked = sorted(best.items(), key=lambda kv: (-kv[1], len(kv[0])))
    merged = DraftTree()
    index: dict[tuple[int, ...], int] = {}
    for path, score in ranked[:max(0, max_tokens)]:
        parent = index.get(path[:-1], -1) if len(path) > 1 else -1
        if len(path) > 1 and parent < 0:
            continue  # a tie broken against its parent: never emit an orphan
        index[path] = merged.add(path[-1], parent, score)
    return merged


class MergedDrafter(Drafter):
    """``head`` (a drafter that reads features) and ``memory`` drafting together."""

    kind = DrafterKind.HEAD_MEMORY
    is_draft_model = True
    drafts_ahead = False  # a draft ahead would be the head's alone

    def __init__(self, head: Drafter, memory: Drafter) -> None:
        self.head, self.memory = head, memory
        self.name = f"{head.name}+{memory.name}"
        self.needs_features = head.needs_features
        self.prompt_features = head.prompt_features
        self.load_notes = list(head.load_notes)

    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        self.head.begin(context, features)
        self.memory.begin(context, None)

    def draft(self, max_tokens: int, token_time_s: float) -> DraftTree:
        trees = [self.memory.draft(max_tokens, token_time_s),
                 self.head.draft(max_tokens, token_time_s)]
        return merge_trees([t for t in trees if len(t)], max_tokens)

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        self.head.accept(new_tokens, features)
        self.memory.accept(new_tokens, None)

    def finish(self, tokens: list[int]) -> None:
        self.head.finish(tokens)
        self.memory.finish(tokens)

    def stats(self) -> dict[str, float]:
        return {**self.memory.stats(), **self.head.stats()}

    def close(self) -> None:
        self.head.close()
        self.memory.close()
