"""Sampling maths: pure functions on arrays, no model needed.

The target distribution is defined here once: penalties for what the context already
holds (repetition, frequency, presence), then temperature, top-k, top-p (nucleus) and
min-p. Plain decoding samples from it; speculative decoding accepts drafts so that each
emitted token is distributed exactly as it. A penalty depends on the tokens before the
position it applies to, so each drafted position is penalised with its own prefix
(``penalised``), as plain decoding would have seen it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidSamplingError

# Probability floors tried, in turn, to find a small superset of the top-p nucleus.
_NUCLEUS_THRESHOLDS = (1e-3, 1e-5)
_BLOCK = 256
# Below this a temperature is greedy in all but name, and 1/T overflows logits to inf.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
# OpenAI's bounds for frequency and presence penalties; llama.cpp's for repetition.
MAX_ADDITIVE_PENALTY = 2.0
MAX_REPEAT_PENALTY = 10.0
MAX_PENALTY_WINDOW = 4096


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0  # drop tokens below min_p times the most likely one's probability
    repeat_penalty: float = 1.0  # 1 = off; >1 divides positive logits of seen tokens
    frequency_penalty: float = 0.0  # subtracted per occurrence in the window
    presence_penalty: float = 0.0  # subtracted once if present in the window
    penalty_last_n: int = 64  # the window: this many tokens before each position

    def __post_init__(self) -> None:
        validate_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n > 0 and (self.repeat_penalty != 1.0
                                            or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)



def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def validate_sampling(params: SamplingParams) -> None:
    """Raise InvalidSamplingError naming the setting, its allowed range and the value."""
    t, p, k = params.temperature, params.top_p, params.top_k
    if not isinstance(t, (int, float)) or math.isnan(t) or not (
            t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        raise InvalidSamplingError("temperature", f"must be 0 (greedy) or between "
                                   f"{MIN_TEMPERATURE} and {MAX_TEMPERATURE}", t)
    if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
        raise InvalidSamplingError("top_p", "must be in (0, 1]", p)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise InvalidSamplingError("top_k", "must be an integer >= 0 (0 = off)", k)
    if params.seed is not None and (not isinstance(params.seed, int) or params.seed < 0):
        raise InvalidSamplingError("seed", "must be an integer >= 0", params.seed)
    if not _is_number(params.min_p) or not 0.0 <= params.min_p < 1.0:
        raise InvalidSamplingError("min_p", "must be in [0, 1) (0 = off)", params.min_p)
    if not _is_number(params.repeat_penalty) or not (
            0.0 < params.repeat_penalty <= MAX_REPEAT_PENALTY):
        raise InvalidSamplingError("repeat_penalty", f"must be in (0, {MAX_REPEAT_PENALTY}] "
                                   "(1 = off)", params.repeat_penalty)
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(params, name)
        if not _is_number(v) or not -MAX_ADDITIVE_PENALTY <= v <= MAX_ADDITIVE_PENALTY:
            raise InvalidSamplingError(name, f"must be between -{MAX_ADDITIVE_PENALTY} and "
                                       f"{MAX_ADDITIVE_PENALTY} (0 = off)", v)
    n = params.penalty_last_n
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_PENALTY_WINDOW:
        raise InvalidSamplingError("penalty_last_n", f"must be an integer in "
                                   f"[0, {MAX_PENALTY_WINDOW}]", n)


def penalised(logits: np.ndarray, window: list[int], params: SamplingParams) -> np.ndarray:
    """``logits`` with the penalties for the tokens in ``window`` (the last
    ``penalty_last_n`` tokens before the position), as llama.cpp applies them: a seen
    token's logit is divided by ``repeat_penalty`` when positive (multiplied when not),
    then lowered by ``frequency_penalty`` per occurrence and ``presence_penalty`` once.
    Returns ``logits`` itself when nothing applies."""
    if not params.has_penalties or not window:
        return logits
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    ids, counts = ids[ids < logits.shape[-1]], counts[ids < logits.shape[-1]]
    out = np.array(logits, dtype=np.float32, copy=True)
    seen = out[ids]
    r = np.float32(params.repeat_penalty)
    seen = np.where(seen > 0, seen / r, seen * r)
    seen -= (counts * params.frequency_penalty + params.presence_penalty).astype(np.float32)
    out[ids] = seen
    return out


def target_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the next token is drawn from, as float64 summing to 1.

    Greedy is the one-hot of the argmax (lowest index on ties), so acceptance code can
    treat both modes alike. Runs once per verified node: kept to well under a
    millisecond on a 49k vocabulary.
    """
    n = logits.shape[-1]
    if params.greedy:
        probs = np.zeros(n, dtype=np.float64)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    z = np.asarray(logits, dtype=np.float32) * np.float32(1.0 / params.temperature)
    if 0 < params.top_k < n:
        keep = np.argpartition(z, n - params.top_k)[n - params.top_k:]
        zk = z[keep].astype(np.float64)
        pk = np.exp(zk - zk.max())
        probs = np.zeros(n, dtype=np.float64)
        probs[keep] = pk / pk.sum()
    else:
        e = np.exp(z - z.max(), dtype=np.float32)
        probs = e.astype(np.float64)
        probs /= probs.sum()
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    if params.min_p > 0.0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    Exact without sorting the whole vocabulary: if the tokens above a threshold already
    hold ``top_p`` of the mass, the nucleus lies among them.
    """
    cand = None
    for threshold in _NUCLEUS_THRESHOLDS:
        idx = np.flatnonzero(probs >= threshold)
        if probs[idx].sum() >= top_p:
            cand = idx
            break
    if cand is None:
        cand = np.flatnonzero(probs > 0)
    order = cand[np.argsort(-probs[cand], kind="stable")]
    cum = np.cumsum(probs[order])
    n_keep = min(int(np.searchsorted(cum, top_p)) + 1, len(order))
    kept = order[:n_keep]
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from a distribution (inverse CDF on one uniform)."""
    return sample_at(probs, rng.random())


