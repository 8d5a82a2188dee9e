"""Drafts from a text the answer is expected to repeat: OpenAI's Predicted Outputs.

A client editing a file sends the file as ``prediction``; most of the answer is that file
again, with a few lines changed. This drafter keeps the prediction's tokens and, at each
step, finds where the answer's last tokens occur in it (the longest match, the one nearest
after where the answer last followed it), and proposes what follows there: a long chain
through the unchanged lines. After a changed line the answer drifts off, and drafts
resume as soon as its last few tokens are found in the prediction again.

It drafts beside the engine's own drafter (``base``, which may be None): the two trees
merge (``engine.drafters.merged.merge_trees``) and the budget keeps the nodes worth their
verification, so a prediction that is wrong costs little. Scores are acceptance
probabilities learnt online per (match length, depth), starting high: a prediction is
usually right. Output never depends on any of it: the target decides every token.

``accepted``/``rejected`` count the prediction's tokens the target verified and kept or
turned down (OpenAI's ``accepted_prediction_tokens`` and ``rejected_prediction_tokens``).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from engine.drafters.base import Drafter
from engine.drafters.lookup import AcceptanceRates, LocalCalibration
from engine.drafters.merged import merge_trees
from engine.runtime.draft_tree import DraftTree

RateKey = tuple[int, int]  # (match-length bucket, depth bucket)
_MATCH_TOPS = (3, 5, 8, 16)  # match lengths 3, 4-5, 6-8, 9-16, 17+
_DEPTH_TOPS = (1, 2, 4, 8, 16)  # depths 1, 2, 3-4, 5-8, 9-16, 17+


def _bucket(value: int, tops: tuple[int, ...]) -> int:
    return bisect.bisect_left(tops, value)


@dataclass(frozen=True)
class PredictionConfig:
    min_match: int = 3  # answer tokens that must match the prediction to draft from there
    max_match: int = 24  # a longer match is as sure as this one
    max_candidates: int = 64  # occurrences of the anchor looked at, nearest the cursor first
    first_prior: float = 0.6  # P(first token follows) assumed before any evidence
    deep_prior: float = 0.93  # P(next follows | the one before did): unchanged lines go on
    prior_weight: float = 4.0


class _PredictionRates(AcceptanceRates):
    """Acceptance by (match bucket, depth bucket); deeper levels start from a higher prior."""

    def __init__(self, config: PredictionConfig) -> None:
        super().__init__(config.first_prior, config.prior_weight)
        self.deep_prior = config.deep_prior

    def prior_for(self, key: RateKey) -> float:  # type: ignore[override]
        return self.prior_rate if key[1] == 0 else self.deep_prior


class PredictionSource:
    """The prediction's tokens and where the answer last followed them."""

    def __init__(self, tokens: list[int], config: PredictionConfig) -> None:
        self.tokens = list(tokens)
        self.config = config
        n = config.min_match
        self._starts: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i in range(len(self.tokens) - n + 1):
            self._starts[tuple(self.tokens[i:i + n])].append(i + n)  # sorted: i grows
        self.cursor = 0  # the prediction position right after the answer's last match

    def find(self, context: list[int], n_answer: int | None = None
             ) -> tuple[int, int] | None:
        """(position in the prediction that follows the context's tail, match length), or
        None: while the answer (its last ``n_answer`` tokens) is a start of the prediction,
        what follows that start; else the longest match of the tail, ties to the one
        nearest at or after the cursor (a repeated line resolves to the next in the
        file)."""
        cfg = self.config
        if n_answer is not None and n_answer < len(self.tokens) and (
                self.tokens[:n_answer] == context[len(context) - n_answer:]):
            return n_answer, cfg.max_match  # an answer that starts as predicted goes on
        n = cfg.min_match
        if len(context) < n:
            return None
        ends = self._starts.get(tuple(context[-n:]))
        if not ends:
            return None
        at = bisect.bisect_left(ends, self.cursor)
        # Nearest first: after the cursor, then before it.
        order = ends[at:at + cfg.max_candidates] + ends[max(0, at - cfg.max_candidates):at][::-1]
        best: tuple[int, int, int] | None = None  # (length, -distance rank, end)
        for rank, end in enumerate(order):
            if end >= len(self.tokens):
                continue  # nothing follows it
            length = n
            while (length < cfg.max_match and length < end and length < len(context)
                   and self.tokens[end - length - 1] == context[-length - 1]):
                length += 1
            if best is None or (length, -rank) > (best[0], best[1]):
                best = (length, -rank, end)
        if best is None:
            return None
        return best[2], best[0]


