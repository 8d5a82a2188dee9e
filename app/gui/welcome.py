"""What an empty chat shows: this computer in one line, that the model is ready, and a
few models that fit it (each a click from the download wizard)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QGridLayout, QLabel, QPushButton, QVBoxLayout, QWidget


class WelcomePanel(QWidget):
    """Emits ``get_requested(repo)`` when the user asks for a suggested model."""

    get_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.machine = QLabel()
        self.machine.setWordWrap(True)
        self.ready = QLabel("Loading the model…")
        self.ready.setWordWrap(True)
        self.ready.setStyleSheet("font-weight: bold;")
        self.more = QLabel()
        self.more.setWordWrap(True)
        self.rows = QGridLayout()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 16, 16, 16)
        layout.addWidget(self.machine)
        layout.addWidget(self.ready)
        layout.addWidget(self.more)
        layout.addLayout(self.rows)
        layout.addStretch(1)
        self.buttons: list[QPushButton] = []

    def show_engine(self, machine: str, model: str, suggested: tuple[tuple[str, str], ...]
                    ) -> None:
        """``suggested``: (description, repository) of models that fit this machine."""
        self.machine.setText(f"This computer: {machine}.")
        self.ready.setText(f"{model} is ready: type below to start.")
        self.more.setText("Models that fit this computer (File ▸ Get models… finds others):"
                          if suggested else "File ▸ Get models… finds more models.")
        while self.rows.count():
            item = self.rows.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self.buttons = []
        for row, (text, repo) in enumerate(suggested):
            label = QLabel(text)
            label.setWordWrap(True)
            button = QPushButton("Get…")
            button.setToolTip(f"Opens the download wizard on {repo}")
            button.clicked.connect(lambda _=False, r=repo: self.get_requested.emit(r))
            self.rows.addWidget(label, row, 0)
            self.rows.addWidget(button, row, 1, Qt.AlignmentFlag.AlignTop)
            self.buttons.append(button)
        self.rows.setColumnStretch(0, 1)
