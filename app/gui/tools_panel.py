"""Settings > Tools: the MCP servers (state and tools of each), adding one by command or
URL, importing an ``mcp.json``, and how the loaded model calls tools."""

from __future__ import annotations

import shlex
from pathlib import Path

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.gui import theme
from app.gui.server_review_dialog import ServerReviewDialog
from app.gui.tool_servers import ToolServers
from app.tools.mcp_host import FAILED, RUNNING, STARTING, ServerStatus
from app.tools.server_config import ServerConfig, ToolConfigError, server_from_entry
from app.tools.server_review import ServerReview

STATE_WORDS = {RUNNING: "●", STARTING: "…", FAILED: "✖"}
SAFETY = ("A tool runs with your rights on this computer: it can read, change or send "
          "what you can. Each call waits for your approval unless you always allow "
          "that tool.")


def server_line(config: ServerConfig, status: ServerStatus) -> str:
    mark = STATE_WORDS.get(status.state, "○")
    if status.state == RUNNING:
        what = f"{len(status.tools)} tools"
    elif status.state == FAILED:
        what = "failed"
    elif not config.approved:
        what = "not started: press Start to review it"
    elif not config.enabled:
        what = "off"
    else:
        what = status.state
    return f"{mark} {config.name} · {what}"


class AddServerDialog(QDialog):
    """A server by name and a command line, or a URL."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Add a tool server")
        self.name = QLineEdit()
        self.name.setPlaceholderText("files")
        self.kind = QComboBox()
        self.kind.addItem("Command (stdio)", "command")
        self.kind.addItem("URL (streamable HTTP)", "url")
        self.target = QLineEdit()
        self.target.setPlaceholderText("npx -y @modelcontextprotocol/server-filesystem ~/notes")
        self.kind.currentIndexChanged.connect(self._hint)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet(f"color: {theme.current().note};")
        self.error.hide()
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self._accept)
        buttons.rejected.connect(self.reject)
        form = QFormLayout()
        form.addRow("Name", self.name)
        form.addRow("Kind", self.kind)
        form.addRow("Command or URL", self.target)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(QLabel(SAFETY, wordWrap=True))
        layout.addWidget(self.error)
        layout.addWidget(buttons)
        self.config: ServerConfig | None = None

    def _hint(self) -> None:
        self.target.setPlaceholderText("http://127.0.0.1:8000/mcp"
                                       if self.kind.currentData() == "url" else
                                       "npx -y @modelcontextprotocol/server-filesystem ~/notes")

    def server(self) -> ServerConfig:
        """The server the fields describe; ToolConfigError says what is wrong."""
        text = self.target.text().strip()
        if self.kind.currentData() == "url":
            return server_from_entry(self.name.text().strip(), {"url": text})
        try:
            words = shlex.split(text)
        except ValueError as exc:
            raise ToolConfigError(f"the command line: {exc}") from exc
        if not words:
            raise ToolConfigError("give the command that starts the server")
        return server_from_entry(self.name.text().strip(),
                                 {"command": words[0], "args": words[1:]})

    def _accept(self) -> None:
        try:
            self.config = self.server()
        except ToolConfigError as exc:
            self.error.setText(str(exc))
            self.error.show()
            return
        self.accept()


class ToolsPanel(QGroupBox):
    def __init__(self, servers: ToolServers, parent: QWidget | None = None) -> None:
        super().__init__("Tools (MCP servers)", parent)
        self.servers = servers
        self.model_note = QLabel("")
        self.model_note.setWordWrap(True)
        self.list = QListWidget()
        self.list.setMaximumHeight(110)
        self.list.currentRowChanged.connect(self._selected)
        self.detail = QLabel("")
        self.detail.setWordWrap(True)
        self.detail.setStyleSheet(f"color: {theme.current().muted};")
        self.add_button = QPushButton("Add…")
        self.import_button = QPushButton("Import mcp.json…")
        self.remove_button = QPushButton("Remove")
        self.restart_button = QPushButton("Start")
        self.off_button = QPushButton("Turn off")
        self.add_button.clicked.connect(self.add_dialog)
        self.import_button.clicked.connect(self.import_dialog)
        self.remove_button.clicked.connect(self._remove)
        self.restart_button.clicked.connect(self._restart)
        self.off_button.clicked.connect(self._turn_off)
        self.review_dialog: ServerReviewDialog | None = None
        row1, row2 = QHBoxLayout(), QHBoxLayout()
        row1.addWidget(self.add_button)
        row1.addWidget(self.import_button)
        row2.addWidget(self.remove_button)
        row2.addWidget(self.restart_button)
        row2.addWidget(self.off_button)
        safety = QLabel(SAFETY)
        safety.setWordWrap(True)
        safety.setStyleSheet(f"color: {theme.current().muted};")
        layout = QVBoxLayout(self)
        layout.addWidget(self.model_note)
        layout.addWidget(self.list)
        layout.addWidget(self.detail)
        layout.addLayout(row1)
        layout.addLayout(row2)
        layout.addWidget(safety)
        servers.changed.connect(self.refresh)
        self.refresh()

    def show_model(self, note: str) -> None:
        """How the loaded model calls tools (and whether it does it well)."""
        self.model_note.setText(note)

    def refresh(self) -> None:
        row = self.list.currentRow()
        self.list.clear()
        for config in self.servers.configs:
            status = self.servers.status(config.name)
            item = QListWidgetItem(server_line(config, status))
            item.setToolTip(config.where())
            self.list.addItem(item)
        if self.servers.configs:
            self.list.setCurrentRow(min(max(row, 0), len(self.servers.configs) - 1))
        else:
            self.detail.setText("No tool servers yet: add one by its command or URL, or "
                                "import an mcp.json (Claude Desktop's, LM Studio's).")
        has = bool(self.servers.configs)
        self.remove_button.setEnabled(has)
        self.restart_button.setEnabled(has)
        self.off_button.setEnabled(has)

    def _selected(self, row: int) -> None:
        if not 0 <= row < len(self.servers.configs):
            return
        config = self.servers.configs[row]
        status = self.servers.status(config.name)
        running = status.state in (RUNNING, STARTING)
        self.restart_button.setText("Restart" if running else "Start")
        self.off_button.setEnabled(running or config.enabled)
        lines = [config.where()]
        if not config.approved:
            lines.append("Not started: Start shows what it runs and asks you first.")
        if status.tools:
            lines.append("Tools: " + ", ".join(t.name for t in status.tools))
        if status.state == FAILED:
            lines.append(f"Failed: {status.message}")
        if config.always_allow:
            lines.append("Always allowed: " + ", ".join(config.always_allow))
        self.detail.setText("\n".join(lines))

    def _current(self) -> ServerConfig | None:
        row = self.list.currentRow()
        return self.servers.configs[row] if 0 <= row < len(self.servers.configs) else None

    def _remove(self) -> None:
        config = self._current()
        if config is not None:
            self.servers.remove(config.name)

    def _restart(self) -> None:
        config = self._current()
        if config is None:
            return
        if config.approved:
            self.servers.restart(config.name)
        else:
            self.ask_to_start([config])

    def _turn_off(self) -> None:
        config = self._current()
        if config is not None:
            self.servers.turn_off(config.name)

    def add_dialog(self) -> None:
        dialog = AddServerDialog(self)
        if dialog.exec() and dialog.config is not None:
            self.ask_to_start([dialog.config])

    def ask_to_start(self, configs: list[ServerConfig]) -> ServerReviewDialog:
        """Shows what each server runs and replaces; only the ones the user ticks and
        starts are added (the dialog is ``review_dialog`` until it closes)."""
        return self._open_review(self.servers.review(configs))

    def _open_review(self, items: list[ServerReview]) -> ServerReviewDialog:
        if self.review_dialog is not None:
            self.review_dialog.reject()
        dialog = ServerReviewDialog(items, self)
        dialog.chosen.connect(self._started)
        dialog.finished.connect(lambda _result: self._review_closed(dialog))
        self.review_dialog = dialog
        dialog.open()
        return dialog

    def _review_closed(self, dialog: ServerReviewDialog) -> None:
        if self.review_dialog is dialog:
            self.review_dialog = None

    def _started(self, configs: list[ServerConfig]) -> None:
        self.servers.add(configs)
        self.detail.setText("Starting " + ", ".join(c.name for c in configs) + ".")

    def import_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import tool servers",
                                              str(Path.home()), "mcp.json (*.json)")
        if path:
            self.import_file(Path(path))

    def import_file(self, path: Path) -> bool:
        """Shows the servers of an ``mcp.json`` for the user to start or not (nothing is
        added before that); a file that cannot be used says why."""
        try:
            found = self.servers.read_import(path)
        except ToolConfigError as exc:
            self.detail.setText(f"Could not import {path.name}: {exc}")
            return False
        if not found:
            self.detail.setText(f"{path.name} lists no servers.")
            return False
        self._open_review(found)
        self.detail.setText(f"{path.name} lists {len(found)} server(s): choose which to "
                            "start.")
        return True
