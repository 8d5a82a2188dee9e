"""The switch that lends this computer to other Tandem apps as a worker (`tandem worker` in
a child process, on 127.0.0.1 only: the RPC protocol has no authentication, so another
machine reaches it through an SSH tunnel, as the label says)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QGroupBox,
    QWidget,
)

from app.conversation_store import ConversationStore
from app.gui.switch_box import lay_out_switch, port_box
from engine.errors import WorkerError
from engine.workers.endpoints import DEFAULT_PORT
from engine.workers.handshake import probe_worker

PORT_SETTING = "worker_port"
REPO = Path(__file__).resolve().parents[2]
READY_POLL_MS = 200


class WorkerSwitch(QGroupBox):
    """Starts and stops a loopback worker; ``state_changed`` carries its HOST:PORT while
    serving, "" when stopped."""

    state_changed = Signal(str)

    def __init__(self, store: ConversationStore, parent: QWidget | None = None) -> None:
        super().__init__("Lend this computer", parent)
        self.store = store
        self.process: subprocess.Popen | None = None
        self.endpoint = ""
        self.enabled = QCheckBox("Worker for other Tandem apps (CPU)")
        self.enabled.setToolTip(
            "Other Tandem apps put their model's layers here with --workers. Loopback only: "
            "the protocol has no authentication; reach it from another machine through an "
            "SSH tunnel.")
        self.port = port_box(store, PORT_SETTING, DEFAULT_PORT, 1024)
        self.state = lay_out_switch(self, self.enabled, self.port)
        self._poll = QTimer(self)
        self._poll.setInterval(READY_POLL_MS)
        self._poll.timeout.connect(self._check)
        self.enabled.toggled.connect(lambda on: self.start() if on else self.stop())

    def start(self) -> None:
        if self.process is not None:
            return
        self.endpoint = f"127.0.0.1:{self.port.value()}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "worker", "--port", str(self.port.value())],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        self.port.setEnabled(False)
        self.state.setText("Starting…")
        self._poll.start()

    def _check(self) -> None:
        """Ready once it answers a handshake; a worker that exits says why."""
        process = self.process
        if process is None:
            self._poll.stop()
            return
        if process.poll() is not None:
            why = (process.stderr.read() if process.stderr else "").strip().splitlines()
            self._stopped(f"Not serving: {why[-1] if why else 'the worker exited'}")
            return
        try:
            info = probe_worker(self.endpoint, timeout_s=0.5)
        except WorkerError:
            return
        self._poll.stop()
        self.store.set_setting(PORT_SETTING, self.port.value())
        self.state.setText(
            f"Serving at <b>{self.endpoint}</b> ({info.free_bytes / 2**30:.1f} GiB free). "
            f"Another machine: <code>ssh -N -L {self.port.value()}:127.0.0.1:"
            f"{self.port.value()} you@this-computer</code>, then Workers = "
            f"127.0.0.1:{self.port.value()}.")
        self.state_changed.emit(self.endpoint)

    def stop(self) -> None:
        """Stop lending: a client's answer in progress ends with the worker's name."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait(10)
        self._stopped("Off")

    def _stopped(self, text: str) -> None:
        self._poll.stop()
        self.process = None
        self.port.setEnabled(True)
        self.state.setText(text)
        self.enabled.blockSignals(True)
        self.enabled.setChecked(False)
        self.enabled.blockSignals(False)
        self.state_changed.emit("")
