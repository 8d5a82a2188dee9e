"""The layout the app's serving switches share: a check box, a port, and a line saying
what is served where."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QCheckBox, QGroupBox, QHBoxLayout, QLabel, QSpinBox, QVBoxLayout

from app.conversation_store import ConversationStore


def port_box(store: ConversationStore, setting: str, default: int, lowest: int) -> QSpinBox:
    """A port spin box holding the port last used (``setting``), ``default`` before."""
    box = QSpinBox()
    box.setRange(lowest, 65535)
    port = store.get_setting(setting, default)
    box.setValue(port if isinstance(port, int) else default)
    return box


def lay_out_switch(group: QGroupBox, enabled: QCheckBox, port: QSpinBox) -> QLabel:
    """The check box and port on a row, the state line under them; returns that line."""
    state = QLabel("Off")
    state.setWordWrap(True)
    state.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    row = QHBoxLayout()
    row.addWidget(enabled, 1)
    row.addWidget(QLabel("Port"))
    row.addWidget(port)
    layout = QVBoxLayout(group)
    layout.addLayout(row)
    layout.addWidget(state)
    return state
