"""How many threads decode: the physical cores other programs leave us, read from the
machine's load between answers.

llama.cpp's threads meet at a barrier after every operation of a decode and spin there a
while. When another program at our priority holds a core, one of our two threads waits
for the scheduler at every barrier and the other spins: measured here with one busy
program, 2 threads decoded 29-49 tok/s and 1 thread 82-126 (docs/benchmarks.md: "Decoding
beside other programs"). Niced programs give way to ours, so their cores stay ours.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from engine.planning.machine_load import LoadReading, RecentLoad, look_at_load

# The shortest look at the machine worth deciding from: between two requests that follow
# each other at once, the last choice stands.
MIN_LOOK_S = 0.2
# The look at the machine before the model opens.
START_LOOK_S = 0.2
# Other programs' use, in cores, that still leaves a core ours (a browser tab, a terminal).
NOISE_CORES = 0.25
# Within an answer (AnswerThreads): one-token steps per measurement, the slowdown against
# the reference that says a program took a core since the answer began, and the steps
# before fewer threads try more again (doubled after each try that did not pay).
WINDOW_STEPS = 8
SLOWER = 1.5
RETRY_STEPS = 128
# A trial ends after this many steps when even its fastest was SLOWER than before: trying
# 2 threads again beside a busy program would otherwise cost a window at a third the speed.
EARLY_STEPS = 2
DURING = "; during the last answer: "


@dataclass(frozen=True)
class ThreadChoice:
    n_threads: int
    why: str


def threads_for(reading: LoadReading, most: int, physical: int | None = None
                ) -> ThreadChoice:
    """The threads to decode with given ``reading``: one per physical core that programs
    at our priority leave free, between 1 and ``most``."""
    physical = physical or psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    held = reading.competing_cores
    free = physical - max(0, math.ceil(held - NOISE_CORES))
    n = max(1, min(most, free))
    if held <= NOISE_CORES:
        why = "the machine is quiet"
    else:
        why = f"other programs hold {held:.1f} of {physical} cores"
    if reading.niced_cores > NOISE_CORES:
        why += f" (niced programs' {reading.niced_cores:.1f} give way)"
    return ThreadChoice(n, f"{n} thread{'s' * (n > 1)}: {why}")


class AnswerThreads:
    """Within one answer: the thread count, tried against the tokens as they come.

    The load read before an answer cannot see what starts during it, and beside a niced
    compile either count may be the faster (its jobs come and go). So every
    ``WINDOW_STEPS`` one-token steps the median step time is compared with this count's
    reference at this context (``references``, kept across answers): ``SLOWER`` times it
    and one thread fewer is tried for a window, kept only if faster. Below ``most``, one
    thread more is tried every ``RETRY_STEPS`` steps (twice as long after each try that
    did not pay). A trial whose first steps are all far slower ends at once. A quiet
    machine keeps its reference and pays nothing. The thread count does not change a
    decode's numbers (tests/test_thread_choice.py), so switching between steps keeps the
    answer.
    """

    def __init__(self, n_threads: int, most: int, references: dict[tuple[int, int], float],
                 set_threads: Callable[[int], None]) -> None:
        self.n = n_threads
        self.most = most
        self.references = references  # (threads, context bucket) -> median step time
        self.set_threads = set_threads
        self._window: list[float] = []
        self._trial: tuple[int, float] | None = None  # the count before a trial, its median
        self._since_retry = 0
        self._retry_every = RETRY_STEPS
        self.changes: list[str] = []  # what changed in this answer, and why

    def observe(self, step_s: float, bucket: int) -> None:
        """A one-token step took ``step_s`` at context ``bucket``; may change the threads
        for the next step."""
        self._window.append(step_s)
        if (self._trial is not None and len(self._window) >= EARLY_STEPS
                and min(self._window) > SLOWER * self._trial[1]):
            median = statistics.median(self._window)
            self._window = []
            self._end_trial(median, bucket)
            return
        if len(self._window) < WINDOW_STEPS:
            return
        median = statistics.median(self._window)
        self._window = []
        key = (self.n, bucket)
        reference = self.references.get(key)
        self.references[key] = median if reference is None else min(reference, median)
        if self._trial is not None:
            self._end_trial(median, bucket)
        elif self.n > 1 and reference is not None and median > SLOWER * reference:
            self._try(self.n - 1, median,
                      f"tokens came {median / reference:.1f}x slower than on "
                      f"{self.n} threads before")
        elif self.n < self.most:
            self._since_retry += WINDOW_STEPS
            if self._since_retry >= self._retry_every:
                self._try(self.n + 1, median, "trying more again")

    def _try(self, n: int, median: float, why: str) -> None:
        self._trial = (self.n, median)
        self.changes.append(f"tried {n} (from {self.n}: {why})")
        self._switch(n)

    def _end_trial(self, median: float, bucket: int) -> None:
        assert self._trial is not None
        before, before_median = self._trial
        self._trial = None
        self._since_retry = 0
        if median < before_median:
            self.changes.append(f"kept {self.n} ({before_median / median:.2f}x faster)")
            if self.n > before:
                self._retry_every = RETRY_STEPS
            return
        if self.n > before:
            self._retry_every *= 2
        else:  # fewer did not pay: the slowdown is the context's or the machine's alike
            self.references[(before, bucket)] = before_median
        self.changes.append(f"back to {before}")
        self._switch(before)

    def _switch(self, n: int) -> None:
        self.n = n
        self.set_threads(n)


class ThreadFollower:
    """Watches the machine between answers and says how many threads the next answer
    should decode with (``most`` when nothing competes), from the last seconds before it
    begins (RecentLoad): the machine as the answer meets it."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.choice = ThreadChoice(most, f"{most} threads: not looked yet")
        self._watch: RecentLoad | None = None
        self._references: dict[tuple[int, int], float] = {}  # AnswerThreads' references

    def at_start(self) -> ThreadChoice:
        """The threads for opening the model, from a quick look at the machine now."""
        self.choice = threads_for(look_at_load(self.most, START_LOOK_S), self.most)
        return self.choice

    def idle(self) -> None:
        """An answer ended: watch the machine until the next begins."""
        if self._watch is None:
            self._watch = RecentLoad(self.most)

    def next_answer(self) -> ThreadChoice:
        """The threads for the answer that begins now."""
        watch, self._watch = self._watch, None
        if watch is not None:
            reading = watch.read()
            if reading.wall_s >= MIN_LOOK_S:
                self.choice = threads_for(reading, self.most)
        return self.choice

    def during_answer(self, set_threads: Callable[[int], None]) -> AnswerThreads | None:
        """The in-answer tuner for the answer ``next_answer`` began (None with one thread
        at most)."""
        if self.most < 2:
            return None
        return AnswerThreads(self.choice.n_threads, self.most, self._references, set_threads)

    def after_answer(self, tuner: AnswerThreads | None) -> None:
        """The answer ended: its last thread count, and why, become the choice shown."""
        if tuner is not None and tuner.changes:
            before = self.choice.why.split(DURING)[0]  # one answer's changes, not all
            self.choice = ThreadChoice(tuner.n, f"{before}{DURING}"
                                       f"{'; '.join(tuner.changes[-3:])}")

    def close(self) -> None:
        """Stops watching (the engine closes)."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
