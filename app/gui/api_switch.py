"""The switch that serves the loaded model to other programs (OpenAI API on 127.0.0.1),
with the address to give them. The server shares the window's engine: its requests
take turns with the chat under the worker's engine lock."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QGroupBox,
    QWidget,
)

from app.conversation_store import ConversationStore
from app.gui.engine_worker import EngineWorker
from app.gui.switch_box import lay_out_switch, port_box
from app.server.serve import DEFAULT_PORT, ApiServer

PORT_SETTING = "api_server_port"


class ApiServerSwitch(QGroupBox):
    """Starts and stops an ApiServer on 127.0.0.1; ``state_changed`` carries the URL
    while serving, "" when stopped."""

    state_changed = Signal(str)

    def __init__(self, worker: EngineWorker, store: ConversationStore,
                 parent: QWidget | None = None) -> None:
        super().__init__("Serve to other apps", parent)
        self.worker, self.store = worker, store
        self.server: ApiServer | None = None
        self.enabled = QCheckBox("OpenAI-compatible API on this computer")
        self.port = port_box(store, PORT_SETTING, DEFAULT_PORT, 0)
        self.port.setSpecialValueText("any free port")
        self.address = lay_out_switch(self, self.enabled, self.port)
        self.enabled.toggled.connect(self._toggled)

    def _toggled(self, on: bool) -> None:
        if on:
            self.start()
        else:
            self.stop()

    def start(self) -> None:
        if self.server is not None:
            return
        try:
            self.server = ApiServer(self.worker.current_service, self.worker.engine_lock,
                                    "127.0.0.1", self.port.value(),
                                    execute=self.worker.call_in_worker)
        except ValueError as exc:  # a port in use, for example
            self.address.setText(f"Not serving: {exc}")
            self.enabled.blockSignals(True)
            self.enabled.setChecked(False)
            self.enabled.blockSignals(False)
            self.state_changed.emit("")
            return
        self.server.start()
        self.store.set_setting(PORT_SETTING, self.port.value())
        self.port.setEnabled(False)
        self.address.setText(f"Serving at <b>{self.server.url}</b> (base URL for OpenAI "
                             "clients; any API key)")
        self.state_changed.emit(self.server.url)

    def stop(self) -> None:
        """Stop serving: a request being answered ends at its next step. Idempotent."""
        if self.server is None:
            return
        self.server.stop()
        self.server = None
        self.port.setEnabled(True)
        self.address.setText("Off")
        self.state_changed.emit("")
