"""The shape of a draft: a chain or a tree of proposed tokens hanging off the last token."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftTree:
    """Draft tokens; ``parents[i]`` is the index of node i's parent, -1 for the root.

    The root is the last committed-but-unevaluated token, kept outside the tree. Parents
    come before their children, and siblings carry distinct tokens, so a verification
    batch can be written in index order and a path is identified by its tokens.
    ``scores`` (optional, all nodes or none) are the drafter's estimates of each node's
    probability of being accepted; the budget uses them to trim the tree.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    made_ahead: bool = False  # drafted while the previous step was being verified

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float | None = None) -> int:
        """Append a node and return its index."""
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not an existing node")
        if (score is None) != (not self.scores) and self.tokens:
            raise ValueError("score every node of a tree or none")
        self.tokens.append(token)
        self.parents.append(parent)
        if score is not None:
            self.scores.append(score)
        return len(self.tokens) - 1

    def child_with_token(self, parent: int, token: int) -> int | None:
        for i, p in enumerate(self.parents):
            if p == parent and self.tokens[i] == token:
                return i
        return None

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node; the root's children have depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> list[list[int]]:
        """Children of each node in *verification numbering*: 0 is the root, node i is i+1."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i + 1)
        return kids

    def leaves(self) -> list[int]:
        has_child = {p for p in self.parents if p >= 0}
        return [i for i in range(len(self.tokens)) if i not in has_child]

    def best_chain(self) -> DraftTree:
        """The path that follows, from the root, the best-scored child (the first when
        unscored): what a cache that verifies chains only can take of a tree."""
        if self.is_chain():
            return self
        out = DraftTree(made_ahead=self.made_ahead)
        kids = self.children()
        node = 0  # verification numbering: the root
        while kids[node]:
            best = max(kids[node], key=lambda k: self.scores[k - 1]) if self.scores \
                else kids[node][0]
            out.add(self.tokens[best - 1], len(out) - 1,
                    self.scores[best - 1] if self.scores else None)
            node = best
        return out

    def with_leaves_at_most(self, n_max: int) -> DraftTree:
        """The tree cut to its ``n_max`` best leaves and their ancestors: a verified tree
        takes one KV sequence per leaf, and the target has a fixed number. The best leaf
        has the highest score (a path's probability; the first when unscored)."""
        leaves = self.leaves()
        if len(leaves) <= n_max:
            return self
        if self.scores:
            leaves = sorted(leaves, key=lambda i: (-self.scores[i], i))
        keep: set[int] = set()
        for leaf in leaves[:max(0, n_max)]:
            node = leaf
            while node >= 0 and node not in keep:
                keep.add(node)
                node = self.parents[node]
        out = DraftTree(made_ahead=self.made_ahead)
        index: dict[int, int] = {}
        for old in sorted(keep):  # parents before children
            parent = self.parents[old]
            index[old] = out.add(self.tokens[old], index[parent] if parent >= 0 else -1,
                                 self.scores[old] if self.scores else None)
        return out

    def truncated(self, n_max: int) -> DraftTree:
        """The first ``n_max`` nodes (still a tree, since parents come first)."""
        return DraftTree(self.tokens[:n_max], self.parents[:n_max], self.scores[:n_max],
                         self.made_ahead)


def verification_layout(draft: DraftTree) -> tuple[dict[int, int], list[tuple[int, ...]]]:
    """How ``[root, *draft]`` sits in a verification's sequences (verification numbering,
    the root 0): each leaf gets a sequence of its own (the first leaf sequence 0), and
    each node is in the sequences of the leaves below it. Returns the leaf -> sequence map
    and each node's sequences."""
    n = 1 + len(draft)
    if draft.is_chain():
        return {n - 1: 0}, [(0,)] * n
    leaf_seq = {leaf + 1: s for s, leaf in enumerate(draft.leaves())}
    parents = [-1] + [p + 1 for p in draft.parents]
    below: list[set[int]] = [set() for _ in range(n)]
    for leaf, s in leaf_seq.items():
        node = leaf
        while node >= 0:
            below[node].add(s)
            node = parents[node]
    return leaf_seq, [tuple(sorted(b)) for b in below]
