"""How much to draft: as many nodes as maximise expected tokens per second.

A CPU target does not verify for free (a batch costs more than one token, and more the
longer it is; docs/benchmarks.md: figures behind the code's rules, "Verification costs"),
so each cycle keeps the draft nodes whose estimated acceptance pays for the
extra verification time (EAGLE-2's rule: a cycle yields 1 + the sum of the kept nodes'
path probabilities; divide by the measured cost of verifying them).
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from engine.runtime.draft_tree import DraftTree

# Draft tokens verified per step at most, unless a plan or the user says otherwise; and
# the most anyone may ask for (a tree needs a KV sequence per leaf).
MAX_DRAFT = 8
MAX_DRAFT_LIMIT = 16
# Drafts from memory cost nothing to make, and a long exact repeat (a model looping, a
# text quoted again) is accepted whole: verify up to this many when the budget says so.
MAX_MEMORY_DRAFT = 32
# Each further row of a verification pays this share of one token's attention through the
# tiled CPU kernel, whose rows read the cache together (docs/benchmarks.md, "One
# attention kernel": c(16) over c(1) past the calibration's context).
TILED_ROW_SHARE = 0.4


def context_bucket(n_past: int) -> int:
    """Context lengths 0-511, 512-1023, 1024-2047, ...: attention makes a batch's
    cost relative to one token grow with the context."""
    return max(0, min(6, (max(n_past, 1) // 256).bit_length() - 1))


class _Recent:
    """The last few measurements of one quantity; its value is their median, so one
    decode slowed by the scheduler cannot move it."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.stamp = 0  # the bucket's decode count at the last measurement
        self.value = 0.0  # the median, kept current (it is read every step)

    def add(self, value: float, stamp: int) -> None:
        self.values.append(value)
        self.stamp = stamp
        ordered = sorted(self.values)  # a handful: cheaper than statistics.median
        mid = len(ordered) // 2
        self.value = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass
