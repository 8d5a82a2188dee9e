"""Light and dark following the system: on a dark palette the chat's surfaces are dark
(light text on dark cards), on a light one light (app.gui.theme)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtGui import QColor  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.gui import theme  # noqa: E402
from tests.gui_helpers import open_window, send_and_wait  # noqa: E402


@pytest.fixture
def dark(qapp):  # noqa: ANN001, ANN201
    light = qapp.palette()
    qapp.setPalette(theme.dark_palette())
    yield
    qapp.setPalette(light)


def _share_dark(image) -> float:  # noqa: ANN001
    """The share of sampled pixels that are dark."""
    dark = total = 0
    for x in range(0, image.width(), 7):
        for y in range(0, image.height(), 7):
            total += 1
            dark += QColor(image.pixel(x, y)).lightness() < 90
    return dark / total


def test_the_theme_follows_the_palette(qapp) -> None:  # noqa: ANN001
    assert theme.current() is theme.LIGHT or theme.system_is_dark()
    qapp.setPalette(theme.dark_palette())
    try:
        assert theme.current() is theme.DARK
        assert theme.follow_system(QApplication.instance()) is theme.DARK
    finally:
        qapp.setPalette(QApplication.style().standardPalette())


def test_a_dark_system_gets_a_dark_chat(qtbot, tmp_path: Path, model_path: Path,  # noqa: ANN001
                                         dark) -> None:  # noqa: ANN001
    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path, max_tokens=8)
    send_and_wait(qtbot, w, "Hello")
    image = w.chat.transcript.viewport().grab().toImage()
    assert _share_dark(image) > 0.8  # the background and both cards
    # The cards' text is the palette's light text.
    text = w.chat.transcript.palette().color(w.chat.transcript.foregroundRole())
    assert text.lightness() > 150
