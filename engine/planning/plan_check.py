"""Plans checked against what the answers show, and changed when they were wrong.

The planner chose from calibrated costs. Every answer measures the same quantities again
for free: each step's verification time by batch size (steps at the calibration's
context bucket only: attention makes longer contexts dearer), and the drafter's time per
step it was asked. After each answer the check compares them with the calibration, and
when they disagree it re-prices every candidate with what it saw and asks the planner
again; a different choice that pays is adopted between answers.

Thresholds, and why:
- *Beyond the noise*: a batch size's median over the answer, or the drafter's time per
  step, off the calibrated figure by more than ``NOISE_FLOOR`` (15%) or three times the
  calibration's own repeat spread, whichever is larger. On a quiet machine an answer's
  medians sit within the floor; one shared with another decode is off by far more
  (docs/benchmarks.md: figures behind the code's rules, "Measuring on a busy machine").
  "Off" is a ratio either way (1.2x dearer or 1.2x cheaper). A provisional calibration's spread
  is its own instability, so it keeps the floor.
- ``MIN_SAMPLES`` (3) decodes of a size before its median counts: one decode the
  scheduler slowed does not move a median of three.
- *Several answers*: ``ANSWERS_TRUSTED`` (2) disagreeing answers in a row after a quiet
  calibration, since one answer can meet a passing burst (an update, a backup);
  ``ANSWERS_PROVISIONAL`` (1) after a provisional one, which is already suspect and older
  than the answer's evidence.
- A switch needs the re-priced choice to beat the running one by ``MIN_GAIN`` (5%), the
  margin the planner asks of drafting at all: less is inside the prediction's error.

When an answer disagrees, the engine spot-checks verification at 1, 2, 4 and 8 tokens
at the present context (a few hundred milliseconds, the cache left as it was): an answer
shows only the sizes it verified. Costs of drafters that did not run are kept as
measured. The engine measures everything again when the app is idle
(``Engine.remeasure``).
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from engine.decoding.budget import context_bucket
from engine.decoding.stats import StepStats
from engine.drafters.kinds import DrafterKind
from engine.planning.calibration import CostProfile
from engine.planning.planner import MIN_GAIN, Plan

NOISE_FLOOR = 0.15
NOISE_SPREADS = 3.0  # ... or this many times the calibration's repeat spread
MIN_SAMPLES = 3
ANSWERS_TRUSTED = 2
ANSWERS_PROVISIONAL = 1


@dataclass(frozen=True)
class AnswerCosts:
    """What one answer measured at the calibration's context bucket."""

    verify_s: dict[int, float]  # batch size -> median seconds (sizes seen MIN_SAMPLES times)
    draft_s: float | None  # median seconds per step the drafter was asked; None: never

    @classmethod
    def from_steps(cls, steps: Iterable[StepStats], context: int) -> AnswerCosts:
        bucket = context_bucket(context)
        by_size: dict[int, list[float]] = defaultdict(list)
        drafts = []
        for s in steps:
            if context_bucket(s.n_past) != bucket:
                continue
            by_size[1 + s.n_proposed].append(s.t_verify_s)
            if s.drafter_asked and not s.drafted_ahead:
                drafts.append(s.t_draft_s)
        verify = {n: statistics.median(t) for n, t in by_size.items() if len(t) >= MIN_SAMPLES}
        draft = statistics.median(drafts) if len(drafts) >= MIN_SAMPLES else None
        return cls(verify, draft)


@dataclass(frozen=True)
class PlanChange:
    at: float  # seconds since the epoch
    old: Plan
    new: Plan
    why: str


