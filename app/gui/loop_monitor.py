"""How late the GUI event loop runs while the engine generates (it must never block)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from PySide6.QtCore import QObject, Qt, QTimer


@dataclass(frozen=True)
class LoopLag:
    """Lateness of a timer tick past its due time, over one recording."""

    n_ticks: int
    max_ms: float
    p95_ms: float
    mean_ms: float

    def describe(self) -> str:
        if not self.n_ticks:
            return "not measured yet"
        return (f"max {self.max_ms:.0f} ms, p95 {self.p95_ms:.0f} ms "
                f"over {self.n_ticks} ticks")


class LoopLagMonitor(QObject):
    """Ticks every ``interval_ms`` and records how late each tick fires while recording.

    A tick that comes late means the GUI thread was busy (painting, parsing Markdown, or
    something blocking it): the UI would have stuttered by that much.
    """

    def __init__(self, interval_ms: int = 15, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.interval_ms = interval_ms
        self._timer = QTimer(self)
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._tick)
        self._last = 0.0
        self._lateness_ms: list[float] = []
        self.last = LoopLag(0, 0.0, 0.0, 0.0)

    def start(self) -> None:
        """Begin a recording (the previous one is kept in ``last`` until ``stop``)."""
        self._lateness_ms = []
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> LoopLag:
        """End the recording; returns it and keeps it in ``last``."""
        self._timer.stop()
        self.last = self.current()
        return self.last

    @property
    def running(self) -> bool:
        return self._timer.isActive()

    def current(self) -> LoopLag:
        xs = sorted(self._lateness_ms)
        if not xs:
            return LoopLag(0, 0.0, 0.0, 0.0)
        p95 = xs[min(len(xs) - 1, int(0.95 * len(xs)))]
        return LoopLag(len(xs), xs[-1], p95, sum(xs) / len(xs))

    def _tick(self) -> None:
        now = time.perf_counter()
        late = (now - self._last) * 1000.0 - self.interval_ms
        self._lateness_ms.append(max(0.0, late))
        self._last = now