def sample_at(probs: np.ndarray, u: float) -> int:
    """The index where the distribution's cumulative sum passes ``u`` (in [0, 1)), in
    vocabulary order: with ``u`` uniform, a draw from ``probs``.

    Two-level search (block sums, then within one block): a cumulative sum over the
    whole vocabulary costs a sizeable share of a decode step (docs/benchmarks.md:
    figures behind the code's rules, "Per-step costs").
    """
    n = probs.shape[0]
    n_blocks = -(-n // _BLOCK)
    if n != n_blocks * _BLOCK:
        probs = np.concatenate([probs, np.zeros(n_blocks * _BLOCK - n)])
    blocks = probs.reshape(n_blocks, _BLOCK)
    cum = np.cumsum(blocks.sum(axis=1))
    u = u * cum[-1]
    b = min(int(np.searchsorted(cum, u, side="right")), n_blocks - 1)
    while cum[b] == (cum[b - 1] if b else 0.0):  # rounding landed on an empty block
        b -= 1
    inner = np.cumsum(blocks[b])
    u_in = min(u - (cum[b - 1] if b else 0.0), inner[-1])
    j = min(int(np.searchsorted(inner, u_in, side="right")), _BLOCK - 1)
    while blocks[b, j] == 0.0:  # never return a token of probability zero
        j -= 1
    return b * _BLOCK + j


def choose(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The next token from logits: argmax when greedy, else the target's token for the
    uniform ``u`` of this position."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample_at(target_distribution(logits, params), u)


class PositionUniforms:
    """One uniform per position of the answer, from the seed, in order: the token at
    position i is always drawn with the i-th uniform, whatever was drafted. So sampled
    output with a seed is the same with any drafter, and the same as plain sampling."""

    def __init__(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)
        self._drawn: list[float] = []

    def at(self, position: int) -> float:
        while len(self._drawn) <= position:
            self._drawn.append(self._rng.random())
        return self._drawn[position]


# Settings for chat: the bundled 135M model loops on greedy decoding without a penalty
# (tests/test_penalties.py shows it on a poem); these keep answers moving.
CHAT_DEFAULTS = SamplingParams(repeat_penalty=1.1, penalty_last_n=64)
