"""Recurrent state as the last prompts left it (llama-server's context checkpoints): a
hybrid's or a recurrent model's state cannot go back further than its per-token
snapshots, so a regenerate or an edit of a recent message restores the last checkpoint at
or before where it parts and reads on from there, not the whole conversation. The state
alone (``partial``: llama.cpp's recurrent part), the last ``CHECKPOINTS`` prompts'.
``CachedSequence`` owns one and keeps sequence 0's books; this keeps the blobs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from engine.errors import NativeError
from engine.runtime.native import NativeContext

log = logging.getLogger(__name__)

# A regenerate, a follow-up and an edit of the last message each go back to one of the
# last two.
CHECKPOINTS = 4


@dataclass
class StateCheckpoints:
    kept: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (length, blob)

    def at(self, n_tokens: int) -> bool:
        return any(at == n_tokens for at, _ in self.kept)

    def cut(self, n_keep: int) -> None:
        """Forget the checkpoints past the first ``n_keep`` tokens."""
        self.kept = [c for c in self.kept if c[0] <= n_keep]

    def keep(self, ctx: NativeContext, n_tokens: int) -> None:
        """Sequence 0's state after ``n_tokens`` tokens (its cells there)."""
        if self.at(n_tokens):
            return  # (taken back to it: the same state)
        try:
            state = ctx.state_seq_array(0, partial=True)  # (a buffer of its own)
        except NativeError as exc:
            log.warning("no checkpoint of the recurrent state: %s", exc)
            return
        self.kept = [*self.kept, (n_tokens, state)][-CHECKPOINTS:]

    def restore(self, ctx: NativeContext, n_keep: int) -> int | None:
        """Sequence 0's state put back from the last checkpoint at or before ``n_keep``,
        the attention cells after it removed; its length, or None where none restored
        (all are then forgotten: the state is in doubt)."""
        self.cut(n_keep)
        if not self.kept:
            return None
        at, state = self.kept[-1]
        try:
            ctx.state_seq_set(0, state, partial_at=at)
            # The attention cells after it; the state's last position is at - 1, so its
            # part is left as restored.
            if ctx.kv_remove(0, at, -1):
                return at
        except NativeError as exc:
            log.warning("the recurrent state's checkpoint did not restore: %s", exc)
        self.kept = []
        return None