class PredictionDrafter(Drafter):
    """``base`` (the engine's drafter, or None) drafting together with a prediction."""

    def __init__(self, prediction: list[int], base: Drafter | None,
                 config: PredictionConfig | None = None) -> None:
        self.config = config or PredictionConfig()
        self.source = PredictionSource(prediction, self.config)
        self.base = base
        self.kind = base.kind if base is not None else None
        self.name = f"{base.name}+prediction" if base is not None else "prediction"
        self.needs_features = base.needs_features if base is not None else False
        self.prompt_features = base.prompt_features if base is not None else None
        self.is_draft_model = base.is_draft_model if base is not None else False
        self.load_notes = list(base.load_notes) if base is not None else []
        self.rates = _PredictionRates(self.config)
        self.local = LocalCalibration()
        self.context: list[int] = []
        self.n_prompt = 0  # context tokens before the answer
        self._keys: dict[tuple[int, ...], RateKey] = {}  # path -> key, last draft
        self._verified: list[tuple[int, ...]] = []  # prediction paths in the last batch
        # Where the context's tail is in the prediction (found once per step, in begin or
        # accept: the next draft and the cursor read it)
        self._found: tuple[int, int] | None = None
        self.accepted = 0
        self.rejected = 0

    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        self.context = list(context)
        self.n_prompt = len(context) - 1  # the context ends with the answer's first token
        self.source.cursor = 0
        self.local.reset()
        self._found = self.source.find(self.context, len(self.context) - self.n_prompt)
        if self.base is not None:
            self.base.begin(context, features)

    def draft(self, max_tokens: int, token_time_s: float) -> DraftTree:
        own = self._draft_own(max_tokens)
        if self.base is None:
            return own
        theirs = self.base.draft(max_tokens, token_time_s)
        return merge_trees([t for t in (own, theirs) if len(t)], max_tokens)

    def _draft_own(self, max_tokens: int) -> DraftTree:
        self._keys = {}
        tree = DraftTree()
        found = self._found
        if found is None:
            return tree
        end, length = found
        m = _bucket(length, _MATCH_TOPS)
        score, node, path = 1.0, -1, ()
        for depth, tok in enumerate(self.source.tokens[end:end + max_tokens], start=1):
            key = (m, _bucket(depth, _DEPTH_TOPS))
            rate = self.rates.rate(key)
            if depth <= 2:  # this conversation's luck scales the first levels only
                rate *= self.local.factor
            score *= min(1.0, rate)
            path = (*path, tok)
            node = tree.add(tok, node, score)
            self._keys[path] = key
        return tree

    def verifying(self, tree: DraftTree) -> None:
        self._verified = [p for p in _paths(tree) if p in self._keys]
        if self.base is not None:
            self.base.verifying(tree)

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        kept = tuple(new_tokens[:-1])  # the accepted drafts (the last is the target's own)
        for path in self._verified:
            if kept[:len(path)] == path:
                self.accepted += 1
            else:
                self.rejected += 1
        self._verified = []
        for path, key in self._keys.items():
            depth = len(path)
            if depth <= len(new_tokens) and tuple(new_tokens[:depth - 1]) == path[:-1]:
                hit = new_tokens[depth - 1] == path[-1]
                if depth <= 2:
                    self.local.update(self.rates.rate(key), hit)
                self.rates.update(key, hit)
        self._keys = {}
        self.context.extend(new_tokens)
        self._found = self.source.find(self.context, len(self.context) - self.n_prompt)
        if self._found is not None:
            self.source.cursor = self._found[0]
        if self.base is not None:
            self.base.accept(new_tokens, features)

    def finish(self, tokens: list[int]) -> None:
        if self.base is not None:
            self.base.finish(tokens)

    def pin(self) -> None:
        if self.base is not None:
            self.base.pin()

    def set_threads(self, n_threads: int) -> None:
        if self.base is not None:
            self.base.set_threads(n_threads)

    def stats(self) -> dict[str, float]:
        own = {"prediction_accepted": self.accepted, "prediction_rejected": self.rejected}
        return {**(self.base.stats() if self.base is not None else {}), **own}

    def close(self) -> None:
        """The base drafter is the engine's: it stays open."""


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        paths.append((*paths[parent], token) if parent >= 0 else (token,))
    return paths
