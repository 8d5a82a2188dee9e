"""The first start's progress bar, offscreen in the real window: what the engine
measures and about how long is left while the worker reports a measurement, hidden once
the engine is ready or the load failed."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from app.gui.engine_worker import EngineFailure, EngineWorker  # noqa: E402
from app.gui.measure_bar import time_left_text  # noqa: E402
from engine.planning.measure_progress import MEASURED, Measuring  # noqa: E402
from tests.gui_helpers import open_window  # noqa: E402

pytest.importorskip("pytestqt")


def test_time_left_in_round_words() -> None:
    assert time_left_text(None) == "estimating the time left"
    assert time_left_text(4.0) == "a few seconds left"
    assert time_left_text(38.0) == "about 40 s left"
    assert time_left_text(11.0) == "about 10 s left"
    assert time_left_text(100.0) == "about 2 min left"


def test_the_worker_passes_a_measurement_on_as_a_signal_and_a_status(qtbot) -> None:  # noqa: ANN001
    worker = EngineWorker()
    measured: list[object] = []
    statuses: list[str] = []
    worker.measuring.connect(measured.append)
    worker.status.connect(statuses.append)
    worker._progress("checking that verified batches match one-token decoding")
    worker._progress(Measuring("target verification cost", 0.3, 3.0))
    assert len(measured) == 1 and measured[0].done == 0.3
    assert statuses == ["Checking that verified batches match one-token decoding…",
                        "Target verification cost…"]


def test_the_bar_shows_what_is_measured_and_the_time_left_then_hides(
        qtbot, tmp_path: Path, model_path: Path) -> None:  # noqa: ANN001
    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path)
    bar = w.engine_panel.measure_bar
    assert bar.isHidden()  # the engine is ready
    w.worker.measuring.emit(Measuring("target verification cost", 0.0, 0.5))
    assert bar.isVisible() and "estimating the time left" in bar.format()
    w.worker.measuring.emit(Measuring("target verification cost", 0.5, 20.0))
    assert bar.isVisible()
    assert bar.format() == "Measuring target verification cost · about 20 s left"
    assert bar.value() == bar.maximum() // 2
    w.worker.measuring.emit(Measuring(MEASURED, 1.0, 40.0))
    assert bar.format() == "Planning from the measured costs…"
    w.worker.ready.emit(w.engine_info)
    assert bar.isHidden()
    # A load that fails mid-measurement hides it too.
    w.worker.measuring.emit(Measuring("draft head on cpu", 0.5, 60.0))
    assert bar.isVisible() and bar.format().endswith("about 1 min left")
    w.worker.failed.emit(EngineFailure(-1, "load", "the model file is gone"))
    assert bar.isHidden()
