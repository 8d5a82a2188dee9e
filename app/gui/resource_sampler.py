"""CPU (per core) and GPU utilisation sampled on a timer, for the dashboard timeline."""

from __future__ import annotations

import time
from collections import deque

import psutil
from PySide6.QtCore import QObject, QTimer, Signal


class ResourceSampler(QObject):
    """Samples every ``interval_ms`` into a ring buffer of ``(perf_counter, cpu_per_core,
    gpu_percent | None)``. ``psutil.cpu_percent(interval=None)`` does not block: it
    reports the use since the previous call."""

    sampled = Signal()

    def __init__(self, interval_ms: int = 100, keep_s: float = 120.0,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.samples: deque[tuple[float, list[float], float | None]] = deque(
            maxlen=int(keep_s * 1000 / interval_ms))
        self.n_cores = psutil.cpu_count() or 1
        self.gpu_available = False
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._sample)
        psutil.cpu_percent(percpu=True)  # primes the "since previous call" baseline

    def start(self) -> None:
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def set_gpu_available(self, available: bool) -> None:
        """Told by the engine (which imports torch off the GUI thread)."""
        self.gpu_available = available

    def _sample(self) -> None:
        self.samples.append((time.perf_counter(), psutil.cpu_percent(percpu=True),
                             self._gpu_percent()))
        self.sampled.emit()

    def _gpu_percent(self) -> float | None:
        if not self.gpu_available:
            return None
        try:
            import torch

            return float(torch.cuda.utilization())
        except Exception:  # torch.cuda.utilization needs pynvml; absent means unknown
            return None
