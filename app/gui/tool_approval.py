"""The bar above the composer that asks before a tool runs: which tool, which server,
with which arguments; Allow once, Always allow this tool, or Refuse."""

from __future__ import annotations

import json
from html import escape

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.gui import theme
from app.gui.tool_loop import PendingCall

MAX_ARGS_CHARS = 400  # shown; the tooltip has them all
ARM_MS = 600  # the buttons take clicks this long after the bar appears


class ToolApprovalBar(QFrame):
    approved = Signal(bool)  # always: this tool never asks again
    refused = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("toolApproval")
        self.setStyleSheet(f"#toolApproval {{ background: {theme.current().banner}; "
                           "border-radius: 4px; }")
        self.question = QLabel()
        self.question.setWordWrap(True)
        self.question.setTextFormat(Qt.TextFormat.RichText)
        self.question.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.allow_button = QPushButton("Allow once")
        self.always_button = QPushButton("Always allow")
        self.refuse_button = QPushButton("Refuse")
        self.allow_button.clicked.connect(lambda: self.approved.emit(False))
        self.always_button.clicked.connect(lambda: self.approved.emit(True))
        self.refuse_button.clicked.connect(self.refused)
        self._buttons = (self.allow_button, self.always_button, self.refuse_button)
        for b in self._buttons:
            b.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for b in (self.allow_button, self.always_button, self.refuse_button):
            buttons.addWidget(b)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.addWidget(self.question)
        layout.addLayout(buttons)
        self.hide()

    def show_call(self, pending: PendingCall | None) -> None:
        """Ask about ``pending``; None hides the bar."""
        if pending is None:
            self.hide()
            return
        call = pending.call
        args = json.dumps(call.get("arguments", {}), ensure_ascii=False, indent=None)
        if len(args) > MAX_ARGS_CHARS:
            args = args[:MAX_ARGS_CHARS - 1] + "…"
        tool = escape(str(call.get("tool", "")))
        self.question.setText(
            f"The model wants to run <b>{tool}</b> of the server "
            f"<i>{escape(str(call.get('server', '')))}</i> with "
            f"<code>{escape(args)}</code>. It runs with your rights on this computer.")
        # All of them, however long; escaped, as a tooltip reads text that looks like
        # markup as HTML.
        full = json.dumps(call.get("arguments", {}), ensure_ascii=False, indent=1)
        self.question.setToolTip(f"<pre>{escape(full)}</pre>")
        self.always_button.setText(f"Always allow {call.get('tool', '')}")
        # The buttons wake after a moment and never take the focus: a key pressed while
        # typing the next message cannot approve a call no one read.
        for b in self._buttons:
            b.setEnabled(False)
        self.show()
        QTimer.singleShot(ARM_MS, self._arm)

    def _arm(self) -> None:
        for b in self._buttons:
            b.setEnabled(True)