class VerifyCostModel:
    """Verification time by batch size and context length, learnt from the decodes.

    Per context bucket it keeps the single-token time and each batch size's cost as a
    ratio to it (medians of the last few decodes), so a ratio learnt earlier still holds
    when the context has grown. A ratio not measured again within ``max_age`` decodes of
    its bucket is forgotten: a cost overestimated once (a decode the OS slowed down) would
    otherwise stop drafting for good, since nothing of that size is verified again to
    correct it. Unseen sizes use the calibrated curve (``prior``) or
    ``1 + slope * (n - 1)``. Ask it at a context with ``at(n_past)``: every figure depends
    on the context, so the context is an argument, never a state of the model.
    """

    slope: float = 0.35  # prior extra cost per extra token, relative to one token
    prior: dict[int, float] = field(default_factory=dict)  # n -> calibrated ratio
    prior_t1: float = 0.0  # the calibrated curve's one-token seconds (0: not known)
    window: int = 5  # decodes per median
    max_age: int = 64  # decodes of a bucket after which an unrefreshed ratio is forgotten
    learn: bool = True  # False: keep the prior (tests that want every node verified)
    # The share of one token's attention each further row of a batch pays: 1 where every
    # row reads the cache alone (ggml's one-row and matrix paths), less where a batch's
    # rows read it together (the tiled CPU kernel: ``TILED_ROW_SHARE``).
    row_share: float = 1.0
    _t1: dict[int, _Recent] = field(default_factory=dict)
    _ratios: dict[tuple[int, int], _Recent] = field(default_factory=dict)
    _clock: dict[int, int] = field(default_factory=dict)  # decodes seen per bucket
    # bucket -> (shaped ratios, the bucket's clock after which one of them expires)
    _tables: dict[int, tuple[dict[int, float], int]] = field(default_factory=dict)

    @classmethod
    def from_curve(cls, curve: dict[int, float]) -> VerifyCostModel:
        """Seeded with a calibrated curve (n -> seconds): its ratios are the prior."""
        t1 = curve.get(1)
        prior = {n: t / t1 for n, t in curve.items() if t1 and n > 1}
        return cls(prior=prior, prior_t1=t1 or 0.0)

    def at(self, n_past: int) -> VerifyCost:
        """The costs at a context of ``n_past`` cached tokens, read once: the budget asks
        for many batch sizes every step, so the view holds plain numbers."""
        bucket = context_bucket(n_past)
        cached = self._tables.get(bucket)
        if cached is None or self._clock.get(bucket, 0) > cached[1]:
            fresh, expiry = self._fresh(bucket)
            if not fresh:  # priced from its one-token time: again after the next decode
                expiry = self._clock.get(bucket, 0)
            cached = self._tables[bucket] = (self._shaped(fresh, bucket), expiry)
        return VerifyCost(self.t1_in(bucket), cached[0], self.slope)

    def _shaped(self, fresh: dict[int, float], bucket: int) -> dict[int, float]:
        """Ratios for every size the calibration measured, at this context: the sizes
        verified lately as measured, the others from the calibrated curve with its extra
        cost scaled as the recent sizes' was (long contexts make batches dearer than at
        calibration). Sizes never verified must keep a fair price: priced by a guess,
        a size the budget never picks is never measured, so the guess would stand.

        A context no batch was verified at yet, but whose one-token time is known, is
        priced by attention's share: what a token costs above the calibration's one-token
        time is its attention over the longer context, paid again by every row of a
        batch, while the weights' part keeps the calibrated ratio (on the bundled model,
        c(16) is 7.2 at 256 tokens and 10.7 at 3,000: this prices it 12.4, the curve 7.2)."""
        if not self.prior:
            return fresh
        excess = [(r - 1) / (self.prior[n] - 1) for n, r in fresh.items()
                  if self.prior.get(n, 1.0) > 1.0]
        if excess:
            scale = statistics.median(excess)
            table = {n: 1 + (r - 1) * scale for n, r in self.prior.items()}
        else:
            table = self._attention_priced(bucket)
        table.update(fresh)
        return table

    def _attention_priced(self, bucket: int) -> dict[int, float]:
        """The calibrated ratios at ``bucket``, the first row paying the attention a token
        there costs above the calibration's one-token time and each further row
        ``row_share`` of it (the ratios as calibrated where that is not known or not
        more)."""
        t1_cal, known = self.prior_t1, self._t1.get(bucket)
        extra = known.value - t1_cal if known is not None and t1_cal > 0 else 0.0
        if extra <= 0:
            return dict(self.prior)
        t1 = known.value
        return {n: (r * t1_cal + (1 + self.row_share * (n - 1)) * extra) / t1
                for n, r in self.prior.items()}

    def observe(self, n_past: int, n_tokens: int, t_s: float) -> None:
        """A verification of ``n_tokens`` at ``n_past`` cached tokens took ``t_s``."""
        if not self.learn:
            return
        bucket = context_bucket(n_past)
        clock = self._clock[bucket] = self._clock.get(bucket, 0) + 1
        # (get, not setdefault: its default would be built on every decode)
        if n_tokens == 1:
            recent = self._t1.get(bucket)
            if recent is None:
                recent = self._t1[bucket] = _Recent(self.window)
            recent.add(t_s, clock)
        else:
            key = (bucket, n_tokens)
            recent = self._ratios.get(key)
            if recent is None:
                recent = self._ratios[key] = _Recent(self.window)
            recent.add(t_s / self.t1_in(bucket), clock)
            self._tables.pop(bucket, None)

    @property
    def knows_t1(self) -> bool:
        """Whether a one-token decode has been timed (else t1 is a guess)."""
        return bool(self._t1)

    def t1_in(self, bucket: int) -> float:
        if bucket in self._t1:
            return self._t1[bucket].value
        return max((r.value for r in self._t1.values()), default=0.012)

    def _fresh(self, bucket: int) -> tuple[dict[int, float], int]:
        """The ratios this bucket measured recently enough, by batch size, and the
        bucket's clock after which the first of them will be forgotten."""
        clock = self._clock.get(bucket, 0)
        fresh = {n: r for (b, n), r in self._ratios.items()
                 if b == bucket and clock - r.stamp <= self.max_age}
        expiry = min((r.stamp for r in fresh.values()), default=1 << 62) + self.max_age
        return {n: r.value for n, r in fresh.items()}, expiry

