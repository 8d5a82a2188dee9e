"""How far the planner's cost measurement is, for a progress bar.

The engine's progress callbacks take text (``Callable[[str], None]``). While this
machine's costs are measured (``engine.planning.calibration.calibrate``, on a first start
with ``auto``) they get ``Measuring`` values: text like any other (what is measured now),
which also carry how far the whole measurement is and how long it has run, so a window
or a terminal can show a bar and the time left. A callback that only reads text keeps
working; one that wants the bar checks ``isinstance(what, Measuring)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

# What the last report says once everything is measured (the plan is priced next).
MEASURED = "planning from the measured costs"


class Measuring(str):
    """A progress message of the cost measurement: the text says what is measured now,
    ``done`` how much of the whole measurement is done (0 to 1; 1: finished) and
    ``elapsed_s`` how long it has run so far."""

    done: float
    elapsed_s: float

    def __new__(cls, what: str, done: float, elapsed_s: float = 0.0) -> Measuring:
        value = super().__new__(cls, what)
        value.done = min(1.0, max(0.0, float(done)))
        value.elapsed_s = max(0.0, float(elapsed_s))
        return value

    def __reduce__(self) -> tuple[type[Measuring], tuple[str, float, float]]:
        # Pickled whole to the parent of an engine in its own process.
        return Measuring, (str(self), self.done, self.elapsed_s)

    @property
    def seconds_left(self) -> float | None:
        """About how long the rest takes, at the pace so far (the time so far over the
        share done); None before anything is done."""
        if self.done <= 0.0 or self.elapsed_s <= 0.0:
            return None
        return self.elapsed_s * (1.0 - self.done) / self.done


class MeasureSteps:
    """Reports a measurement of steps, run in order, through ``say`` as ``Measuring``
    values. ``weights``: each step's rough share of the time, in the order the steps
    begin (a step begun past them counts for nothing)."""

    def __init__(self, say: Callable[[str], None], weights: Sequence[float]) -> None:
        self._say = say
        self._weights = [max(0.0, w) for w in weights]
        self._total = sum(self._weights) or 1.0
        self._t0 = time.perf_counter()
        self._next = 0  # the step that begins next
        self._before = 0.0  # the weight of the steps done
        self._weight = 0.0  # the weight of the step under way
        self._what = ""

    def begin(self, what: str) -> None:
        """The next step begins: ``what`` it measures, in words."""
        self._before += self._weight
        i, self._next = self._next, self._next + 1
        self._weight = self._weights[i] if i < len(self._weights) else 0.0
        self._what = what
        self.part(0.0)

    def part(self, fraction: float) -> None:
        """``fraction`` of the step under way is done."""
        share = min(1.0, max(0.0, fraction)) * self._weight
        self._report(self._what, min(1.0, (self._before + share) / self._total))

    def finish(self) -> None:
        """Everything is measured."""
        self._report(MEASURED, 1.0)

    def _report(self, what: str, done: float) -> None:
        self._say(Measuring(what, done, time.perf_counter() - self._t0))
