"""How much to draft: as many nodes as maximise expected tokens per second.

A CPU target does not verify for free (here a batch of 4 costs ~1.8x one token, 8
costs ~3x), so each cycle keeps the draft nodes whose estimated acceptance pays for the
extra verification time (EAGLE-2's rule: a cycle yields 1 + the sum of the kept nodes'
path probabilities; divide by the measured cost of verifying them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.draft_tree import DraftTree


@dataclass
class VerifyCostModel:
    """Verification time by batch size, learnt from the decodes the loop makes.

    Until a size has been seen, its cost is the prior ``t1 * (1 + slope * (n - 1))``;
    measurements replace it through an exponential moving average, so the curve follows
    the context length as it grows.
    """

    slope: float = 0.35  # prior extra cost per extra token, relative to one token
    alpha: float = 0.2  # weight of a new measurement
    t_by_n: dict[int, float] = field(default_factory=dict)

    def observe(self, n_tokens: int, t_s: float) -> None:
        old = self.t_by_n.get(n_tokens)
        self.t_by_n[n_tokens] = t_s if old is None else (1 - self.alpha) * old + self.alpha * t_s

    @property
    def t1(self) -> float:
        return self.t_by_n.get(1, 0.012)

    def cost(self, n_tokens: int) -> float:
        """Expected seconds to verify a batch of ``n_tokens``."""
        seen = self.t_by_n.get(n_tokens)
        if seen is not None:
            return seen
        return self.t1 * (1 + self.slope * (n_tokens - 1))

    def ratio(self, n_tokens: int) -> float:
        return self.cost(n_tokens) / self.t1


def best_node_count(values: list[float], cost: VerifyCostModel) -> int:
    """How many of the nodes (sorted by value, highest first) to verify.

    Maximises (1 + sum of kept values) / cost(1 + kept); 0 means plain decoding.
    """
    best_m, best_rate = 0, 1.0 / cost.cost(1)
    gain = 1.0
    for m, v in enumerate(values, start=1):
        gain += v
        rate = gain / cost.cost(m + 1)
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m


def trim_to_budget(tree: DraftTree, cost: VerifyCostModel) -> DraftTree:
    """Keep the most valuable nodes of a scored ``tree`` (a node's score is its estimated
    probability of being accepted, a path product, so a child never beats its parent).
    An unscored tree is returned as it is."""
    if not tree.tokens or not tree.scores:
        return tree
    scores = tree.scores
    order = sorted(range(len(tree)), key=lambda i: (-scores[i], i))
    m = best_node_count([scores[i] for i in order], cost)
    out = DraftTree()
    index: dict[int, int] = {}
    for old in sorted(order[:m]):  # parents before children
        parent = tree.parents[old]
        if parent >= 0 and parent not in index:
            continue  # its parent was cut (a tie in scores)
        index[old] = out.add(tree.tokens[old], index[parent] if parent >= 0 else -1,
                             scores[old])
    return out
