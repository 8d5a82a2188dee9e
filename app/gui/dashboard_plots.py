"""The dashboard's charts (pyqtgraph): acceptance by depth, timeline, comparison."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QWidget

from app.gui import theme

pg.setConfigOptions(antialias=True)

DRAFT_COLOR = "#f0a030"
VERIFY_COLOR = "#4a86e8"
CORE_COLORS = ["#2e7d32", "#8e24aa", "#00838f", "#c62828", "#6d4c41", "#546e7a",
               "#ad1457", "#283593"]
# The phase bands sit under the 0-100 % utilisation scale.
DRAFT_BAND = (-12.0, -3.0)
VERIFY_BAND = (-24.0, -15.0)


def _setup(plot: pg.PlotWidget, title: str, min_height: int = 150) -> None:
    """A static chart: no mouse zoom, no context menu, no auto-range button."""
    plot.setTitle(title, size="10pt")
    plot.setMenuEnabled(False)
    plot.setMouseEnabled(x=False, y=False)
    plot.hideButtons()
    plot.setMinimumHeight(min_height)


def _follow_theme() -> None:
    """Plots made from now on in the system's light or dark colours."""
    colors = theme.current()
    pg.setConfigOptions(background=colors.plot_background, foreground=colors.plot_foreground)


class AcceptancePlot(pg.PlotWidget):
    """Accepted draft tokens at each draft position (1 = the first drafted token)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        _follow_theme()
        super().__init__(parent=parent)
        _setup(self, "Accepted drafts by draft position", 170)
        self.setMaximumHeight(200)
        self.setLabel("bottom", "draft position")
        self.setLabel("left", "accepted")
        self._bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush=DRAFT_COLOR)
        self.addItem(self._bars)

    def set_counts(self, counts: list[int]) -> None:
        n = max([i + 1 for i, c in enumerate(counts) if c] or [1])
        n = max(n, 4)
        x = np.arange(1, n + 1)
        heights = np.array((counts + [0] * n)[:n], dtype=float)
        self._bars.setOpts(x=x, height=heights)
        self.setXRange(0.4, n + 0.6, padding=0)
        self.setYRange(0, max(1.0, heights.max()) * 1.1, padding=0)
        self.getAxis("bottom").setTicks([[(i, str(i)) for i in x]])


class TimelinePlot(pg.PlotWidget):
    """CPU use per core (and GPU) over the last answer, with draft and verify phases."""

    def __init__(self, parent: QWidget | None = None) -> None:
        _follow_theme()
        super().__init__(parent=parent)
        _setup(self, "CPU per core during the answer", 240)
        self.setMaximumHeight(280)
        self.setXRange(0, 5, padding=0)
        self.setLabel("bottom", "seconds since the request")
        self.setLabel("left", "utilisation %")
        self.setYRange(VERIFY_BAND[0] - 2, 105, padding=0)
        self.getAxis("left").setTicks([[(0, "0"), (50, "50"), (100, "100"),
                                        (sum(DRAFT_BAND) / 2, "draft"),
                                        (sum(VERIFY_BAND) / 2, "verify")]])
        self.legend = self.addLegend(offset=(-5, 5), labelTextSize="8pt")
        self._cores: list[pg.PlotDataItem] = []
        self._gpu = self.plot([], [], pen=pg.mkPen(theme.current().plot_foreground, width=2,
                                                   style=Qt.PenStyle.DashLine))
        self._gpu_in_legend = False
        self._draft = pg.BarGraphItem(x0=[], x1=[], y0=DRAFT_BAND[0], y1=DRAFT_BAND[1],
                                      brush=DRAFT_COLOR, pen=None)
        self._verify = pg.BarGraphItem(x0=[], x1=[], y0=VERIFY_BAND[0], y1=VERIFY_BAND[1],
                                       brush=VERIFY_COLOR, pen=None)
        self.addItem(self._draft)
        self.addItem(self._verify)
        self._gpu_shown: bool | None = None

    def set_data(self, t0: float, samples: list[tuple[float, list[float], float | None]],
             phases: list[tuple[float, float, float]], gpu: bool) -> None:
        """``samples``: (time, per-core %, gpu % or None); ``phases``: (draft start,
        verify start, end); all perf_counter seconds, shown relative to ``t0``."""
        n_cores = len(samples[0][1]) if samples else 0
        while len(self._cores) < n_cores:
            i = len(self._cores)
            color = CORE_COLORS[i % len(CORE_COLORS)]
            self._cores.append(self.plot([], [], pen=pg.mkPen(color, width=1.5),
                                         name=f"core {i}"))
        t = np.array([s[0] - t0 for s in samples])
        for i, curve in enumerate(self._cores):
            curve.setData(t, np.array([s[1][i] for s in samples]) if n_cores else [])
        gpu_points = [(s[0] - t0, s[2]) for s in samples if s[2] is not None]
        self._gpu.setData([p[0] for p in gpu_points], [p[1] for p in gpu_points])
        if gpu != self._gpu_shown:
            self._gpu_shown = gpu
            self.setTitle("CPU per core and GPU during the answer" if gpu else
                          "CPU per core during the answer (no GPU)", size="10pt")
        if gpu and not self._gpu_in_legend:
            self.legend.addItem(self._gpu, "GPU")
            self._gpu_in_legend = True
        if phases:
            ph = np.array(phases) - t0
            self._draft.setOpts(x0=ph[:, 0], x1=ph[:, 1])
            self._verify.setOpts(x0=ph[:, 1], x1=ph[:, 2])
        else:
            self._draft.setOpts(x0=[], x1=[])
            self._verify.setOpts(x0=[], x1=[])
        t_end = max([p[2] - t0 for p in phases] + [t[-1] if len(t) else 0.0, 1.0])
        self.setXRange(0, t_end, padding=0.02)


class ComparisonPlot(pg.PlotWidget):
    """tok/s with the drafter and with plain decoding, side by side."""

    def __init__(self, parent: QWidget | None = None) -> None:
        _follow_theme()
        super().__init__(parent=parent)
        _setup(self, "Same prompt: drafter vs plain decoding", 170)
        self.setMaximumHeight(200)
        self.setLabel("left", "tok/s")
        self._bars = pg.BarGraphItem(x=[], height=[], width=0.6,
                                     brushes=[DRAFT_COLOR, VERIFY_COLOR])
        self.addItem(self._bars)
        self._labels: list[pg.TextItem] = []
        self.getAxis("bottom").setTicks([[]])

    def set_values(self, named: list[tuple[str, float]]) -> None:
        x = np.arange(len(named))
        heights = np.array([v for _, v in named], dtype=float)
        self._bars.setOpts(x=x, height=heights, brushes=[DRAFT_COLOR, "#8a8f98"][:len(x)])
        self.getAxis("bottom").setTicks([[(i, name) for i, (name, _) in enumerate(named)]])
        for item in self._labels:
            self.removeItem(item)
        self._labels = []
        for i, v in enumerate(heights):
            label = pg.TextItem(f"{v:.1f}", color=theme.current().plot_foreground,
                                anchor=(0.5, 1))
            label.setPos(i, v)
            self.addItem(label)
            self._labels.append(label)
        self.setXRange(-0.6, len(x) - 0.4, padding=0)
        self.setYRange(0, max(1.0, heights.max() if len(x) else 1.0) * 1.2, padding=0)
