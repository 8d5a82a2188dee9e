"""The window on a laptop: it opens inside the screen, chat first, and every visible label
and button shows its whole text at 1366x768 and 1920x1080, with the settings and the
dashboard open too (app.gui.window_fit)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QRect  # noqa: E402
from PySide6.QtWidgets import QLabel, QScrollArea, QWidget  # noqa: E402

from app.gui.window_fit import MINIMUM, cut_texts, initial_geometry, outside  # noqa: E402
from tests.gui_helpers import open_window, send_and_wait  # noqa: E402

SCREENS = [QRect(0, 0, 1366, 768), QRect(0, 0, 1366, 728),  # a task bar below
           QRect(0, 28, 1280, 772),  # a menu bar above (macOS)
           QRect(0, 0, 1920, 1080), QRect(0, 0, 2560, 1440),
           QRect(0, 0, 1920, 1050)]  # a 4K screen at 200%: logical pixels


@pytest.mark.parametrize("screen", SCREENS, ids=lambda r: f"{r.width()}x{r.height()}")
def test_the_window_opens_inside_the_screens_available_area(screen: QRect) -> None:
    g = initial_geometry(screen)
    title_bar = 30
    assert screen.contains(g.adjusted(0, -title_bar, 0, 0)), (g.getRect(), screen.getRect())
    assert g.width() >= MINIMUM.width() and g.height() >= MINIMUM.height()
    if screen.width() >= 1920:  # room to spare: not a small window in a corner
        assert g.width() >= 0.7 * screen.width()


def test_cut_texts_finds_a_label_or_button_too_small_for_its_text(qtbot) -> None:  # noqa: ANN001
    root = QWidget()
    qtbot.addWidget(root)
    root.resize(400, 200)
    label = QLabel("A sentence that is far too long for forty pixels", root)
    label.setGeometry(0, 0, 40, 20)
    fine = QLabel("ok", root)
    fine.setGeometry(0, 30, 100, 20)
    area = QScrollArea(root)  # a row wider than its panel: clipped sideways
    area.setGeometry(0, 60, 120, 100)
    inner = QWidget()
    wide = QLabel("This row is three hundred pixels wide", inner)
    wide.setGeometry(0, 0, 300, 20)
    inner.resize(300, 40)
    area.setWidget(inner)
    root.show()
    found = cut_texts(root)
    assert len(found) == 2 and "far too long" in found[0] and "past the side" in found[1]
    label.setGeometry(0, 0, 380, 20)
    inner.resize(100, 40)
    wide.setGeometry(0, 0, 100, 20)
    wide.setText("short")
    assert cut_texts(root) == []


@pytest.mark.parametrize("screen", [QRect(0, 0, 1366, 768), QRect(0, 0, 1920, 1080)],
                         ids=["1366x768", "1920x1080"])
def test_every_text_fits_at_laptop_sizes(qtbot, tmp_path: Path, model_path: Path,  # noqa: ANN001
                                         screen: QRect) -> None:
    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path)
    w.setGeometry(initial_geometry(screen))
    # Chat first: conversations, the model and drafter above the chat; the rest folded.
    assert not w.settings_drawer.isVisible() and not w.dashboard_dock.isVisible()
    assert w.engine_panel.model_box.isVisible() and w.engine_panel.drafter_box.isVisible()
    send_and_wait(qtbot, w, "Name three colours of the rainbow.")
    views = {"chat": lambda: None,
             "settings": lambda: w.settings_toggle.setChecked(True),
             "dashboard": lambda: (w.settings_toggle.setChecked(False),
                                   w.dashboard_toggle.setChecked(True),
                                   w.dashboard.details_button.setChecked(True))}
    for name, show in views.items():
        show()
        qtbot.wait(200)
        assert cut_texts(w) == [], name
        assert outside(w, [w.chat.composer, w.chat.send_button]) == [], name
    assert w.dashboard_dock.isVisible() and w.dashboard.plan_details.isVisible()
    summary = w.dashboard.plan_summary.text()
    assert summary.endswith(".") and "tiled_matmul" not in summary  # words, not kernels


def test_ctrl_k_opens_the_model_picker(qtbot, tmp_path: Path, model_path: Path) -> None:  # noqa: ANN001
    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path)
    w.open_model_picker()
    qtbot.waitUntil(lambda: w.engine_panel.model_box.view().isVisible(), timeout=5000)
    w.engine_panel.model_box.hidePopup()
