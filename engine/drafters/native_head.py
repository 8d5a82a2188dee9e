"""Drafting with a head that llama.cpp runs in its own context beside the target: an
EAGLE-3 head GGUF (``engine.drafters.eagle3``) or the target's own next-token block
(``engine.drafters.mtp``). Both read a vector per target token (the target's features,
made into the head's input), pair it with the token after it, and draft on from their
own output vectors.

The head's cache holds committed entries (built from the target's true features); a draft
adds entries built from the head's own vectors, which the next ``accept`` removes before
it appends the entries of what the target committed. The last committed entry is decoded
with its output on, so a draft starts from scores already there (one decode less per
step). A draft is a greedy chain, stopped when the next token's path probability cannot
repay a level's time, with the next likeliest first tokens beside its first.
"""

from __future__ import annotations

import contextlib
import time
from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.drafters.base import Drafter
from engine.errors import ClosedError
from engine.runtime.draft_tree import DraftTree
from engine.runtime.native import NativeContext, NativeExtBatch, prompt_kernels

if TYPE_CHECKING:
    from engine.runtime.target import Target

HEAD_BATCH = 64  # rows the head encodes or decodes per call


class NativeHandle(Protocol):
    """A llama.cpp object the drafter owns (a model, a context, a batch)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class HeadChainConfig:
    depth: int = 6  # tokens drafted at most per step
    p_min: float = 0.05  # stop before a token whose path probability is below this
    prompt_features: int = 16  # prompt tokens the head reads the features of
    # First tokens proposed: the chain's, and the next likeliest as siblings of it (from
    # the same scores, no extra level; the budget keeps those likely enough to pay).
    first_candidates: int = 3
    dynamic_depth: bool = True  # stop when the next level cannot repay its time

    def __post_init__(self) -> None:
        if self.depth < 1 or self.prompt_features < 1 or self.first_candidates < 1:
            raise ValueError("depth, prompt_features and first_candidates must be >= 1")
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError(f"p_min must be in [0, 1), got {self.p_min!r}")


def softmax_top(logits: np.ndarray, k: int, ids: np.ndarray | None = None
                ) -> list[tuple[int, float]]:
    """The ``k`` best tokens and their probabilities, best first. ``ids``: the only
    tokens the head scores (its draft vocabulary; the rest of the row is -inf), so the
    work follows the head's vocabulary, not the target's (docs/benchmarks.md: figures
    behind the code's rules, "Per-step costs")."""
    scores = logits if ids is None else logits[ids]
    if k == 1:
        top = np.array([int(scores.argmax())])
    else:
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top])]
    best = float(scores[top[0]])
    total = float(np.exp(scores - best).sum(dtype=np.float64))
    tokens = top if ids is None else ids[top]
    return [(int(t), float(np.exp(float(scores[i]) - best) / total))
            for t, i in zip(tokens, top, strict=True)]


