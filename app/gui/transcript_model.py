"""The chat transcript as a list model over ``Message`` values.

Streaming changes only the last row, and its repaints are coalesced: text deltas are
appended at once, a ``dataChanged`` follows at most every ``repaint_ms``.
"""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import (
    QAbstractListModel,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    Qt,
    QTimer,
)

from app.conversation_store import Message
from app.gui.sources import sources_of

MESSAGE_ROLE = Qt.ItemDataRole.UserRole + 1
# True for a message the model no longer sees: the latest answer left it out to fit the
# context (the long-chat policy drops the oldest turns).
OUT_OF_CONTEXT_ROLE = Qt.ItemDataRole.UserRole + 2
# An answer's Sources (app.gui.sources): what its user message's documents gave it.
SOURCES_ROLE = Qt.ItemDataRole.UserRole + 3

_Index = QModelIndex | QPersistentModelIndex


class TranscriptModel(QAbstractListModel):
    """Rows are the messages of one conversation; ``MESSAGE_ROLE`` gives the Message."""

    def __init__(self, repaint_ms: int = 40, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._messages: list[Message] = []
        self._repaint = QTimer(self)
        self._repaint.setSingleShot(True)
        self._repaint.setInterval(repaint_ms)
        self._repaint.timeout.connect(self._emit_last_changed)

    # --- Qt model interface ----------------------------------------------------------
    def rowCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._messages)

    def data(self, index: _Index, role: int = Qt.ItemDataRole.DisplayRole) -> object:
        if not index.isValid() or not 0 <= index.row() < len(self._messages):
            return None
        msg = self._messages[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return msg.content
        if role == MESSAGE_ROLE:
            return msg
        if role == OUT_OF_CONTEXT_ROLE:
            return index.row() < self.n_out_of_context()
        if role == SOURCES_ROLE:
            row = index.row()
            if msg.role != "assistant" or row == 0:
                return None
            return sources_of(self._messages[row - 1])
        return None

    def n_out_of_context(self) -> int:
        """How many of the first messages the latest finished answer did not see."""
        for msg in reversed(self._messages):
            if msg.role == "assistant" and "context_dropped" in msg.info:
                return int(msg.info.get("context_dropped") or 0)
        return 0

    # --- edits -----------------------------------------------------------------------
    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    def set_messages(self, messages: list[Message]) -> None:
        self._repaint.stop()
        self.beginResetModel()
        self._messages = list(messages)
        self.endResetModel()

    def append(self, message: Message) -> None:
        self._flush()
        row = len(self._messages)
        self.beginInsertRows(QModelIndex(), row, row)
        self._messages.append(message)
        self.endInsertRows()

    def truncate(self, position: int) -> None:
        """Drop the rows at ``position`` and after."""
        self._flush()
        if position < len(self._messages):
            self.beginRemoveRows(QModelIndex(), position, len(self._messages) - 1)
            del self._messages[position:]
            self.endRemoveRows()

    def append_text(self, delta: str) -> None:
        """Stream ``delta`` onto the last message; the repaint comes a little later."""
        if not self._messages:
            return
        last = self._messages[-1]
        self._messages[-1] = replace(last, content=last.content + delta)
        if not self._repaint.isActive():
            self._repaint.start()

    def replace_last(self, message: Message) -> None:
        """Swap the last row (a final status, stats), repainting it now; the rows the
        answer left out of the context repaint too (dimmed)."""
        if self._messages:
            self._messages[-1] = message
            self._flush(force=True)
            dropped = min(self.n_out_of_context(), len(self._messages) - 1)
            if dropped:
                self.dataChanged.emit(self.index(0), self.index(dropped - 1),
                                      [OUT_OF_CONTEXT_ROLE])

    def _flush(self, force: bool = False) -> None:
        if self._repaint.isActive() or force:
            self._repaint.stop()
            self._emit_last_changed()

    def _emit_last_changed(self) -> None:
        if self._messages:
            idx = self.index(len(self._messages) - 1)
            self.dataChanged.emit(idx, idx, [Qt.ItemDataRole.DisplayRole, MESSAGE_ROLE])
