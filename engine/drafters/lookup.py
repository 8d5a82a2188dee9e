"""Prompt lookup: propose what followed the last n tokens the previous times they occurred.

Needs no weights. Pays off where the answer copies its context (summaries, RAG,
extraction, edits of earlier text). Several earlier occurrences that continue
differently become sibling branches of a small tree.

Verification is not free on a CPU target (a batch of 4 costs 1.4x-2x a single token),
so the drafter adapts its length to how much of its recent drafts the target accepted,
and stays quiet when only short n-grams match.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from engine.draft_tree import DraftTree
from engine.drafters.base import Drafter


@dataclass(frozen=True)
class LookupConfig:
    min_ngram: int = 2
    max_ngram: int = 5
    max_depth: int = 8  # longest continuation proposed
    max_branches: int = 3  # distinct continuations merged into a tree (1 = chain)
    max_matches: int = 8  # earlier occurrences looked at, most recent first
    adaptive: bool = True


class PromptLookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, config: LookupConfig | None = None) -> None:
        self.config = config or LookupConfig()
        self.context: list[int] = []
        # n -> n-gram -> positions right after each of its occurrences
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self._expected = float(self.config.max_depth)  # running estimate of accepted length
        self._last_depth = 0
        self.n_drafts = 0
        self.n_empty = 0

    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        cfg = self.config
        self._index = {n: defaultdict(list) for n in range(cfg.min_ngram, cfg.max_ngram + 1)}
        self.context = []
        self._extend(context)
        self._expected = float(cfg.max_depth)
        self._last_depth = 0

    def _extend(self, tokens: list[int]) -> None:
        ctx = self.context
        for tok in tokens:
            ctx.append(tok)
            end = len(ctx)
            for n, table in self._index.items():
                if end >= n:
                    table[tuple(ctx[end - n:end])].append(end)

    def _depth_budget(self, max_tokens: int) -> int:
        if not self.config.adaptive:
            return min(self.config.max_depth, max_tokens)
        # Propose a little more than recently accepted, so the length can grow back.
        return max(1, min(self.config.max_depth, max_tokens, int(self._expected + 1.5)))

    def draft(self, max_tokens: int) -> DraftTree:
        cfg = self.config
        ctx = self.context
        end = len(ctx)
        tree = DraftTree()
        depth = self._depth_budget(max_tokens)
        for n in range(min(cfg.max_ngram, end - 1), cfg.min_ngram - 1, -1):
            starts = self._index[n].get(tuple(ctx[end - n:end]))
            if not starts:
                continue
            n_branches = 0
            for start in reversed(starts[-cfg.max_matches - 1:]):
                if start >= end:  # the suffix itself
                    continue
                cont = ctx[start:start + depth]
                if not cont:
                    continue
                if self._insert(tree, cont, max_tokens):
                    n_branches += 1
                if n_branches >= cfg.max_branches or len(tree) >= max_tokens:
                    break
            if len(tree):
                break
        self.n_drafts += 1
        self.n_empty += not len(tree)
        self._last_depth = max(tree.depths(), default=0)
        return tree

    @staticmethod
    def _insert(tree: DraftTree, continuation: list[int], max_tokens: int) -> bool:
        """Merge a continuation into the tree; True when it added a node."""
        node = -1
        added = False
        for tok in continuation:
            child = tree.child_with_token(node, tok)
            if child is None:
                if len(tree) >= max_tokens:
                    break
                child = tree.add(tok, node)
                added = True
            node = child
        return added

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        if self._last_depth:
            n_accepted = len(new_tokens) - 1
            self._expected = 0.5 * self._expected + 0.5 * n_accepted
            self._last_depth = 0
        self._extend(new_tokens)

    def stats(self) -> dict[str, float]:
        return {"drafts": self.n_drafts, "empty_drafts": self.n_empty,
                "expected_accept": self._expected}
