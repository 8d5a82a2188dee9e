"""How busy the rest of the machine was while Tandem measured something.

Every CPU cost Tandem measures (a decode, a draft head level) stretches when other
programs take the cores: a laptop's first start is often during indexing or updates. The
meter reads the whole machine's CPU time and this process's own over a span; what is
left is other programs' use, in cores. A measurement is trusted when the others fitted
in the cores the target leaves free (plus a quarter of a core of background noise: a
browser tab, a terminal).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import psutil

# Other programs' average use, in cores, that a measurement tolerates beyond the cores
# the target does not use. An idle desktop uses a small fraction of a core; a second
# decode, a build or an indexer takes 1 or more (docs/benchmarks.md: figures behind the
# code's rules, "Measuring on a busy machine").
BUSY_MARGIN_CORES = 0.25
QUICK_LOOK_S = 0.3  # a look at the machine before deciding to measure again


@dataclass(frozen=True)
class _CpuTimes:
    """CPU seconds, summed over the logical cores."""

    busy: float  # all of it (guest time is inside user time on Linux: not added again)
    user: float  # user time at normal priority or above
    niced: float  # user time of niced processes (they give way to ours)
    system: float  # kernel time, whatever the priority

    def __sub__(self, earlier: _CpuTimes) -> _CpuTimes:
        return _CpuTimes(self.busy - earlier.busy, self.user - earlier.user,
                         self.niced - earlier.niced, self.system - earlier.system)


def _machine_busy_s() -> _CpuTimes:
    t = psutil.cpu_times()
    niced = getattr(t, "nice", 0.0)
    busy = t.user + t.system + niced
    for extra in ("irq", "softirq", "steal"):  # steal: a hypervisor gave our core away
        busy += getattr(t, extra, 0.0)
    return _CpuTimes(busy, t.user, niced, t.system)


# Processes whose CPU time is this engine's own work: a worker on this machine computes
# the target's layers, so its busy cores are the measurement, not another program's.
# TANDEM_HELPER_PIDS names more (comma-separated): a worker behind a relay, which the
# listener on the endpoint does not lead to.
_HELPERS: set[int] = {int(p) for p in os.environ.get("TANDEM_HELPER_PIDS", "").split(",")
                      if p.strip().isdigit()}


def count_as_own(pid: int) -> None:
    """Count ``pid``'s CPU time as this process's in every later reading."""
    _HELPERS.add(pid)


def _own_busy_s(process: psutil.Process) -> tuple[float, float]:
    """This process's (and its helpers') user and kernel seconds."""
    t = process.cpu_times()
    user, system = t.user, t.system
    for pid in list(_HELPERS):
        try:
            h = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            _HELPERS.discard(pid)
            continue
        user, system = user + h.user, system + h.system
    return user, system


def niced_share(machine: _CpuTimes, own_user: float, own_system: float,
                own_niced: bool) -> float:
    """Other programs' CPU seconds at a lower priority than ours, from the machine's
    times over a span (``machine``: differences) and ours. Linux splits user time by
    priority but not kernel time, so other programs' kernel time is shared out as their
    user time is: a niced compile's system calls give way to us too."""
    niced_user = machine.niced - (own_user if own_niced else 0.0)
    plain_user = machine.user - (0.0 if own_niced else own_user)
    others_system = machine.system - own_system
    niced_user, plain_user = max(0.0, niced_user), max(0.0, plain_user)
    share = niced_user / (niced_user + plain_user) if niced_user > 0 else 0.0
    return niced_user + max(0.0, others_system) * share


@dataclass(frozen=True)
class LoadReading:
    """Other programs' CPU use over a span."""

    others_cores: float  # their average use, in cores
    wall_s: float
    spare_cores: float  # physical cores the measured work left free
    niced_cores: float = 0.0  # the part at a lower priority than ours (they give way)

    @property
    def competing_cores(self) -> float:
        """Other programs' use at our priority or above: cores they hold against ours."""
        return max(0.0, self.others_cores - self.niced_cores)

    @property
    def busy(self) -> bool:
        return self.others_cores > self.spare_cores + BUSY_MARGIN_CORES

    def describe(self) -> str:
        state = "busy" if self.busy else "quiet"
        return f"{state} (other programs used {self.others_cores:.2f} cores)"


@dataclass(frozen=True)
class _Snapshot:
    """The machine's and this process's CPU times at one moment."""

    at: float  # time.perf_counter()
    machine: _CpuTimes
    own: tuple[float, float]  # this process's (and its helpers') user and kernel seconds


def _snapshot(process: psutil.Process) -> _Snapshot:
    return _Snapshot(time.perf_counter(), _machine_busy_s(), _own_busy_s(process))


def _reading_between(first: _Snapshot, last: _Snapshot, spare_cores: float) -> LoadReading:
    """Other programs' use from ``first`` to ``last``."""
    wall = max(1e-6, last.at - first.at)
    machine = last.machine - first.machine
    own_user, own_system = last.own[0] - first.own[0], last.own[1] - first.own[1]
    others = machine.busy - own_user - own_system
    # (a niced Tandem's own user time is in the niced column)
    niced = niced_share(machine, own_user, own_system,
                        os.getpriority(os.PRIO_PROCESS, 0) > 0)
    # The clocks tick at different moments: a tiny negative is zero.
    return LoadReading(max(0.0, others) / wall, wall, spare_cores,
                       min(max(0.0, niced), max(0.0, others)) / wall)


def _spare_cores(n_threads: int) -> int:
    physical = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    return max(0, physical - n_threads)


class LoadMeter:
    """``with LoadMeter(n_threads) as meter: ...``; then ``meter.reading``."""

    def __init__(self, n_threads: int) -> None:
        self.spare_cores = _spare_cores(n_threads)
        self._process = psutil.Process()
        self.reading: LoadReading | None = None

    def __enter__(self) -> LoadMeter:
        self._first = _snapshot(self._process)
        return self

    def __exit__(self, *exc: object) -> None:
        self.reading = self.read()

    def read(self) -> LoadReading:
        """Other programs' use since the meter started (it goes on)."""
        return _reading_between(self._first, _snapshot(self._process), self.spare_cores)


class RecentLoad:
    """Other programs' use over the last ``recent_s`` seconds before ``read()``, however
    long it watched: a compile that ended a minute ago says nothing about the next answer,
    and a load that began a second ago does. A daemon thread takes a snapshot every
    ``step_s`` (a read of /proc/stat, microseconds) and keeps the recent ones."""

    def __init__(self, n_threads: int, recent_s: float = 2.0, step_s: float = 0.5) -> None:
        self.spare_cores = _spare_cores(n_threads)
        self._process = psutil.Process()
        self._step_s = step_s
        self._kept: deque[_Snapshot] = deque(maxlen=max(2, round(recent_s / step_s) + 1))
        self._kept.append(_snapshot(self._process))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tandem-load-watch",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._step_s):
            self._kept.append(_snapshot(self._process))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def read(self) -> LoadReading:
        """Stops watching; other programs' use from the oldest snapshot kept to now."""
        self.stop()
        return _reading_between(self._kept[0], _snapshot(self._process), self.spare_cores)


def look_at_load(n_threads: int, seconds: float = QUICK_LOOK_S) -> LoadReading:
    """Other programs' use over the next ``seconds`` (this process idles meanwhile)."""
    with LoadMeter(n_threads) as meter:
        time.sleep(seconds)
    assert meter.reading is not None
    return meter.reading
