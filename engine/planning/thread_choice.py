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


class ThreadFollower:
    """Watches the machine between answers and says how many threads the next answer
    should decode with (``most`` when nothing competes), from the last seconds before it
    begins (RecentLoad): the machine as the answer meets it."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.choice = ThreadChoice(most, f"{most} threads: not looked yet")
        self._watch: RecentLoad | None = None

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

    def close(self) -> None:
        """Stops watching (the engine closes)."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