def same_choice(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same layout, drafter, device and target placement."""
    return (a.layout, a.drafter, a.head_device, a.target_gpu_layers) == (
        b.layout, b.drafter, b.head_device, b.target_gpu_layers)


def _rate_of(choice: Plan, plan: Plan) -> float:
    """``choice``'s candidate as re-priced in ``plan`` (0 when it is not offered)."""
    if not choice.drafter.costly:  # drafts from memory, or none: plain decoding's rate
        return plan.plain_tok_per_s
    for c in plan.candidates:
        if (c.layout, c.drafter, c.head_device) == (choice.layout, choice.drafter,
                                                     choice.head_device):
            return c.tok_per_s
    return 0.0


def _predicted_draft_s(costs: CostProfile, plan: Plan) -> float | None:
    """What the running drafter's step was priced at (its update plus a level per depth)."""
    device = plan.head_device
    depth = plan.budget.depth
    if plan.drafter is DrafterKind.HEAD:
        key = device if device in costs.head_level_s else device.split(":")[0]
        if key not in costs.head_level_s:
            return None
        return (costs.head_update_s[key] + costs.transfer_s.get(key, 0.0)
                + depth * costs.head_level_s[key])
    if plan.drafter is DrafterKind.DRAFT:
        key = "cpu" if device == "cpu" else "gpu"
        if key not in costs.draft_token_s:
            return None
        return costs.draft_sync_s.get(key, 0.0) + depth * costs.draft_token_s[key]
    if plan.drafter is DrafterKind.MTP and "cpu" in costs.mtp_level_s:
        return costs.mtp_update_s.get("cpu", 0.0) + depth * costs.mtp_level_s["cpu"]
    if plan.drafter is DrafterKind.EAGLE3 and "cpu" in costs.eagle3_level_s:
        return costs.eagle3_update_s.get("cpu", 0.0) + depth * costs.eagle3_level_s["cpu"]
    return None


class PlanCheck:
    """Holds the plan's costs; ``observe`` each answer's steps; a ``PlanChange`` comes
    back when the plan should change. ``price`` is the planner on given costs (the same
    hardware, model, drafts and overrides as the plan was made with)."""

    def __init__(self, costs: CostProfile, plan: Plan, price: Callable[[CostProfile], Plan],
                 device: str = "cpu") -> None:
        self.costs, self.plan, self.price, self.device = costs, plan, price, device
        self.streak = 0  # disagreeing answers in a row that chose another plan
        self.last_verdict = "no answer yet"
        self.changes: list[PlanChange] = []

    @property
    def noise(self) -> float:
        """How far off (either way, as a ratio) a cost may be and still be noise. A
        provisional calibration's spread is its instability, not a noise level."""
        if self.costs.provisional:
            return NOISE_FLOOR
        return max(NOISE_FLOOR, NOISE_SPREADS * self.costs.spread)

    @property
    def answers_needed(self) -> int:
        return ANSWERS_PROVISIONAL if self.costs.provisional else ANSWERS_TRUSTED

    def rebase(self, costs: CostProfile, plan: Plan) -> None:
        """New costs measured (and the plan made from them): compare with those now."""
        self.costs, self.plan, self.streak = costs, plan, 0

    def observe(self, steps: Iterable[StepStats],
                spot_check: Callable[[], dict[int, float]] | None = None
                ) -> PlanChange | None:
        """Compare an answer's steps with the costs. When they disagree, ``spot_check``
        (seconds by batch size, measured now) completes the picture: an answer shows
        only the sizes it verified, and a curve scaled by one size keeps the shape of a
        busy calibration (flat: batches that look free)."""
        seen = AnswerCosts.from_steps(steps, self.costs.context)
        if self.device not in self.costs.verify_s or not seen.verify_s:
            self.last_verdict = "nothing comparable (no decodes at the calibration's context)"
            return None
        factors = {n: t / self.costs.verify(self.device, n) for n, t in seen.verify_s.items()}
        predicted = _predicted_draft_s(self.costs, self.plan)
        draft_factor = seen.draft_s / predicted if seen.draft_s and predicted else None
        off = [f for f in (*factors.values(), draft_factor) if f is not None
               and max(f, 1 / f) - 1 > self.noise]
        if not off:
            self.streak, self.last_verdict = 0, "answers agree with the measured costs"
            return None
        if spot_check is not None:
            factors.update({n: t / self.costs.verify(self.device, n)
                            for n, t in spot_check().items()})
        repriced = reprice(self.costs, factors, draft_factor, self.plan, self.device)
        plan = self.price(repriced)
        current = _rate_of(self.plan, plan)
        if same_choice(plan, self.plan) or plan.predicted_tok_per_s < (
                1 + MIN_GAIN) * current:
            self.streak = 0
            self.last_verdict = "costs differ from the measurement, the plan still holds"
            return None
        self.streak += 1
        self.last_verdict = (f"costs differ and favour {plan.layout_text()} "
                             f"({self.streak} of {self.answers_needed} answers)")
        if self.streak < self.answers_needed:
            return None
        change = PlanChange(time.time(), self.plan, plan,
                            _why(self.costs, seen, self.plan, plan, current, self.device))
        self.changes.append(change)
        self.rebase(repriced, plan)
        return change


def _factor_at(factors: dict[int, float], n: int) -> float:
    """The observed slowdown at batch size ``n``: measured, or on a line between the
    nearest measured sizes, or the nearest one's beyond them."""
    sizes = sorted(factors)
    if n <= sizes[0]:
        return factors[sizes[0]]
    if n >= sizes[-1]:
        return factors[sizes[-1]]
    i = bisect_left(sizes, n)
    lo, hi = sizes[i - 1], sizes[i]
    return factors[lo] + (factors[hi] - factors[lo]) * (n - lo) / (hi - lo)


def reprice(costs: CostProfile, factors: dict[int, float], draft_factor: float | None,
            plan: Plan, device: str = "cpu") -> CostProfile:
    """``costs`` with the target's curve on ``device`` scaled by what answers measured
    (``factors``: observed / calibrated, by batch size) and the running drafter's costs
    by ``draft_factor``. Drafters that did not run keep their measured costs: under the
    same load a draft head's level stretched far less than one token's decode
    (docs/benchmarks.md: figures behind the code's rules, "Measuring on a busy machine"),
    so scaling the head as the target would make it look free; kept as measured, a
    drafter no answer has shown is not switched to on a guess."""
    curve, slowest = {}, 0.0
    for n, t in sorted(costs.verify_s[device].items()):
        slowest = max(slowest, t * _factor_at(factors, n))  # never cheaper for more tokens
        curve[n] = slowest
    running = plan.drafter if draft_factor is not None else None
    head_running = running is DrafterKind.HEAD
    model_running = running is DrafterKind.DRAFT
    mtp_running = running is DrafterKind.MTP
    eagle3_running = running is DrafterKind.EAGLE3

    def scaled(table: dict[str, float], running: bool) -> dict[str, float]:
        out = {}
        for dev, value in table.items():
            running_here = running and _same_device(dev, plan.head_device)
            out[dev] = value * draft_factor if running_here else value  # type: ignore[operator]
        return out

    return replace(costs, verify_s={**costs.verify_s, device: curve},
                   head_level_s=scaled(costs.head_level_s, head_running),
                   head_update_s=scaled(costs.head_update_s, head_running),
                   draft_token_s=scaled(costs.draft_token_s, model_running),
                   draft_sync_s=scaled(costs.draft_sync_s, model_running),
                   mtp_level_s=scaled(costs.mtp_level_s, mtp_running),
                   mtp_update_s=scaled(costs.mtp_update_s, mtp_running),
                   eagle3_level_s=scaled(costs.eagle3_level_s, eagle3_running),
                   eagle3_update_s=scaled(costs.eagle3_update_s, eagle3_running),
                   busy=False, spread=0.0, others_cores=0.0, measured_at=time.time())


def _same_device(key: str, device: str) -> bool:
    """A cost table's key ("cpu", "cuda:0", "gpu" for a draft model) names ``device``."""
    if key == "cpu" or device == "cpu":
        return key == device
    return key in (device, device.split(":")[0], "gpu")


def _why(costs: CostProfile, seen: AnswerCosts, old: Plan, plan: Plan, old_rate: float,
         device: str) -> str:
    t1 = seen.verify_s.get(1)
    sizes = sorted(n for n in seen.verify_s if n > 1)[:2]
    parts = []
    if t1 is not None:
        parts.append(f"one token took {t1 * 1000:.1f} ms (measured "
                     f"{costs.verify(device, 1) * 1000:.1f} ms)")
    for n in sizes:
        parts.append(f"{n} tokens {seen.verify_s[n] * 1000:.1f} ms "
                     f"({costs.verify(device, n) * 1000:.1f} ms)")
    if seen.draft_s is not None:
        parts.append(f"a draft {seen.draft_s * 1000:.1f} ms per step")
    observed = "; ".join(parts) or "costs differed"
    return (f"answers measured {observed}; re-priced with those costs, this plan is "
            f"predicted {plan.predicted_tok_per_s:.0f} tok/s against {old_rate:.0f} for "
            f"the one it replaced ({old.layout_text()})")

