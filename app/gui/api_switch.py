"""The switch that serves the loaded model to other programs (OpenAI API on 127.0.0.1),
with the address to give them. The server shares the window's engine: its requests
take turns with the chat under the worker's engine lock, several at once where the user
asks for it and the model allows (app.server.parallel_lane)."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QSpinBox,
    QWidget,
)

from app.conversation_store import ConversationStore
from app.gui.engine_worker import EngineWorker
from app.gui.switch_box import lay_out_switch, port_box
from app.server.parallel_lane import ParallelEngineLane
from app.server.serve import DEFAULT_PORT, ApiServer

PORT_SETTING = "api_server_port"
PARALLEL_SETTING = "api_server_parallel"
MOST_AT_ONCE = 4


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
        self.at_once = QSpinBox()
        self.at_once.setRange(1, MOST_AT_ONCE)
        saved = store.get_setting(PARALLEL_SETTING, 1)
        self.at_once.setValue(saved if isinstance(saved, int) else 1)
        self.at_once.setToolTip("Requests answered together, each in its own part of the "
                                "cache; more wait their turn")
        row = QHBoxLayout()
        row.addWidget(QLabel("Requests at once"))
        row.addWidget(self.at_once)
        row.addStretch(1)
        self.layout().insertLayout(1, row)  # under the switch and port, over the state
        self.enabled.toggled.connect(self._toggled)
        # Answers decoded together hold a context of the loaded model: it goes before the
        # model does, and comes back for the next one.
        worker.before_close.append(self._model_closing)
        worker.ready.connect(self._model_ready)

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
                                    execute=self.worker.call_in_worker,
                                    parallel=self.at_once.value())
        except ValueError as exc:  # a port in use, for example
            self.address.setText(f"Not serving: {exc}")
            self.enabled.blockSignals(True)
            self.enabled.setChecked(False)
            self.enabled.blockSignals(False)
            self.state_changed.emit("")
            return
        self.server.start()
        self.store.set_setting(PORT_SETTING, self.port.value())
        self.store.set_setting(PARALLEL_SETTING, self.at_once.value())
        self.port.setEnabled(False)
        self.at_once.setEnabled(False)
        together = (f"; {self.server.parallel} requests at once" if self.server.parallel > 1
                    else "")
        fewer = f" ({self.server.parallel_note})" if self.server.parallel_note else ""
        self.address.setText(f"Serving at <b>{self.server.url}</b> (base URL for OpenAI "
                             f"clients; any API key){together}{fewer}")
        self.state_changed.emit(self.server.url)

    def stop(self) -> None:
        """Stop serving: a request being answered ends at its next step. Idempotent."""
        if self.server is None:
            return
        self.server.stop()
        self.server = None
        self.port.setEnabled(True)
        self.at_once.setEnabled(True)
        self.address.setText("Off")
        self.state_changed.emit("")

    def _model_closing(self) -> None:
        """On the worker's thread, before the loaded model closes."""
        server = self.server
        if server is not None and isinstance(server.lane, ParallelEngineLane):
            server.lane.abandon()

    def _model_ready(self, _ready: object) -> None:
        """Another model loaded: requests at once need lanes on it."""
        server = self.server
        if server is not None and isinstance(server.lane, ParallelEngineLane):
            self.stop()
            self.start()
