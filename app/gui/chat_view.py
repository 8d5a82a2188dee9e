"""The chat pane: transcript, actions on the selected message, and the composer."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, QPoint, Qt, Signal
from PySide6.QtGui import (
    QDragEnterEvent,
    QDropEvent,
    QGuiApplication,
    QKeyEvent,
    QMouseEvent,
    QPalette,
    QResizeEvent,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QListView,
    QMenu,
    QPlainTextEdit,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.conversation_store import Message
from app.gui import theme
from app.gui.attachment_bar import AttachmentBar
from app.gui.document_loader import is_long_paste
from app.gui.message_delegate import MessageDelegate
from app.gui.paper_clip import paper_clip_icon
from app.gui.sources import Sources, SourcesDialog
from app.gui.tool_approval import ToolApprovalBar
from app.gui.transcript_model import MESSAGE_ROLE, SOURCES_ROLE, TranscriptModel
from app.gui.welcome import WelcomePanel


class Composer(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line. A long paste and dropped files come
    out as signals (attachments) instead of text in the box."""

    submitted = Signal()
    long_paste = Signal(str)  # a text too long to type into the box
    files_dropped = Signal(object)  # list[Path]

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return bool(local_files(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        files = local_files(source)
        if files:
            self.files_dropped.emit(files)
        elif source.hasText() and is_long_paste(source.text()):
            self.long_paste.emit(source.text())
        else:
            super().insertFromMimeData(source)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


def local_files(source: QMimeData) -> list[Path]:
    """The local files a drop or paste carries (a file manager's copy gives URLs)."""
    if not source.hasUrls():
        return []
    return [Path(u.toLocalFile()) for u in source.urls() if u.isLocalFile()]


class TranscriptView(QListView):
    """A list view whose rows wrap to its width (the delegate needs to know it); a click
    on a message's "‹" or "›" asks for its previous or next version."""

    version_clicked = Signal(int, int)  # message id, -1 (previous) or +1 (next)
    sources_clicked = Signal(object)  # Sources: an answer's "Sources" line was clicked

    def __init__(self, delegate: MessageDelegate, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.message_delegate = delegate
        self.setItemDelegate(delegate)
        self.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setUniformItemSizes(False)
        background = theme.current().chat_background
        self.setStyleSheet(f"QListView {{ background: {background}; border: none; }}"
                           "QListView::item:selected { background: transparent; }")

    def mousePressEvent(self, event: QMouseEvent) -> None:
        index = self.indexAt(event.position().toPoint())
        msg = index.data(MESSAGE_ROLE) if index.isValid() else None
        rects = self.message_delegate.version_rects(self.visualRect(index), msg, self.font()) \
            if msg is not None else None
        if rects is not None:
            for rect, step in ((rects[0], -1), (rects[2], 1)):
                if rect.contains(event.position()):
                    self.version_clicked.emit(msg.id, step)
                    return
        sources: Sources | None = index.data(SOURCES_ROLE) if msg is not None else None
        where = self.message_delegate.sources_rect(self.visualRect(index), msg, sources,
                                                   self.font()) if sources else None
        if where is not None and where.contains(event.position()):
            self.sources_clicked.emit(sources)
            return
        fold = self.message_delegate.reasoning_rect(self.visualRect(index), msg, self.font()) \
            if msg is not None else None
        if fold is not None and fold.contains(event.position()):
            self.message_delegate.toggle_reasoning(msg.id)
            self.doItemsLayout()
            self.viewport().update()
            return
        super().mousePressEvent(event)

    def resizeEvent(self, event: QResizeEvent) -> None:
        self.message_delegate.set_width(self.viewport().width())
        super().resizeEvent(event)
        self.doItemsLayout()


CHAT_PLACEHOLDER = "Message Tandem (Enter sends, Shift+Enter: new line)"
COMPLETION_PLACEHOLDER = ("Text for the base model to continue (Enter sends, Shift+Enter: "
                          "new line)")


DOCUMENT_FILTER = ("Documents (*.txt *.md *.markdown *.pdf *.docx *.html *.htm *.rst *.csv "
                   "*.log *.json *.yaml *.yml *.toml *.py *.js *.ts *.c *.h *.cpp *.java "
                   "*.go *.rs *.sh *.sql);;All files (*)")


class ChatView(QWidget):
    """Emits what the user asks for; the controller decides what happens."""

    send_requested = Signal(str)
    edit_requested = Signal(int, str)  # message id, new text: replaces it and what follows
    stop_requested = Signal()
    regenerate_requested = Signal()
    version_requested = Signal(int, int)  # message id, -1 or +1: show another version
    delete_version_requested = Signal(int)  # message id: delete it and what follows
    attach_requested = Signal(object)  # list[Path]: files to read and attach
    paste_requested = Signal(str)  # a long text pasted: attach it as a document
    remove_attachment_requested = Signal(int)  # the i-th pending document

    def __init__(self, model: TranscriptModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self._busy = False
        self._editing: Message | None = None
        self._reading = False  # a file is being read: sending waits for it
        self.setAcceptDrops(True)

        self.delegate = MessageDelegate(self)
        self.transcript = TranscriptView(self.delegate)
        self.transcript.version_clicked.connect(self.version_requested)
        self.transcript.sources_clicked.connect(self.show_sources)
        self.transcript.setModel(model)
        self.transcript.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.transcript.customContextMenuRequested.connect(self._context_menu)
        self.transcript.selectionModel().selectionChanged.connect(self._update_actions)
        self.transcript.doubleClicked.connect(lambda _i: self.start_edit())
        model.rowsInserted.connect(self._follow)
        model.dataChanged.connect(self._follow)
        model.modelReset.connect(self._update_actions)
        for change in (model.modelReset, model.rowsInserted, model.rowsRemoved):
            change.connect(self._show_welcome_when_empty)

        self.copy_button = QPushButton("Copy")
        self.edit_button = QPushButton("Edit && resend")
        self.regenerate_button = QPushButton("Regenerate")
        self.copy_button.clicked.connect(self.copy_selected)
        self.edit_button.clicked.connect(self.start_edit)
        self.regenerate_button.clicked.connect(self.regenerate_requested)
        actions = QHBoxLayout()
        self.hint = QLabel("Select a message to copy or edit it.")
        self.hint.setStyleSheet(f"color: {theme.current().muted};")
        actions.addWidget(self.hint, 1)
        for b in (self.copy_button, self.edit_button, self.regenerate_button):
            actions.addWidget(b)

        self.edit_banner = QLabel()
        self.edit_banner.setStyleSheet(f"background: {theme.current().banner}; padding: 4px;")
        self.edit_banner.hide()
        self.composer = Composer()
        self.composer.setPlaceholderText(CHAT_PLACEHOLDER)
        self.composer.setFixedHeight(72)
        self.composer.submitted.connect(self.submit)
        self.composer.long_paste.connect(self.paste_requested)
        self.composer.files_dropped.connect(self.attach_requested)
        self.attachments = AttachmentBar()
        self.approval = ToolApprovalBar()  # a tool call waiting for the user
        self.attachments.remove_requested.connect(self.remove_attachment_requested)
        self.attach_button = QToolButton()
        self.attach_button.setText("Attach")
        self.attach_button.setIcon(paper_clip_icon(self.palette().color(
            QPalette.ColorRole.ButtonText)))
        self.attach_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.attach_button.setToolTip("Attach documents: text, Markdown, code, PDF, Word, "
                                      "HTML (or drop files here)")
        self.attach_button.clicked.connect(self.choose_files)
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.submit)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop_requested)
        self.cancel_edit_button = QPushButton("Cancel edit")
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        buttons = QVBoxLayout()
        for b in (self.send_button, self.stop_button, self.cancel_edit_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        composer_row = QHBoxLayout()
        composer_row.addWidget(self.attach_button, 0, Qt.AlignmentFlag.AlignTop)
        composer_row.addWidget(self.composer, 1)
        composer_row.addLayout(buttons)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        # An empty chat shows the machine, the model and models that fit, instead.
        self.welcome = WelcomePanel()
        layout.addWidget(self.welcome, 1)
        layout.addWidget(self.transcript, 1)
        layout.addLayout(actions)
        layout.addWidget(self.edit_banner)
        layout.addWidget(self.approval)
        layout.addWidget(self.attachments)
        layout.addLayout(composer_row)
        self._update_actions()
        self._show_welcome_when_empty()

    # --- state -----------------------------------------------------------------------
    def set_completion_mode(self, on: bool) -> None:
        """A base model continues the text it is given: its replies are labelled as
        continuations and the composer asks for text to continue."""
        self.delegate.model_author = "Continuation" if on else "Tandem"
        self.composer.setPlaceholderText(COMPLETION_PLACEHOLDER if on else CHAT_PLACEHOLDER)
        self.transcript.viewport().update()

    def set_busy(self, busy: bool) -> None:
        """While an answer streams: Stop on, editing and regenerating off."""
        self._busy = busy
        self._update_actions()

    def set_reading(self, names: list[str]) -> None:
        """Files being read: their chips say so, and Send waits until they are in."""
        self._reading = bool(names)
        self.attachments.set_reading(names)
        self._update_actions()

    def selected_message(self) -> Message | None:
        rows = self.transcript.selectionModel().selectedRows()
        return rows[0].data(MESSAGE_ROLE) if rows else None

    def _update_actions(self, *_: object) -> None:
        msg = self.selected_message()
        messages = self.model.messages
        self.copy_button.setEnabled(msg is not None)
        self.edit_button.setEnabled(msg is not None and msg.role == "user" and not self._busy)
        self.regenerate_button.setEnabled(not self._busy and any(
            m.role == "user" for m in messages))
        self.stop_button.setEnabled(self._busy)
        self.send_button.setEnabled(not self._busy and not self._reading)
        self.cancel_edit_button.setVisible(self._editing is not None)

    def _show_welcome_when_empty(self, *_: object) -> None:
        empty = not self.model.messages
        self.welcome.setVisible(empty)
        self.transcript.setVisible(not empty)

    def _follow(self, *_: object) -> None:
        # Keep the newest text in sight while streaming, unless the user scrolled up.
        bar = self.transcript.verticalScrollBar()
        if bar.value() >= bar.maximum() - 80:
            self.transcript.scrollToBottom()

    # --- actions ---------------------------------------------------------------------
    def submit(self) -> None:
        text = self.composer.toPlainText().strip()
        if (not text and not self.attachments.n_documents) or self._busy or self._reading:
            return
        self.composer.clear()
        editing, self._editing = self._editing, None
        self.edit_banner.hide()
        if editing is not None:
            self.edit_requested.emit(editing.id, text)
        else:
            self.send_requested.emit(text)
        self._update_actions()

    def choose_files(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach documents", str(Path.home()),
                                                DOCUMENT_FILTER)
        if paths:
            self.attach_requested.emit([Path(p) for p in paths])

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if local_files(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        files = local_files(event.mimeData())
        if files:
            event.acceptProposedAction()
            self.attach_requested.emit(files)

    def show_sources(self, sources: Sources) -> SourcesDialog:
        dialog = SourcesDialog(sources, self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()
        return dialog

    def copy_selected(self) -> None:
        msg = self.selected_message()
        if msg is not None:
            QGuiApplication.clipboard().setText(msg.content)

    def start_edit(self) -> None:
        """Load the selected user message into the composer; Send then replaces it."""
        msg = self.selected_message()
        if msg is None or msg.role != "user" or self._busy:
            return
        self._editing = msg
        self.composer.setPlainText(msg.content)
        self.composer.setFocus()
        documents = len(msg.info.get("attachments") or ())
        kept = ("" if not documents else " Its document goes along." if documents == 1
                else f" Its {documents} documents go along.")
        self.edit_banner.setText("Editing a message: Send makes a new version of it and "
                                 f"answers that; the old one stays (‹ › switches).{kept}")
        self.edit_banner.show()
        self._update_actions()

    def cancel_edit(self) -> None:
        self._editing = None
        self.composer.clear()
        self.edit_banner.hide()
        self._update_actions()

    def _context_menu(self, pos: QPoint) -> None:
        index = self.transcript.indexAt(pos)
        if not index.isValid():
            return
        self.transcript.setCurrentIndex(index)
        menu = QMenu(self)
        menu.addAction("Copy", self.copy_selected)
        if self.edit_button.isEnabled():
            menu.addAction("Edit and resend", self.start_edit)
        if self.regenerate_button.isEnabled():
            menu.addAction("Regenerate last answer", self.regenerate_requested.emit)
        msg = self.selected_message()
        sources: Sources | None = index.data(SOURCES_ROLE)
        if sources is not None:
            menu.addAction("Show sources", lambda: self.show_sources(sources))
        if msg is not None and msg.n_siblings > 1 and not self._busy:
            where = f"{msg.sibling_index + 1}/{msg.n_siblings}"
            menu.addSeparator()
            if msg.sibling_index > 0:
                menu.addAction(f"Previous version (of {where})",
                               lambda: self.version_requested.emit(msg.id, -1))
            if msg.sibling_index < msg.n_siblings - 1:
                menu.addAction(f"Next version (of {where})",
                               lambda: self.version_requested.emit(msg.id, 1))
            menu.addAction("Delete this version",
                           lambda: self.delete_version_requested.emit(msg.id))
        menu.exec(self.transcript.viewport().mapToGlobal(pos))
