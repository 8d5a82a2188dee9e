"""Prompt lookup: propose what followed the last n tokens the previous times they occurred.

Needs no weights. Pays off where the answer copies its context (summaries, RAG,
extraction, edits of earlier text). Several earlier occurrences that continue
differently become sibling branches of a small tree.

Each proposed node carries an estimate of its chance of being accepted, learnt online
from how the target treated earlier drafts with the same n-gram length, depth and
branch rank; the budget (``engine.decoding.budget``) then verifies only the nodes that pay for
their verification time. Learnt rates survive across generations of one drafter.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from engine.drafters.base import Drafter
from engine.drafters.kinds import DrafterKind
from engine.runtime.draft_tree import DraftTree

NodeKey = tuple[int, int, bool]  # (n-gram length, depth, first branch)


@dataclass(frozen=True)
class LookupConfig:
    min_ngram: int = 2
    max_ngram: int = 6
    max_depth: int = 8  # longest continuation proposed
    max_branches: int = 3  # distinct continuations merged into a tree (1 = chain)
    max_matches: int = 8  # earlier occurrences looked at, most recent first
    prior_rate: float = 0.3  # acceptance assumed before any evidence
    prior_weight: float = 3.0  # how many observations the prior is worth


class AcceptanceRates:
    """P(node accepted | parent accepted), by node key, with a Beta-style prior."""

    def __init__(self, prior_rate: float, prior_weight: float) -> None:
        self.prior_rate = prior_rate
        self.prior_weight = prior_weight
        self.counts: dict[NodeKey, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def rate(self, key: NodeKey) -> float:
        acc, tot = self.counts[key]
        return (acc + self.prior_for(key) * self.prior_weight) / (tot + self.prior_weight)

    def prior_for(self, key: NodeKey) -> float:
        """The rate assumed for ``key`` before any evidence."""
        return self.prior_rate

    def update(self, key: NodeKey, accepted: bool) -> None:
        c = self.counts[key]
        c[0] += accepted
        c[1] += 1


class LocalCalibration:
    """How this conversation's drafts fare against the global rates: recent successes
    over recent predicted successes (exponentially forgotten), so a text that copies
    less than usual (role play) drafts less, and one that copies more drafts more."""

    def __init__(self, decay: float = 0.9, strength: float = 2.0) -> None:
        self.decay = decay
        self.strength = strength  # pseudo-observations pulling the factor towards 1
        self.hits = 0.0
        self.expected = 0.0

    def reset(self) -> None:
        self.hits = self.expected = 0.0

    def update(self, predicted: float, accepted: bool) -> None:
        self.hits = self.decay * self.hits + accepted
        self.expected = self.decay * self.expected + predicted

    @property
    def factor(self) -> float:
        f = (self.hits + self.strength) / (self.expected + self.strength)
        return min(max(f, 0.25), 2.0)


class PromptLookupDrafter(Drafter):
    name = kind = DrafterKind.LOOKUP

    def __init__(self, config: LookupConfig | None = None) -> None:
        self.config = config or LookupConfig()
        self.rates = AcceptanceRates(self.config.prior_rate, self.config.prior_weight)
        self.local = LocalCalibration()
        self.context: list[int] = []
        # n -> n-gram -> positions right after each of its occurrences
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self._keys: dict[tuple[int, ...], NodeKey] = {}  # token path -> key, last draft
        self.n_drafts = 0
        self.n_empty = 0

    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        cfg = self.config
        self._index = {n: defaultdict(list) for n in range(cfg.min_ngram, cfg.max_ngram + 1)}
        self.context = []
        self._keys = {}
        self.local.reset()
        self._extend(context)

    def _extend(self, tokens: list[int]) -> None:
        ctx = self.context
        for tok in tokens:
            ctx.append(tok)
            end = len(ctx)
            for n, table in self._index.items():
                if end >= n:
                    table[tuple(ctx[end - n:end])].append(end)

    def draft(self, max_tokens: int, token_time_s: float = 0.0) -> DraftTree:
        cfg = self.config
        ctx = self.context
        end = len(ctx)
        tree = DraftTree()
        self._keys = {}
        for n in range(min(cfg.max_ngram, end - 1), cfg.min_ngram - 1, -1):
            starts = self._index[n].get(tuple(ctx[end - n:end]))
            if not starts:
                continue
            n_branches = 0
            for start in reversed(starts[-cfg.max_matches - 1:]):
                if start >= end:  # the suffix itself
                    continue
                cont = ctx[start:start + cfg.max_depth]
                if cont and self._insert(tree, cont, n, n_branches == 0, max_tokens):
                    n_branches += 1
                if n_branches >= cfg.max_branches or len(tree) >= max_tokens:
                    break
            if len(tree):
                break
        self.n_drafts += 1
        self.n_empty += not len(tree)
        return tree

    def _insert(self, tree: DraftTree, continuation: list[int], n: int, first: bool,
                max_tokens: int) -> bool:
        """Merge a continuation into the tree; True when it added a node."""
        node, score, path = -1, 1.0, ()
        added = False
        for depth, tok in enumerate(continuation, start=1):
            path = (*path, tok)
            child = tree.child_with_token(node, tok)
            if child is None:
                if len(tree) >= max_tokens:
                    break
                key = (n, depth, first)
                score *= min(1.0, self.rates.rate(key) * self.local.factor)
                child = tree.add(tok, node, score)
                self._keys[path] = key
                added = True
            else:
                score = tree.scores[child]
            node = child
        return added

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        """Learn from the last draft. ``new_tokens`` is the target's own path (accepted
        drafts, then its next token), so every proposed node whose parent lies on it is
        a success or a failure, verified or trimmed by the budget alike."""
        for path, key in self._keys.items():
            depth = len(path)
            if depth <= len(new_tokens) and tuple(new_tokens[:depth - 1]) == path[:-1]:
                hit = new_tokens[depth - 1] == path[-1]
                self.local.update(self.rates.rate(key), hit)
                self.rates.update(key, hit)
        self._keys = {}
        self._extend(new_tokens)

    def stats(self) -> dict[str, float]:
        return {"drafts": self.n_drafts, "empty_drafts": self.n_empty}
