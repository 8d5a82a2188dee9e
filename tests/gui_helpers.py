"""Helpers for the GUI tests: a real window on the real bundled model, offscreen."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

from PySide6.QtCore import Qt  # noqa: E402

from app.gui.main_window import MainWindow  # noqa: E402

ANSWER_TIMEOUT_MS = 120_000


def open_window(qtbot, db: Path, model: Path, max_tokens: int = 24) -> MainWindow:  # noqa: ANN001
    """A shown window with its engine loaded and the current chat's max tokens set
    through the settings panel, as a user would."""
    w = MainWindow(db, default_model=model, n_threads=2)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(lambda: w.controller.engine_ready, timeout=ANSWER_TIMEOUT_MS)
    w.settings_panel.max_tokens.setValue(max_tokens)
    return w


def type_and_send(qtbot, w: MainWindow, text: str) -> None:  # noqa: ANN001
    qtbot.keyClicks(w.chat.composer, text)
    qtbot.keyClick(w.chat.composer, Qt.Key.Key_Return)


def send_and_wait(qtbot, w: MainWindow, text: str):  # noqa: ANN001, ANN201
    """Send ``text`` from the composer; returns the GenerationOutcome."""
    with qtbot.waitSignal(w.controller.answer_finished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        type_and_send(qtbot, w, text)
    return blocker.args[0]


def select_row(w: MainWindow, row: int) -> None:
    w.chat.transcript.setCurrentIndex(w.transcript.index(row))
