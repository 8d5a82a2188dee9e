"""Drafting with a small language model of the target's family, in its own llama.cpp
context (its own KV cache; on the GPU when the build offloads and it fits).

Each step the draft model catches up on what the target committed, then drafts greedily:
a chain that stops when its next token is less likely than ``p_min`` (llama.cpp's
``--draft-p-min``: a chain of unlikely tokens costs verification and is rejected anyway).
DuoDecoding's dynamic multi-sequence drafting adds sequences from the first position's
other candidates: with ``theta = p(1,1) * p(2,1)`` (the chain's first two tokens' joint
probability), every first-position candidate more likely than ``theta`` starts its own
greedy sequence, drafted in the same batches as one KV sequence each. The sequences hang
off the root as one tree, verified at once; each node's score is its path's probability,
which the budget trims by.

The draft's KV cache keeps what the target accepted: the main chain's evaluated tokens
stay where the target agreed, the rest is removed, and the next step evaluates only what
is missing (the target's own token, or an accepted side sequence).

With ``draft_ahead`` (the target on a GPU, the draft model on the CPU: DuoDecoding's
layout) the draft model works while the target verifies: it guesses that the target
takes the whole main chain and adds the draft's own next token, and drafts the next
chain from there. When the target's new tokens are exactly that guess the next step's
draft is ready at once; otherwise it is dropped and the cache falls back to what was
committed. Either way the target verifies every token, so the output cannot change."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.drafters.base import Drafter
from engine.drafters.kinds import DrafterKind
from engine.runtime.draft_tree import DraftTree
from engine.runtime.native import NativeBatch, NativeContext, NativeModel, prompt_kernels
from engine.runtime.sequences import common_prefix_length

PREFILL_BATCH = 256  # tokens the draft model evaluates per decode when catching up
MAX_STEP_TOKENS = 32  # more than a step commits: a prompt


@dataclass(frozen=True)
class DraftModelConfig:
    p_min: float = 0.5  # stop a sequence before a token less likely than this
    max_depth: int = 8  # tokens per sequence at most
    max_sequences: int = 3  # the main chain plus side sequences (1: chain drafting)
    draft_ahead: bool = False  # draft the next chain while the target verifies

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError(f"p_min must be in [0, 1), got {self.p_min!r}")
        if self.max_depth < 1 or self.max_sequences < 1:
            raise ValueError("max_depth and max_sequences must be >= 1")


@dataclass
class _Ahead:
    expected: list[int]  # the new tokens the target must commit for ``tree`` to be used
    tree: DraftTree


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(), dtype=np.float64)
    return z / z.sum()


class DraftModelDrafter(Drafter):
    name = kind = DrafterKind.DRAFT
    is_draft_model = True

    def __init__(self, path: Path, n_ctx: int, n_threads: int,
                 config: DraftModelConfig | None = None, n_gpu_layers: int = 0) -> None:
        """Raises ModelLoadError when the GGUF cannot load or its context cannot be made."""
        self.config = config or DraftModelConfig()
        self.path = Path(path)
        self.model = NativeModel(self.path, n_gpu_layers=n_gpu_layers)
        try:
            # Sequence 0 holds the committed context; drafts are evaluated there and
            # taken back after the verification. Recurrent state cannot be taken back
            # across decodes (llama.cpp's snapshots cover the tokens of the last batch,
            # and its seq_rm says true even past them): a hybrid draft model drafts its
            # chain in a copy of sequence 0 (sequence 1) and leaves sequence 0 as
            # committed, chains only and no drafting ahead.
            self._draft_seq = 1 if self.model.architecture().has_state else 0
            if self._draft_seq:
                self.config = DraftModelConfig(p_min=self.config.p_min,
                                               max_depth=self.config.max_depth,
                                               max_sequences=1, draft_ahead=False)
            n_seqs = max(self.config.max_sequences, 1 + self._draft_seq)
            # F16 K and V: the draft need not match any batch size bit for bit.
            self.ctx = NativeContext(self.model, n_ctx=n_ctx, n_batch=PREFILL_BATCH,
                                     n_seq_max=n_seqs, n_threads=n_threads,
                                     features=False, type_k="f16", type_v="f16")
        except BaseException:
            self.model.close()
            raise
        self.drafts_ahead = self.config.draft_ahead
        self.batch = NativeBatch(PREFILL_BATCH, n_seqs)
        self.context: list[int] = []  # what the target committed
        self.cached: list[int] = []  # tokens in sequence 0 of the KV cache, by position
        self._n_draft_calls = 0
        self._n_evals = 0
        self._n_side_sequences = 0
        self._n_served_ahead = 0
        self._t_draft_s = 0.0
        self._ahead: _Ahead | None = None  # made during the running verification
        self._ready: DraftTree | None = None  # the next draft, when the guess held

    # --- the drafter lifecycle -----------------------------------------------------------
    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        self.context = list(context)
        self._ahead = self._ready = None
        self._sync()

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        ahead, self._ahead = self._ahead, None
        self.context += new_tokens
        if ahead is not None and new_tokens == ahead.expected:
            # The cache already holds the new tokens and the ready chain's.
            self._ready = ahead.tree
            self._drop_side_sequences()
            return
        self._ready = None
        self._sync()

    def draft(self, max_tokens: int, token_time_s: float) -> DraftTree:
        tree = DraftTree()
        if self._ready is not None and max_tokens > 0:
            tree, self._ready = self._ready.truncated(max_tokens), None
            tree.made_ahead = True
            self._n_served_ahead += 1
            return tree
        if max_tokens <= 0:
            return tree
        t0 = time.perf_counter()
        probs = _softmax(self._catch_up())
        cfg = self.config
        # The first position's best candidates, in order (a partition, not a full sort:
        # this runs every step).
        top = np.argpartition(-probs, cfg.max_sequences - 1)[:cfg.max_sequences]
        ranked = top[np.argsort(-probs[top])]
        main_first = int(ranked[0])
        if probs[main_first] < cfg.p_min:
            self._account(t0)
            return tree
        if self._draft_seq:  # a fresh copy of the committed state to draft in
            self.ctx.kv_remove(self._draft_seq, 0)
            self.ctx.kv_copy(0, self._draft_seq)
        second = self._draft_main(tree, probs, max_tokens)
        if cfg.max_sequences > 1 and second is not None and len(tree) < max_tokens:
            theta = float(probs[main_first]) * second
            starts = [(int(t), float(probs[t])) for t in ranked[1:] if probs[t] > theta]
            if starts:
                self._draft_sides(tree, starts, max_tokens)
        self._account(t0)
        return tree

    def draft_ahead(self, verifying: DraftTree, max_tokens: int, token_time_s: float) -> None:
        """While the target verifies: guess it takes ``verifying``'s main chain and adds
        the draft's own next token, and draft the chain after that (sequence 0 only)."""
        self._ahead = None
        chain = _main_chain(verifying)
        if not chain or max_tokens <= 0:
            return
        t0 = time.perf_counter()
        guessed = self.context + chain
        # One token is evaluated now: its scores.
        keep = min(common_prefix_length(self.cached, guessed), len(guessed) - 1)
        if keep < len(self.cached):
            self.ctx.kv_remove(0, keep)
            del self.cached[keep:]
        probs = _softmax(self._eval(guessed[keep:], keep, 0)[-1])
        self.cached = list(guessed)
        bonus = int(np.argmax(probs))
        probs = _softmax(self._eval([bonus], len(self.cached), 0)[-1])
        self.cached.append(bonus)
        tree = DraftTree()
        self._draft_main(tree, probs, max_tokens)
        self._account(t0)
        if len(tree):
            self._ahead = _Ahead(chain + [bonus], tree)

    def stats(self) -> dict[str, float]:
        calls = max(1, self._n_draft_calls)
        return {"draft_ms_per_call": 1000 * self._t_draft_s / calls,
                "draft_evals_per_call": self._n_evals / calls,
                "side_sequences_per_call": self._n_side_sequences / calls,
                "served_ahead": float(self._n_served_ahead)}

    def set_threads(self, n_threads: int) -> None:
        self.ctx.set_n_threads(n_threads)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()

    # --- drafting ------------------------------------------------------------------------
    def _draft_main(self, tree: DraftTree, probs: np.ndarray, max_tokens: int
                    ) -> float | None:
        """The greedy chain in sequence 0; returns p(2,1), the probability of its second
        token (None when it stopped before a second token was scored)."""
        cfg, parent, path_p, second = self.config, -1, 1.0, None
        while True:
            token = int(np.argmax(probs))
            p = float(probs[token])
            if parent >= 0 and second is None:
                second = p
            if p < cfg.p_min:
                break
            path_p *= p
            parent = tree.add(token, parent, path_p)
            if len(tree) >= min(cfg.max_depth, max_tokens):
                break
            # Evaluate the drafted token in sequence 0 (kept if the target agrees), or
            # in the copy a hybrid drafts in (sequence 0 stays as committed).
            pos = len(self.cached) + len(tree) - 1 if self._draft_seq else len(self.cached)
            probs = _softmax(self._eval([token], pos, self._draft_seq)[-1])
            if not self._draft_seq:
                self.cached.append(token)
        return second

    def _draft_sides(self, tree: DraftTree, starts: list[tuple[int, float]],
                     max_tokens: int) -> None:
        """Side sequences from the first position's other candidates, one KV sequence
        each, all advanced in one batch per depth."""
        n_ctx_tokens = len(self.context)
        live = []  # (sequence id, last node, its path probability)
        for seq, (token, p) in enumerate(starts, start=1):
            if len(tree) >= max_tokens:
                break
            self.ctx.kv_remove(seq, 0)
            self.ctx.kv_copy(0, seq, 0, n_ctx_tokens)
            live.append((seq, tree.add(token, -1, p), p))
        self._n_side_sequences += len(live)
        depth = 1
        while live and depth < self.config.max_depth and len(tree) < max_tokens:
            tokens = [tree.tokens[node] for _, node, _ in live]
            self.batch.fill(tokens, [n_ctx_tokens + depth - 1] * len(live),
                            [(seq,) for seq, _, _ in live], True)
            self.ctx.decode(self.batch)
            self._n_evals += 1
            logits = self.ctx.logits(len(live))
            grown = []
            for row, (seq, node, path_p) in enumerate(live):
                probs = _softmax(logits[row])
                token = int(np.argmax(probs))
                if probs[token] < self.config.p_min or len(tree) >= max_tokens:
                    continue
                p = path_p * float(probs[token])
                grown.append((seq, tree.add(token, node, p), p))
            live, depth = grown, depth + 1

    # --- the draft's KV cache ------------------------------------------------------------
    def _sync(self) -> None:
        """Keep in sequence 0 the longest prefix of the context it already holds (at
        least one token stays unevaluated: its scores start the next draft), and drop
        the side sequences."""
        keep = min(common_prefix_length(self.cached, self.context), len(self.context) - 1)
        if keep < len(self.cached):
            if not self.ctx.kv_remove(0, keep):
                # Recurrent state past its snapshots: the context is evaluated again.
                self.ctx.kv_remove(0, 0)
                keep = 0
            del self.cached[keep:]
        self._drop_side_sequences()

    def _drop_side_sequences(self) -> None:
        for seq in range(1, self.config.max_sequences):
            self.ctx.kv_remove(seq, 0)

    def _catch_up(self) -> np.ndarray:
        """Evaluate the committed tokens the cache lacks; the scores after the last."""
        pending = self.context[len(self.cached):]
        # A prompt goes through the prompt kernels (these logits only draft); a step's
        # few tokens do not, so a verification on another thread never waits for them.
        with prompt_kernels(len(pending) > MAX_STEP_TOKENS):
            logits = self._eval(pending, len(self.cached), 0)[-1]
        self.cached = list(self.context)
        return logits

    def _eval(self, tokens: list[int], start: int, seq: int) -> np.ndarray:
        """Decode ``tokens`` at positions from ``start`` in sequence ``seq``, in chunks;
        the logits of the last chunk's last token, shape [1, n_vocab]."""
        for i in range(0, len(tokens), PREFILL_BATCH):
            chunk = tokens[i:i + PREFILL_BATCH]
            last = i + len(chunk) == len(tokens)
            self.batch.fill(chunk, list(range(start + i, start + i + len(chunk))),
                            [(seq,)] * len(chunk), [False] * (len(chunk) - 1) + [last])
            self.ctx.decode(self.batch)
            self._n_evals += 1
        return self.ctx.logits(1)

    def _account(self, t0: float) -> None:
        self._n_draft_calls += 1
        self._t_draft_s += time.perf_counter() - t0


def _main_chain(tree: DraftTree) -> list[int]:
    """The tokens of the chain through each node's first child (the draft model's
    greedy chain: it is drafted first, so its nodes come first)."""
    tokens: list[int] = []
    parent = -1
    for i, p in enumerate(tree.parents):
        if p == parent:
            tokens.append(tree.tokens[i])
            parent = i
    return tokens
