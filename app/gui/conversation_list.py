"""The list of conversations (newest first) with New and Delete."""

from __future__ import annotations

from PySide6.QtCore import (
    QAbstractListModel,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    Qt,
    Signal,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLabel,
    QListView,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.conversation_store import Conversation

CONVERSATION_ROLE = Qt.ItemDataRole.UserRole + 1

_Index = QModelIndex | QPersistentModelIndex


class ConversationListModel(QAbstractListModel):
    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._items: list[Conversation] = []

    def rowCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._items)

    def data(self, index: _Index, role: int = Qt.ItemDataRole.DisplayRole) -> object:
        if not index.isValid() or not 0 <= index.row() < len(self._items):
            return None
        conv = self._items[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return f"⚠ {conv.title}" if conv.n_interrupted else conv.title
        if role == Qt.ItemDataRole.ToolTipRole:  # the whole title: the list elides it
            return conv.title + ("\nAn answer in this conversation was interrupted (Tandem "
                                 "closed mid-answer)." if conv.n_interrupted else "")
        if role == CONVERSATION_ROLE:
            return conv
        return None

    def set_conversations(self, items: list[Conversation]) -> None:
        self.beginResetModel()
        self._items = list(items)
        self.endResetModel()

    def row_of(self, conversation_id: int) -> int:
        for row, conv in enumerate(self._items):
            if conv.id == conversation_id:
                return row
        return -1

    @property
    def conversations(self) -> list[Conversation]:
        return list(self._items)


class ConversationList(QWidget):
    """Emits ``selected`` when the user picks a conversation (not on ``select``)."""

    selected = Signal(int)
    new_requested = Signal()
    delete_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = ConversationListModel(self)
        self.view = QListView()
        self.view.setModel(self.model)
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.view.setSpacing(2)
        # A long title ends in "…" at the list's width (its tooltip has it whole).
        self.view.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.view.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.view.setUniformItemSizes(True)
        self.view.clicked.connect(self._clicked)
        self.view.activated.connect(self._clicked)
        new_button = QPushButton("New chat")
        new_button.clicked.connect(self.new_requested)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self._delete)
        title = QLabel("Conversations")
        title.setStyleSheet("font-weight: bold;")
        buttons = QHBoxLayout()
        buttons.addWidget(new_button)
        buttons.addWidget(self.delete_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(title)
        layout.addWidget(self.view, 1)
        layout.addLayout(buttons)

    def set_conversations(self, items: list[Conversation], current: int | None) -> None:
        self.model.set_conversations(items)
        if current is not None:
            self.select(current)

    def select(self, conversation_id: int) -> None:
        row = self.model.row_of(conversation_id)
        if row >= 0:
            self.view.setCurrentIndex(self.model.index(row))

    def _clicked(self, index: QModelIndex) -> None:
        conv = index.data(CONVERSATION_ROLE)
        if conv is not None:
            self.selected.emit(conv.id)

    def _delete(self) -> None:
        index = self.view.currentIndex()
        conv = index.data(CONVERSATION_ROLE) if index.isValid() else None
        if conv is None:
            return
        answer = QMessageBox.question(self, "Delete conversation",
                                      f"Delete “{conv.title}” and all its messages?")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete_requested.emit(conv.id)
