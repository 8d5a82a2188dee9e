"""Sampling maths: pure functions on arrays, no model needed.

The target distribution is defined here once: temperature, then top-k, then top-p
(nucleus). Plain decoding samples from it; speculative decoding accepts drafts so that
each emitted token is distributed exactly as it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidSamplingError

# Candidates looked at before falling back to a full sort for top-p.
_TOP_P_PARTIAL = 512


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        validate_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampling(params: SamplingParams) -> None:
    """Raise InvalidSamplingError naming the bad value."""
    t, p, k = params.temperature, params.top_p, params.top_k
    if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
        raise InvalidSamplingError(f"temperature must be a finite number >= 0, got {t!r}")
    if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
        raise InvalidSamplingError(f"top_p must be in (0, 1], got {p!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise InvalidSamplingError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
    if params.seed is not None and (not isinstance(params.seed, int) or params.seed < 0):
        raise InvalidSamplingError(f"seed must be an integer >= 0, got {params.seed!r}")


def target_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the next token is drawn from, as float64 summing to 1.

    Greedy is the one-hot of the argmax (lowest index on ties), so acceptance code can
    treat both modes alike.
    """
    n = logits.shape[-1]
    if params.greedy:
        probs = np.zeros(n, dtype=np.float64)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    z = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < n:
        kth = np.partition(z, n - params.top_k)[n - params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    n = probs.shape[0]
    m = min(_TOP_P_PARTIAL, n)
    cand = np.argpartition(probs, n - m)[n - m:] if m < n else np.arange(n)
    if probs[cand].sum() < top_p:  # the head is too flat: sort everything
        cand = np.arange(n)
    order = cand[np.argsort(-probs[cand], kind="stable")]
    cum = np.cumsum(probs[order])
    n_keep = int(np.searchsorted(cum, top_p)) + 1
    kept = order[:n_keep]
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from a distribution (inverse CDF on one uniform)."""
    cum = np.cumsum(probs)
    u = rng.random() * cum[-1]
    return int(min(np.searchsorted(cum, u, side="right"), probs.shape[0] - 1))


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from logits: argmax when greedy, else a draw from the target."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(target_distribution(logits, params), rng)