@dataclass(frozen=True)
class VerifyCost:
    """The cost model read at one context (what the budget and governor use)."""

    t1: float  # seconds of a plain single-token step at this context
    ratios: dict[int, float]  # batch size -> cost relative to one token, where known
    slope: float  # extra cost per extra token when no batch size is known

    @cached_property
    def _sizes(self) -> list[int]:
        return sorted(n for n in self.ratios if n > 1)

    def ratio(self, n_tokens: int) -> float:
        """Known sizes as known; others on straight lines between the nearest known
        sizes, and past the largest on the line from one token through it."""
        if n_tokens <= 1:
            return 1.0
        known = self.ratios.get(n_tokens)
        if known is not None:
            return known
        sizes = self._sizes
        i = bisect_left(sizes, n_tokens)
        lo, r_lo = (sizes[i - 1], self.ratios[sizes[i - 1]]) if i else (1, 1.0)
        if i < len(sizes):
            hi = sizes[i]
            return r_lo + (self.ratios[hi] - r_lo) * (n_tokens - lo) / (hi - lo)
        slope = (r_lo - 1) / (lo - 1) if lo > 1 else self.slope
        return r_lo + max(0.0, slope) * (n_tokens - lo)

    def cost(self, n_tokens: int) -> float:
        """Expected seconds to verify a batch of ``n_tokens`` at this context."""
        return self.t1 * self.ratio(n_tokens)


def best_node_count(values: list[float], cost: VerifyCost) -> int:
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


def trim_to_budget(tree: DraftTree, cost: VerifyCost) -> DraftTree:
    """Keep the most valuable nodes of a scored ``tree`` (a node's score is its estimated
    probability of being accepted, a path product, so a child never beats its parent).
    An unscored tree is returned as it is."""
    if not tree.tokens or not tree.scores:
        return tree
    scores = tree.scores
    order = sorted(range(len(tree)), key=lambda i: (-scores[i], i))
    m = best_node_count([scores[i] for i in order], cost)
    out = DraftTree(made_ahead=tree.made_ahead)
    index: dict[int, int] = {}
    for old in sorted(order[:m]):  # parents before children
        parent = tree.parents[old]
        if parent >= 0 and parent not in index:
            continue  # its parent was cut (a tie in scores)
        index[old] = out.add(tree.tokens[old], index[parent] if parent >= 0 else -1,
                             scores[old])
    return out


@dataclass
class SpeculationGovernor:
    """Drafts only while drafting pays, judged on what it really costs here.

    Each drafting step is weighed against the plain step it replaces: it gained
    ``accepted`` tokens (worth ``accepted * t1`` seconds of plain decoding) and cost its
    draft time plus the verification time above one token. Over a window of drafting
    steps (8, or 3 when probing after a pause), an average loss beyond ``tolerance`` of
    a token pauses drafting; the pause is as long as it takes for the window's loss to
    be ``probe_share`` of the plain decoding in between, so probing a drafter that never
    pays costs about that share. Output never depends on it: it only decides whether to
    ask the drafter.
    """

    probe_share: float = 0.01
    tolerance: float = 0.02  # average loss per step, in plain-token times, let pass
    window: int = 8
    probe_window: int = 3
    min_pause: int = 4
    max_pause: int = 2000
    # A new prompt ends a pause (then a probe's few steps judge it): for drafters that
    # read the context, whose hits come with what the prompt brings (a tool's result
    # quoted, an earlier call repeated), which the last request's losses say nothing of.
    resume_on_new_request: bool = False
    pause_left: int = 0
    n_paused: int = 0  # plain steps taken because drafting did not pay
    _saved_s: float = 0.0  # seconds saved over the current window (negative: lost)
    _n: int = 0
    _needed: int = 0

    def new_request(self) -> None:
        """A generation after a new prompt starts."""
        if self.resume_on_new_request and self.pause_left > 0:
            self.pause_left = 0
            self._needed = self.probe_window
            self._saved_s, self._n = 0.0, 0

    def should_draft(self) -> bool:
        if self.pause_left > 0:
            self.pause_left -= 1
            self.n_paused += 1
            return False
        return True

    def observe(self, accepted: int, t_draft_s: float, t_verify_s: float, t1_s: float,
                n_proposed: int = 1) -> None:
        """A drafting step: ``accepted`` draft tokens kept out of ``n_proposed``, its
        draft and verify times, and the plain step time ``t1_s`` at this context."""
        saved = accepted * t1_s - t_draft_s
        if n_proposed > 0:  # a step with nothing to verify cost the draft alone
            saved -= max(0.0, t_verify_s - t1_s)
        self._saved_s += saved
        self._n += 1
        if self._n < (self._needed or self.window):
            return
        if self._saved_s / self._n < -self.tolerance * t1_s:
            pause = int(-self._saved_s / (self.probe_share * max(t1_s, 1e-6)))
            self.pause_left = max(self.min_pause, min(self.max_pause, pause))
            self._needed = self.probe_window
        else:
            self._needed = self.window
        self._saved_s, self._n = 0.0, 0
