"""The target's log probabilities of an answer's tokens (the API's ``logprobs``).

They are read from the target's raw logits for each position (before penalties, a grammar
or temperature: the model's own distribution), so plain and drafted decoding, whose
logits are bit for bit the same, report the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    piece: bytes  # the token's bytes (part of a UTF-8 character, for some)
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()  # the likeliest tokens there, best first


def logprob_of(logits: np.ndarray, token: int, n_top: int | None,
               piece_of: Callable[[int], bytes]) -> TokenLogprob:
    """``token``'s log probability under ``logits`` (one position's row), with the
    ``n_top`` likeliest tokens (ties by token id)."""
    row = logits.astype(np.float64)
    peak = float(row.max())
    log_z = peak + float(np.log(np.exp(row - peak).sum()))
    top: tuple[tuple[int, bytes, float], ...] = ()
    if n_top:
        best = np.argpartition(-row, n_top - 1)[:n_top] if n_top < len(row) else np.arange(len(row))
        best = sorted(best.tolist(), key=lambda t: (-row[t], t))
        top = tuple((t, piece_of(t), float(row[t] - log_z)) for t in best)
    return TokenLogprob(int(token), piece_of(int(token)), float(row[token] - log_z), top)
