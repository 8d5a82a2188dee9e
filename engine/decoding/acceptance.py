"""Which drafted tokens the target keeps. Pure functions on logits, unit-tested alone.

Nodes use verification numbering: 0 is the root (the last token), node i+1 is draft
node i. ``logits[k]`` is the target's prediction for the token after node k.

Lossless by construction:
- greedy: walk down while the target's argmax is a child; the first mismatch is
  replaced by the target's own token, so output equals plain greedy decoding;
- sampling: drafts are proposed deterministically (a function of the context alone).
  The generation loop uses ``accept_coupled``: the target's token at each position is
  drawn from its distribution with that position's own uniform (the one plain sampling
  uses there), and the walk goes on while a child carries it. Every token is then
  exactly a draw from the target, and the answer is the one plain sampling gives for the
  same seed. A child is accepted with the target's probability of its token, the rate
  of recursive rejection over siblings (``accept_sampling``, kept as the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.decoding.sampling import SamplingParams, sample, sample_at, target_distribution


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted nodes, verification numbering, starting with the root 0
    next_token: int  # the target's own token after the last accepted node


def accept_greedy(children: list[list[int]], node_tokens: list[int],
                  logits_of: Callable[[int], np.ndarray]) -> Acceptance:
    """Follow the target's argmax down the tree (``logits_of(node)``: the logits after
    ``node``)."""
    path = [0]
    node = 0
    while True:
        best = int(np.argmax(logits_of(node)))
        nxt = next((c for c in children[node] if node_tokens[c] == best), None)
        if nxt is None:
            return Acceptance(path, best)
        path.append(nxt)
        node = nxt


def accept_one_level(probs: np.ndarray, candidates: list[int], rng: np.random.Generator
                     ) -> tuple[int | None, np.ndarray]:
    """Recursive rejection over deterministic candidates at one node.

    Returns (index into candidates of the accepted one or None, the residual
    distribution after the rejections). ``probs`` is not modified.
    """
    residual = probs
    for j, tok in enumerate(candidates):
        p_tok = residual[tok]
        if p_tok > 0.0 and rng.random() < p_tok:
            return j, residual
        if p_tok > 0.0:
            residual = residual.copy() if residual is probs else residual
            residual[tok] = 0.0
            residual /= residual.sum()
    return None, residual


def accept_sampling(children: list[list[int]], node_tokens: list[int],
                    probs_of: Callable[[int], np.ndarray], rng: np.random.Generator
                    ) -> Acceptance:
    """Rejection sampling down the tree, keeping the target distribution exactly.

    ``probs_of(node)`` is the target's distribution after ``node``.
    """
    path = [0]
    node = 0
    while True:
        probs = probs_of(node)
        kids = children[node]
        if not kids:
            return Acceptance(path, sample(probs, rng))
        j, residual = accept_one_level(probs, [node_tokens[c] for c in kids], rng)
        if j is None:
            return Acceptance(path, sample(residual, rng))
        node = kids[j]
        path.append(node)


def accept_coupled(children: list[list[int]], node_tokens: list[int],
                   probs_of: Callable[[int], np.ndarray], uniform_at: Callable[[int], float]
                   ) -> Acceptance:
    """Walk down while a child carries the target's own draw at that depth;
    ``uniform_at(depth)`` is the uniform of the position after a node at ``depth``."""
    path = [0]
    node = 0
    while True:
        tok = sample_at(probs_of(node), uniform_at(len(path) - 1))
        nxt = next((c for c in children[node] if node_tokens[c] == tok), None)
        if nxt is None:
            return Acceptance(path, tok)
        path.append(nxt)
        node = nxt


def accept(children: list[list[int]], node_tokens: list[int],
           logits_of: Callable[[int], np.ndarray], params: SamplingParams,
           uniform_at: Callable[[int], float]) -> Acceptance:
    """The accepted path and the target's next token. ``logits_of(node)`` is the
    target's prediction after ``node`` with that position's penalties applied;
    ``uniform_at(depth)`` gives the uniform of the position after a node at that depth
    (sampling only)."""
    if params.greedy:
        return accept_greedy(children, node_tokens, logits_of)
    return accept_coupled(children, node_tokens,
                          lambda node: target_distribution(logits_of(node), params), uniform_at)
