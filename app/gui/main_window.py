"""The main window, chat first: conversations at the side, the model and drafter above
the chat, the settings in a drawer that folds away, and the speed dashboard a side panel
the user opens. It opens inside the screen's available area (app.gui.window_fit). It
wires widgets to the controller and the worker; the engine runs in the worker's thread."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QEvent, Qt, QThread, QTimer, Signal, Slot
from PySide6.QtGui import QAction, QCloseEvent, QDragEnterEvent, QDropEvent, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QFileDialog,
    QHBoxLayout,
    QMainWindow,
    QMessageBox,
    QScrollArea,
    QSplitter,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.conversation_export import (
    import_into,
    message_attachments,
    read_import,
    write_export,
)
from app.conversation_store import ConversationStore
from app.gui.api_switch import ApiServerSwitch
from app.gui.chat_controller import ChatController
from app.gui.chat_view import ChatView, local_files
from app.gui.conversation_list import ConversationList
from app.gui.dashboard import DashboardWidget
from app.gui.engine_panel import EnginePanel
from app.gui.engine_worker import (
    EngineChoice,
    EngineFailure,
    EngineReady,
    EngineWorker,
    GenerationOutcome,
)
from app.gui.resource_sampler import ResourceSampler
from app.gui.settings_panel import SettingsPanel
from app.gui.tool_servers import ToolServers
from app.gui.tools_panel import ToolsPanel
from app.gui.transcript_model import TranscriptModel
from app.gui.window_fit import MINIMUM, initial_geometry, screen_area
from app.gui.worker_switch import WorkerSwitch

IDLE_REMEASURE_MS = 30_000
# Side columns at their narrowest, so the chat keeps the rest of a 1366-px laptop screen.
CONVERSATIONS_WIDTH = 190
DRAWER_WIDTH = 360


class MainWindow(QMainWindow):
    """Owns the store, the worker thread and every widget. ``default_model`` replaces the
    bundled model (tests pass the prepared copy); ``close()`` stops the engine."""

    load_request = Signal(object)  # EngineChoice, to the worker
    engine_ready = Signal(object)  # EngineReady, once the widgets show it
    shutdown_request = Signal()
    remeasure_request = Signal()  # to the worker, when the app has been idle a while

    def __init__(self, db_path: Path | str | None = None,
                 default_model: Path | None = None, n_threads: int | None = None) -> None:
        super().__init__()
        self.engine_info: EngineReady | None = None
        self.setWindowTitle("Tandem")
        self.setGeometry(initial_geometry(screen_area()))
        self.setMinimumSize(MINIMUM)
        self.setAcceptDrops(True)  # files dropped on the window are attached
        self.default_model = default_model
        self.n_threads = n_threads
        self.store = ConversationStore(db_path)
        self._closed = False
        self._notice = ""

        self.worker = EngineWorker()
        self.thread_ = QThread(self)
        self.thread_.setObjectName("tandem-engine")
        self.worker.moveToThread(self.thread_)
        self.thread_.finished.connect(self.worker.deleteLater)

        self.transcript = TranscriptModel(parent=self)
        # MCP servers: the ones the user approved start with the window and stop with it
        # (app.gui.tool_servers); adding one asks first (app.gui.server_review_dialog)
        self.tool_servers = ToolServers(self.store, parent=self)
        self.controller = ChatController(self.store, self.worker, self.transcript, parent=self,
                                         tool_servers=self.tool_servers)
        self.chat = ChatView(self.transcript)
        self.conversations = ConversationList()
        self.engine_panel = EnginePanel(self.store)
        self.settings_panel = SettingsPanel()
        self.tools_panel = ToolsPanel(self.tool_servers)
        self.api_switch = ApiServerSwitch(self.worker, self.store)
        self.worker_switch = WorkerSwitch(self.store)
        self.sampler = ResourceSampler(parent=self)
        self.dashboard = DashboardWidget(self.sampler)

        self.engine_panel.default_model = default_model
        self._lay_out()

        # Provisional costs (or a plan the answers changed) are measured again once the
        # app has been idle this long: no answer waits on it.
        self.idle_remeasure = QTimer(self)
        self.idle_remeasure.setSingleShot(True)
        self.idle_remeasure.setInterval(IDLE_REMEASURE_MS)
        self.idle_remeasure.timeout.connect(self._remeasure_if_idle)

        self._wire()
        self._menus()
        self.thread_.start()
        self.tool_servers.start_all()
        self.sampler.start()
        self._start_conversations()
        self.load_engine(self.engine_panel.choice())

    def _lay_out(self) -> None:
        """Conversations | the chat under the model and drafter | the settings drawer
        (folded); the dashboard docks on the right when opened."""
        self.settings_toggle = QToolButton()
        self.settings_toggle.setText("Settings")
        self.settings_toggle.setCheckable(True)
        self.settings_toggle.setToolTip("Sampling, system prompt, drafting, serving "
                                        "(Ctrl+,)")
        self.dashboard_toggle = QToolButton()
        self.dashboard_toggle.setText("Dashboard")
        self.dashboard_toggle.setCheckable(True)
        self.dashboard_toggle.setToolTip("Speed, drafts and the plan (Ctrl+D)")
        top = QHBoxLayout()
        top.addWidget(self.engine_panel.picker, 1)
        top.addWidget(self.settings_toggle)
        top.addWidget(self.dashboard_toggle)
        center = QWidget()
        column = QVBoxLayout(center)
        column.setContentsMargins(4, 4, 4, 0)
        column.addLayout(top)
        column.addWidget(self.engine_panel.note)  # why a choice fell back, in sight
        column.addWidget(self.engine_panel.measure_bar)  # a first start's measurement
        column.addWidget(self.chat, 1)

        drawer = QWidget()
        drawer_layout = QVBoxLayout(drawer)
        for part in (self.settings_panel, self.tools_panel, self.engine_panel,
                     self.api_switch, self.worker_switch):
            drawer_layout.addWidget(part)
        drawer_layout.addStretch(1)
        self.settings_drawer = QScrollArea()
        self.settings_drawer.setWidget(drawer)
        self.settings_drawer.setWidgetResizable(True)
        self.settings_drawer.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        # As wide as its widest row needs: it scrolls up and down, never sideways.
        scrollbar = self.settings_drawer.verticalScrollBar().sizeHint().width()
        self.settings_drawer.setMinimumWidth(max(DRAWER_WIDTH, drawer.minimumSizeHint().width()
                                                 + scrollbar + 4))
        self.settings_drawer.hide()
        self.settings_toggle.toggled.connect(self.settings_drawer.setVisible)

        self.conversations.setMinimumWidth(CONVERSATIONS_WIDTH)
        splitter = QSplitter()
        splitter.addWidget(self.conversations)
        splitter.addWidget(center)
        splitter.addWidget(self.settings_drawer)
        splitter.setStretchFactor(1, 1)
        splitter.setCollapsible(1, False)
        splitter.setSizes([CONVERSATIONS_WIDTH, 900, self.settings_drawer.minimumWidth()])
        self.setCentralWidget(splitter)

        self.dashboard_dock = QDockWidget("Speed dashboard", self)
        self.dashboard_dock.setObjectName("dashboard")
        self.dashboard_dock.setWidget(self.dashboard)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.dashboard_dock)
        self.resizeDocks([self.dashboard_dock], [420], Qt.Orientation.Horizontal)
        self.dashboard_dock.hide()
        self.dashboard_dock.visibilityChanged.connect(self.dashboard_toggle.setChecked)
        self.dashboard_toggle.toggled.connect(self.dashboard_dock.setVisible)

    def open_model_picker(self) -> None:
        """Ctrl+K: the model box, open."""
        box = self.engine_panel.model_box
        if box.isEnabled():
            box.setFocus()
            box.showPopup()

    # --- wiring ----------------------------------------------------------------------
    def _wire(self) -> None:
        w, c = self.worker, self.controller
        self.load_request.connect(w.load)
        self.shutdown_request.connect(w.shutdown)
        self.remeasure_request.connect(w.remeasure)
        w.plan_changed.connect(self._on_plan_changed)
        c.busy_changed.connect(lambda _busy: self._arm_remeasure())
        c.generate_request.connect(w.generate)
        c.compare_request.connect(w.compare)
        w.status.connect(self._on_status)
        w.measuring.connect(self.engine_panel.show_measuring)
        w.ready.connect(self._on_ready)
        w.failed.connect(self._on_failed)
        w.step.connect(self.dashboard.on_step)

        c.busy_changed.connect(self.chat.set_busy)
        c.busy_changed.connect(lambda busy: self.engine_panel.setEnabled(not busy))
        c.busy_changed.connect(lambda busy: self.engine_panel.picker.setEnabled(not busy))
        c.conversations_changed.connect(self._refresh_conversations)
        c.conversation_opened.connect(self._on_opened)
        c.started.connect(self.dashboard.on_started)
        c.answer_finished.connect(self._on_answer_finished)
        c.comparison_finished.connect(self.dashboard.on_compared)
        c.problem.connect(lambda text: self.statusBar().showMessage(text, 10000))

        self.chat.send_requested.connect(c.send)
        self.chat.edit_requested.connect(c.edit_and_resend)
        self.chat.stop_requested.connect(c.stop)
        self.chat.regenerate_requested.connect(c.regenerate)
        self.chat.version_requested.connect(c.switch_version)
        self.chat.delete_version_requested.connect(c.delete_version)
        self.chat.attach_requested.connect(c.attach_files)
        self.chat.paste_requested.connect(c.attach_text)
        self.chat.remove_attachment_requested.connect(c.remove_pending)
        self.chat.attachments.cancel_reading_requested.connect(c.documents.cancel)
        c.attachments_changed.connect(self.chat.attachments.set_documents)
        c.reading_changed.connect(self.chat.set_reading)
        c.context_request.connect(self._raise_context)
        c.approval_needed.connect(self.chat.approval.show_call)
        self.tool_servers.failed.connect(
            lambda name, why: self.statusBar().showMessage(
                f"The tool server {name} failed: {why}. Settings ▸ Tools can restart it; "
                "the chat goes on without its tools.", 20000))
        self.chat.approval.approved.connect(c.approve_call)
        self.chat.approval.refused.connect(c.refuse_call)
        self.conversations.selected.connect(c.open_conversation)
        self.conversations.new_requested.connect(c.new_conversation)
        self.conversations.delete_requested.connect(c.delete_conversation)
        self.settings_panel.changed.connect(c.update_settings)
        self.engine_panel.choice_changed.connect(self.load_engine)
        self.dashboard.compare_requested.connect(c.compare)
        self.chat.welcome.get_requested.connect(self.open_model_wizard)
        # On shutdown the worker quits its own thread, whatever the GUI
        # thread is doing (it waits on the thread in closeEvent).
        w.stopped.connect(self.thread_.quit, Qt.ConnectionType.DirectConnection)

    def _menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        self._action(file_menu, "&New chat", self.controller.new_conversation,
                     QKeySequence.StandardKey.New)
        self._action(file_menu, "&Get models…", self.open_model_wizard)
        self._action(file_menu, "Add local &GGUF…", self.engine_panel._add_model)
        self._action(file_menu, "Add draft &head…", self.engine_panel._add_head)
        file_menu.addSeparator()
        self._action(file_menu, "&Export chat…", self._export_dialog,
                     QKeySequence("Ctrl+Shift+E"))
        self._action(file_menu, "&Import chat…", self._import_dialog,
                     QKeySequence("Ctrl+Shift+I"))
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        chat_menu = self.menuBar().addMenu("&Chat")
        self._action(chat_menu, "&Stop", self.controller.stop, QKeySequence("Esc"))
        self._action(chat_menu, "&Regenerate", self.controller.regenerate,
                     QKeySequence("Ctrl+R"))
        self._action(chat_menu, "Regenerate, running &tools again",
                     lambda: self.controller.regenerate(run_tools_again=True))
        self._action(chat_menu, "&Compare with plain decoding", self.controller.compare)
        self._action(chat_menu, "Choose the &model…", self.open_model_picker,
                     QKeySequence("Ctrl+K"))
        view_menu = self.menuBar().addMenu("&View")
        dashboard = self.dashboard_dock.toggleViewAction()
        dashboard.setShortcut(QKeySequence("Ctrl+D"))
        view_menu.addAction(dashboard)
        self._action(view_menu, "&Settings", self.settings_toggle.toggle,
                     QKeySequence("Ctrl+,"))

    def _action(self, menu: object, text: str, slot: object,
                shortcut: QKeySequence | QKeySequence.StandardKey | None = None) -> QAction:
        action = QAction(text, self)
        if shortcut is not None:
            action.setShortcut(shortcut)
        action.triggered.connect(lambda *_: slot())  # type: ignore[operator]
        menu.addAction(action)  # type: ignore[attr-defined]
        return action

    # --- start-up --------------------------------------------------------------------
    def _start_conversations(self) -> None:
        items = self.store.conversations()
        if items:
            self.controller.open_conversation(items[0].id)
        else:
            self.controller.new_conversation()
        self._refresh_conversations()
        if self.store.n_recovered:
            self._notice = (f"{self.store.n_recovered} answer(s) were interrupted when "
                            "Tandem last closed; they are kept and marked ⚠ interrupted.")
            self.statusBar().showMessage(self._notice)

    def load_engine(self, choice: EngineChoice) -> None:
        """Ask the worker to (re)load; the chat waits until it is ready."""
        if choice.model_path is None and self.default_model is not None:
            choice = replace(choice, model_path=self.default_model, n_threads=self.n_threads)
        elif self.n_threads is not None:
            choice = replace(choice, n_threads=self.n_threads)
        self.controller.engine_ready = False
        self.engine_panel.show_loading("Loading the model…")
        self.load_request.emit(choice)

    def _raise_context(self, n_ctx: int, why: str) -> None:
        """Reload the engine with a larger context (the controller's answer waits in the
        worker's queue behind the load); the notice shows once it is ready."""
        self._notice = why
        self.load_engine(replace(self.engine_panel.choice(), n_ctx=n_ctx))
        self.statusBar().showMessage(why)

    def open_model_wizard(self, query: str = "") -> None:
        try:
            from app.gui.model_wizard import ModelWizardDialog
        except ImportError:
            QMessageBox.information(self, "Get models",
                                    "The model download wizard is not part of this build "
                                    "yet. Use File ▸ Add local GGUF… for a model on disk.")
            return
        dialog = ModelWizardDialog(self)
        if query:  # a suggested model: its repository, searched at once
            dialog.query.setText(query)
            dialog.start_search()
        added: list[object] = []
        dialog.model_added.connect(added.append)
        dialog.exec()
        if added:  # switch to the last model the user got, with its head or draft
            model = added[-1]
            head = getattr(model, "head_dir", None)
            draft = getattr(model, "draft_path", None)
            self.engine_panel.add_model(Path(model.path), Path(head) if head else None,
                                        Path(draft) if draft else None)
        else:
            self.engine_panel._fill()

    # --- export and import ------------------------------------------------------------
    def _export_dialog(self) -> None:
        if self.controller.current_id is None:
            return
        title = self.store.conversation(self.controller.current_id).title
        name = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip() or "chat"
        path, chosen = QFileDialog.getSaveFileName(
            self, "Export chat", str(Path.home() / f"{name}.md"),
            "Markdown (*.md);;JSON, OpenAI messages (*.json)")
        if path:
            if "json" in chosen.lower() and not path.lower().endswith(".json"):
                path += ".json"
            self.export_conversation(Path(path))

    def export_conversation(self, path: Path) -> bool:
        """Write the open chat to ``path`` (Markdown for .md, else JSON); says so."""
        cid = self.controller.current_id
        if cid is None:
            return False
        try:
            messages = self.store.messages(cid)
            kind = write_export(self.store.conversation(cid), messages, path,
                                message_attachments(self.store, messages))
        except OSError as exc:
            self.statusBar().showMessage(f"Could not export to {path}: "
                                         f"{exc.strerror or exc}", 15000)
            return False
        self.statusBar().showMessage(f"Chat exported to {path} ({kind}).", 10000)
        return True

    def _import_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import chat", str(Path.home()),
                                              "JSON (*.json);;All files (*)")
        if path:
            self.import_conversation(Path(path))

    def import_conversation(self, path: Path) -> int | None:
        """A chat exported as JSON (Tandem's or an OpenAI message list) as a new
        conversation, opened; None with the reason in the status bar when refused."""
        try:
            conv = import_into(self.store, read_import(path))
        except ValueError as exc:
            self.statusBar().showMessage(f"Could not import: {exc}", 15000)
            return None
        self._refresh_conversations()
        self.controller.open_conversation(conv.id)
        self.statusBar().showMessage(f"Imported “{conv.title}”.", 10000)
        return conv.id

    # --- worker events ---------------------------------------------------------------
    @Slot(str)
    def _on_status(self, text: str) -> None:
        self.engine_panel.show_loading(text)
        self.statusBar().showMessage(text)

    @Slot(object)
    def _on_ready(self, ready: EngineReady) -> None:
        self.engine_info = ready  # the engine as loaded (what the widgets show)
        self.controller.engine_ready = True
        self.controller.n_ctx, self.controller.max_ctx = ready.n_ctx, ready.max_ctx
        self.engine_panel.show_ready(ready)
        self.chat.set_completion_mode(ready.completion)
        self.settings_panel.set_thinking_switch(ready.thinking_switch)
        self.tools_panel.show_model(ready.tools)
        self.dashboard.on_engine_ready(ready)
        self.chat.welcome.show_engine(ready.machine, self.engine_panel.model_box.currentText(),
                                      ready.suggested)
        self._arm_remeasure()
        # The start-up notice about interrupted answers outranks the drafter's note.
        self.statusBar().showMessage(self._notice or ready.note or "Ready.", 15000)
        self._notice = ""
        self.engine_ready.emit(ready)

    @Slot(object)
    def _on_plan_changed(self, ready: EngineReady) -> None:
        before = (self.engine_info.plan_status or {}).get("last_change") \
            if self.engine_info else None
        self.engine_info = ready
        self.dashboard.on_engine_ready(ready)
        after = (ready.plan_status or {}).get("last_change")
        if after and after != before:
            self.statusBar().showMessage(f"Plan changed: {ready.plan['layout_text']}"
                                         if ready.plan else "Plan changed.", 15000)
        self._arm_remeasure()

    def _arm_remeasure(self) -> None:
        """(Re)start the idle countdown when the engine wants to measure again."""
        status = (self.engine_info.plan_status or {}) if self.engine_info else {}
        if status.get("remeasure_wanted") and not self.controller.busy:
            self.idle_remeasure.start()
        else:
            self.idle_remeasure.stop()

    def _remeasure_if_idle(self) -> None:
        if not self.controller.busy:
            self.remeasure_request.emit()

    @Slot(object)
    def _on_failed(self, failure: EngineFailure) -> None:
        if failure.request_id == -1:
            self.engine_panel.show_failure(failure.message)
            self.statusBar().showMessage(f"Could not load the model: {failure.message}")
        self.dashboard.on_failed()

    def _on_answer_finished(self, outcome: GenerationOutcome) -> None:
        self.dashboard.on_finished(outcome, self.controller.loop_monitor.last)

    def _on_opened(self, conversation_id: int) -> None:
        conv = self.store.conversation(conversation_id)
        self.settings_panel.show_settings(conv.system_prompt, conv.settings)
        self.conversations.select(conversation_id)

    def _refresh_conversations(self) -> None:
        self.conversations.set_conversations(self.store.conversations(),
                                             self.controller.current_id)

    # --- files dropped anywhere on the window are attached -----------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if local_files(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        files = local_files(event.mimeData())
        if files:
            event.acceptProposedAction()
            self.controller.attach_files(files)

    # --- shutdown --------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:
        self.shutdown()
        super().closeEvent(event)

    def shutdown(self) -> None:
        """Stop any generation, close the model in its thread, close the store.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.sampler.stop()
        self.controller.documents.wait()  # a file being read: its thread ends first
        # The API server first: its requests use the engine the worker is about to close.
        self.api_switch.stop()
        self.worker_switch.stop()
        self.worker.request_stop()
        self.shutdown_request.emit()
        self.thread_.wait(30_000)
        # Deliver what the worker sent before it stopped (the last text, the finished
        # answer), so the store gets the final state rather than the last throttled save.
        QCoreApplication.sendPostedEvents(None, QEvent.Type.MetaCall)
        self.controller.abandon()
        self.tool_servers.close()  # their processes end with the app
        self.store.close()
