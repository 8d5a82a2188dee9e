"""Verifying a draft: ``[root, *draft]`` decoded in one batch, then the accepted path kept
in sequence 0 and everything else trimmed.

A chain lives in sequence 0. A tree gives each leaf its own sequence (the first leaf
sequence 0), copies the committed prefix into each, and puts every node in the sequences
of the leaves below it, at position n_past + depth. A rejected node whose cell precedes
an accepted one is parked (``engine.runtime.sequence`` says why cell order matters).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from engine.runtime.draft_tree import DraftTree, verification_layout
from engine.runtime.native import NativeBatch, NativeContext
from engine.runtime.sequence import CachedSequence

log = logging.getLogger(__name__)


@dataclass
class Verification:
    """What one verification decode produced. Valid until the next decode."""

    logits: np.ndarray  # [1 + n_draft, n_vocab]; row 0 predicts the token after the root
    features: np.ndarray | None  # [1 + n_draft, feature_width] when features are on
    leaf_seq: dict[int, int]  # draft-tree leaf (verification numbering) -> sequence id
    node_seqs: list[tuple[int, ...]]  # sequence ids of each node
    depths: list[int]  # depth of each node, the root 0


class TreeVerifier:
    """Verification batches on a sequence and the decoding batch it shares."""

    def __init__(self, sequence: CachedSequence, batch: NativeBatch) -> None:
        self.sequence, self.batch = sequence, batch
        self.max_leaves = sequence.park_seq  # a verified tree's leaves: one sequence each

    def verify(self, ctx: NativeContext, root: int, draft: DraftTree) -> Verification:
        """Decode ``[root, *draft]`` in one batch on the settled ``ctx``, every node an
        output (the caller checked that it fits)."""
        base = self.sequence.n_past
        n = 1 + len(draft)
        if len(draft) == 0:
            self.batch.fill_one(root, base)
            self.decode_or_trim(ctx)
            logits = ctx.last_logits_view(1)[None, :]
            feats = ctx.features(1) if ctx.features_on else None
            return Verification(logits, feats, {0: 0}, [(0,)], [0])
        depths = [0] + draft.depths()
        tokens = [root] + draft.tokens
        positions = [base + d for d in depths]
        leaf_seq, node_seqs = verification_layout(draft)
        if len(leaf_seq) > self.max_leaves:
            raise ValueError(f"a tree of {len(leaf_seq)} leaves exceeds the "
                             f"{self.max_leaves} sequences available")
        for s in range(1, len(leaf_seq)):
            ctx.kv_copy(0, s, -1, -1)
        self.batch.fill(tokens, positions, None if draft.is_chain() else node_seqs, True)
        self.decode_or_trim(ctx, n_tree_seqs=len(leaf_seq))
        logits = ctx.logits_view(n)  # read before the next decode (acceptance)
        feats = ctx.features(n) if ctx.features_on else None
        return Verification(logits, feats, leaf_seq, node_seqs, depths)

    def decode_or_trim(self, ctx: NativeContext, n_tree_seqs: int = 1) -> None:
        """Decode the batch; on a failure, drop what it added to the sequences."""
        try:
            ctx.decode(self.batch)
        except BaseException:
            self.sequence.drop_uncommitted()
            for s in range(1, n_tree_seqs):
                ctx.kv_remove(s, -1, -1)
            raise

    def commit(self, verification: Verification, path: list[int], path_tokens: list[int]
               ) -> None:
        """Keep the accepted ``path`` (verification numbering, root first) in sequence 0."""
        seq = self.sequence
        if len(verification.depths) == 1:  # a plain step: its one cell is kept as it is
            seq.append_decoded(path_tokens)
            return
        base = seq.n_past
        on_path = set(path)
        for node in range(1, path[-1]):
            if node not in on_path:  # rejected, but its cell precedes an accepted one
                seq.park(verification.node_seqs[node][0], base + verification.depths[node])
        n_keep = base + len(path)
        if not seq.keep_path(verification.node_seqs[path[-1]][0], n_keep, path_tokens):
            # Past the state's snapshots (a draft longer than max_draft): rebuilt.
            log.warning("the cache could not take back %d tokens; evaluating again",
                        base + len(verification.depths) - n_keep)
            seq.evaluate_again(seq.tokens + path_tokens)
            return
        for s in range(1, len(verification.leaf_seq)):
            seq.ctx.kv_remove(s, -1, -1)
