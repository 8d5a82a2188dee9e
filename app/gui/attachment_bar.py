"""The chips above the message box: the documents the next message takes along (name,
kind and size, an × to take one off) and the files still being read (an × stops the
read)."""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QWidget

from app.documents.reading import Document
from app.gui import theme
from app.gui.paper_clip import paper_clip_pixmap

KIND_NAMES = {"text": "text", "markdown": "Markdown", "code": "code", "pdf": "PDF",
              "docx": "Word", "html": "web page"}


def size_text(n_chars: int) -> str:
    if n_chars >= 1_000_000:
        return f"{n_chars / 1_000_000:.1f}M characters"
    if n_chars >= 10_000:
        return f"{n_chars // 1000}k characters"
    return f"{n_chars:,} characters"


def describe(doc: Document) -> str:
    """What a chip says under the name: "PDF, 12 pages" or "Markdown, 3,400 characters"."""
    kind = KIND_NAMES.get(doc.kind, doc.kind)
    if doc.pages:
        n = len(doc.pages)
        return f"{kind}, {n} page{'s' if n != 1 else ''}"
    return f"{kind}, {size_text(doc.n_chars)}"


class Chip(QFrame):
    """One rounded label, with an × when it can be removed."""

    removed = Signal()

    def __init__(self, title: str, detail: str, removable: bool,
                 parent: QWidget | None = None, remove_tip: str = "") -> None:
        super().__init__(parent)
        colors = theme.current()
        self.setObjectName("chip")
        self.setStyleSheet(f"QFrame#chip {{ background: {colors.user_card}; border: 1px solid "
                           f"{colors.border}; border-radius: 9px; }}")
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 2, 4, 2)
        row.setSpacing(4)
        clip = QLabel()
        clip.setPixmap(paper_clip_pixmap(theme.color("muted"), 14))
        row.addWidget(clip)
        self.label = QLabel(f"<b>{escape(title)}</b> <span style='color:{colors.muted}'>"
                            f"{escape(detail)}</span>")
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setToolTip(f"{title} ({detail})")
        row.addWidget(self.label)
        self.remove_button: QToolButton | None = None
        if removable:
            self.remove_button = QToolButton()
            self.remove_button.setText("×")
            self.remove_button.setAutoRaise(True)
            self.remove_button.setToolTip(remove_tip or f"Do not send {title}")
            self.remove_button.clicked.connect(self.removed)
            row.addWidget(self.remove_button)


class AttachmentBar(QWidget):
    """Hidden while nothing is attached; ``remove_requested(i)`` asks to drop the i-th
    pending document, ``cancel_reading_requested(i)`` to stop reading the i-th file."""

    remove_requested = Signal(int)
    cancel_reading_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.row = QHBoxLayout(self)
        self.row.setContentsMargins(0, 2, 0, 2)
        self.row.setSpacing(6)
        self.chips: list[Chip] = []
        self._documents: list[Document] = []
        self._reading: list[str] = []
        self.setVisible(False)

    @property
    def n_documents(self) -> int:
        return len(self._documents)

    def set_documents(self, documents: list[Document]) -> None:
        self._documents = list(documents)
        self._rebuild()

    def set_reading(self, names: list[str]) -> None:
        self._reading = list(names)
        self._rebuild()

    def _rebuild(self) -> None:
        for chip in self.chips:
            self.row.removeWidget(chip)
            chip.deleteLater()
        self.chips = []
        while self.row.count():  # the stretch
            self.row.takeAt(0)
        for i, doc in enumerate(self._documents):
            chip = Chip(doc.name, describe(doc), removable=True)
            chip.removed.connect(lambda i=i: self.remove_requested.emit(i))
            self.chips.append(chip)
        for i, name in enumerate(self._reading):
            chip = Chip(name, "reading…", removable=True, remove_tip=f"Stop reading {name}")
            chip.removed.connect(lambda i=i: self.cancel_reading_requested.emit(i))
            self.chips.append(chip)
        for chip in self.chips:
            self.row.addWidget(chip)
        self.row.addStretch(1)
        self.setVisible(bool(self.chips))
