"""The first start's progress bar: what the engine measures on this machine, how far it
is and about how long is left (engine.planning.measure_progress)."""

from __future__ import annotations

from PySide6.QtWidgets import QProgressBar, QWidget

from engine.planning.measure_progress import Measuring

STEPS = 1000  # the bar's range: 0.1% a step


def time_left_text(seconds: float | None) -> str:
    """``seconds`` left, in round words: "about 40 s left", "about 2 min left"."""
    if seconds is None:
        return "estimating the time left"
    if seconds < 10:
        return "a few seconds left"
    if seconds < 60:
        return f"about {max(10, 5 * round(seconds / 5))} s left"
    return f"about {round(seconds / 60)} min left"


def measure_text(progress: Measuring) -> str:
    """What the bar says: what is measured and the time left; then that it plans."""
    if progress.done >= 1.0:
        return f"{progress[:1].upper()}{progress[1:]}…"
    return f"Measuring {progress} · {time_left_text(progress.seconds_left)}"


class MeasureBar(QProgressBar):
    """Hidden until the engine reports a measurement; ``finish`` hides it again (the
    engine is ready, or the load failed)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setRange(0, STEPS)
        self.setTextVisible(True)
        self.hide()

    def show_progress(self, progress: Measuring) -> None:
        text = measure_text(progress)
        self.setValue(round(progress.done * STEPS))
        self.setFormat(text)
        self.setToolTip(text)  # styles that draw no text on the bar (macOS)
        self.show()

    def finish(self) -> None:
        self.hide()
        self.reset()