class NativeHeadDrafter(Drafter):
    """The drafting loop over a head's llama.cpp context; subclasses open the context and
    say how the target's features become the head's entries."""

    needs_features = True
    is_draft_model = True
    # Whether the last committed entry goes through the head alone: a head whose graph
    # exports its output vector for every row, while llama.cpp's masked read returns the
    # batch's first rows (qwen35's MTP block), gives the right row only that way.
    last_entry_alone = False

    def __init__(self, target: Target, config: HeadChainConfig | None) -> None:
        # First: a subclass whose opening fails calls close(), which reads these.
        self.target: Target = target
        self.ctx: NativeContext | None = None
        self.batch: NativeExtBatch | None = None
        self.config = config or HeadChainConfig()
        self.prompt_features = self.config.prompt_features
        self._draft_ids: np.ndarray | None = None  # the head's own vocabulary, if any
        self._tokens: list[int] = []  # the context, the last token included
        self._n_cached = 0  # committed entries end before this position (head cache)
        # The last committed entry's output: the first draft tokens with their
        # probabilities, best first, and the head's vector to draft on from.
        self._seed: tuple[list[tuple[int, float]], np.ndarray] | None = None
        self._level_s = 0.0
        self._t_draft_s = 0.0
        self._n_draft_calls = 0
        self._n_levels = 0

    @property
    @abstractmethod
    def label(self) -> str:
        """What the head is, for errors ("eagle3 head x.gguf")."""

    @abstractmethod
    def _release_target(self, target: Target) -> None:
        """Give the target back its usual features."""

    @abstractmethod
    def _entries(self, first: int, features: np.ndarray) -> tuple[np.ndarray, int]:
        """The head's input vectors for the target features of the tokens at ``first``..,
        and the head-cache position of the first entry."""

    # --- the drafter lifecycle -----------------------------------------------------------
    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        if features is None:
            raise ValueError(f"the {self.name} drafter needs the target's features")
        self._context().kv_clear()
        prompt_len = len(context) - 1
        first = prompt_len - len(features)  # the first prompt token with features
        self._tokens = list(context)
        self._n_cached = 0
        self._seed = None
        # The prompt's entries through the prompt kernels: the block's outputs only draft.
        with prompt_kernels(len(features) > 1):
            self._append(first, features, context[first + 1:])

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        if features is None:
            raise ValueError(f"the {self.name} drafter needs the target's features")
        n = len(self._tokens) - 1  # position of the token whose features come first
        self._tokens += new_tokens
        self._append(n, features, list(new_tokens))

    def draft(self, max_tokens: int, token_time_s: float) -> DraftTree:
        tree = DraftTree()
        if max_tokens <= 0 or self._seed is None:
            return tree
        t0 = time.perf_counter()
        candidates, vector = self._seed
        (token, path_p), siblings = candidates[0], candidates[1:]
        ctx, cfg = self._context(), self.config
        pos = self._n_cached  # the first draft entry's position
        depth_max = min(max_tokens, cfg.depth)
        while True:
            if path_p < cfg.p_min:
                break
            tree.add(token, len(tree) - 1, path_p)
            if len(tree) >= depth_max or not self._level_pays(path_p, token_time_s):
                break
            t_level = time.perf_counter()
            batch = self._fresh_batch()
            batch.add_token(token, vector, pos, output=True)
            ctx.process(batch, encode=False)
            pos += 1
            token, p = softmax_top(ctx.logits_view(1)[0], 1, self._draft_ids)[0]
            vector = ctx.next_vectors(1)[0]
            path_p *= p
            took = time.perf_counter() - t_level
            self._level_s = took if self._level_s == 0 else 0.8 * self._level_s + 0.2 * took
            self._n_levels += 1
        for sibling, p in siblings[:max_tokens - len(tree)] if tree else ():
            if p >= cfg.p_min:
                tree.add(sibling, -1, p)
        self._t_draft_s += time.perf_counter() - t0
        self._n_draft_calls += 1
        return tree

    def pin(self) -> None:
        if self.config.dynamic_depth:
            self.config = replace(self.config, dynamic_depth=False)

    def stats(self) -> dict[str, float]:
        calls = max(1, self._n_draft_calls)
        return {"draft_ms_per_call": 1000 * self._t_draft_s / calls,
                "head_levels_per_call": self._n_levels / calls,
                "level_ms": 1000 * self._level_s}

    def set_threads(self, n_threads: int) -> None:
        if self.ctx is not None:
            self.ctx.set_n_threads(n_threads)

    def _owned(self) -> tuple[NativeHandle | None, ...]:
        """What close() frees, in order (None: not opened); a subclass adds its own."""
        return (self.batch, self.ctx)

    def close(self) -> None:
        if self.ctx is not None:
            with contextlib.suppress(ClosedError):  # a closed target needs nothing back
                self._release_target(self.target)
        for handle in self._owned():
            if handle is not None:
                handle.close()

    def drop_draft(self) -> None:
        """Drop the last draft's entries from the head's cache (``accept`` does it first)."""
        self._context().kv_remove(0, self._n_cached, -1)

    # --- the head's cache ------------------------------------------------------------------
    def _context(self) -> NativeContext:
        if self.ctx is None:
            raise ClosedError(self.label)
        return self.ctx

    def _fresh_batch(self) -> NativeExtBatch:
        assert self.batch is not None
        self.batch.clear()
        return self.batch

    def _level_pays(self, path_p: float, token_time_s: float) -> bool:
        """Whether drafting one more token can repay a level's time (dynamic depth)."""
        return not (self.config.dynamic_depth and self._level_s > 0 and token_time_s > 0
                    and path_p * token_time_s < self._level_s)

    def _append(self, first: int, features: np.ndarray, next_tokens: list[int]) -> None:
        """Drop the last draft's entries, then add the committed entries (features of the
        tokens at ``first``.., each with the token after it); the last one's output
        becomes the next draft's start."""
        ctx = self._context()
        self.drop_draft()
        features = np.asarray(features, np.float32)
        n = min(len(features), len(next_tokens))
        if n == 0:
            self._seed = None
            return
        vectors, pos0 = self._entries(first, features[:n])
        # Batches end where a batch fills, and before the last entry where it goes alone.
        stops = list(range(HEAD_BATCH, n, HEAD_BATCH))
        if self.last_entry_alone and n > 1 and n - 1 not in stops:
            stops.append(n - 1)
        start = 0
        for stop in [*sorted(stops), n]:
            batch = self._fresh_batch()
            for j in range(start, stop):
                batch.add_token(next_tokens[j], vectors[j], pos0 + j, output=j == n - 1)
            ctx.process(batch, encode=False)
            start = stop
        self._n_cached = pos0 + n
        self._seed = (softmax_top(ctx.logits_view(1)[0], self.config.first_candidates,
                                  self._draft_ids), ctx.next_vectors(1)[0])
