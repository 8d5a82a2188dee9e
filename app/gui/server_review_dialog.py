"""The yes before a tool server starts: each server to be added, with its command,
arguments, environment or URL and what it replaces (app.tools.server_review), a box to
tick for each, and nothing started or changed until the user presses Start.

Non-modal (``open``): the window keeps running and tests drive it like a user.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QLabel,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.gui import theme
from app.tools.server_config import ServerConfig
from app.tools.server_review import ServerReview

INTRO = ("Starting a tool server runs a program on this computer with your rights (it can "
         "read, change or send what you can), or sends what the model writes to a URL. "
         "Start only what you trust.")


def _default_ticked(item: ServerReview) -> bool:
    """Ticked unless something in it deserves a second look (a replaced server that is
    the same does not)."""
    return all(w.startswith("replaces the saved server") and w.endswith("which is the same")
               for w in item.warnings)


class ServerReviewDialog(QDialog):
    chosen = Signal(list)  # the ServerConfigs the user said yes to (never empty)

    def __init__(self, items: list[ServerReview], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Start tool servers?")
        self.items = items
        self.boxes: list[QCheckBox] = []
        body = QWidget()
        rows = QVBoxLayout(body)
        for item in items:
            box = QCheckBox(f"Start {item.name}")
            box.setChecked(_default_ticked(item))
            detail = QLabel("\n".join(item.lines))
            detail.setWordWrap(True)
            detail.setTextFormat(Qt.TextFormat.PlainText)
            rows.addWidget(box)
            rows.addWidget(detail)
            if item.warnings:
                warn = QLabel("\n".join(f"⚠ {w}" for w in item.warnings))
                warn.setWordWrap(True)
                warn.setTextFormat(Qt.TextFormat.PlainText)
                warn.setStyleSheet(f"color: {theme.current().note};")
                rows.addWidget(warn)
            self.boxes.append(box)
        rows.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(body)
        intro = QLabel(INTRO)
        intro.setWordWrap(True)
        self.buttons = QDialogButtonBox()
        self.start_button = self.buttons.addButton(
            "Start", QDialogButtonBox.ButtonRole.AcceptRole)
        self.buttons.addButton(QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self._start)
        self.buttons.rejected.connect(self.reject)
        for box in self.boxes:
            box.toggled.connect(self._enable_start)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addWidget(scroll, 1)
        layout.addWidget(self.buttons)
        self.resize(560, min(560, 160 + 110 * len(items)))
        self._enable_start()

    def ticked(self) -> list[ServerConfig]:
        return [item.config for item, box in zip(self.items, self.boxes, strict=True)
                if box.isChecked()]

    def text(self) -> str:
        """Everything the dialog says (the reviews), as plain text."""
        return "\n".join(item.text() for item in self.items)

    def _enable_start(self) -> None:
        self.start_button.setEnabled(bool(self.ticked()))

    def _start(self) -> None:
        configs = self.ticked()
        self.accept()
        if configs:
            self.chosen.emit(configs)
