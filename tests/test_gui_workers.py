"""The app with a worker (issue 37): the Workers field loads the model there, and a worker
killed mid-answer ends that answer with the worker's name while the window lives on,
keeps the conversation, and reopens the model on this machine."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

from PySide6.QtCore import Qt  # noqa: E402

from app.conversation_store import FAILED  # noqa: E402
from tests.gui_helpers import ANSWER_TIMEOUT_MS, open_window, type_and_send  # noqa: E402
from tests.test_workers import running_worker  # noqa: E402


@pytest.mark.slow
def test_a_lost_worker_ends_the_answer_and_the_app_reopens_the_model_here(
        qtbot, tmp_path: Path, model_path: Path) -> None:  # noqa: ANN001
    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path, max_tokens=400)
    with running_worker() as (endpoint, worker):
        with qtbot.waitSignal(w.engine_ready, timeout=ANSWER_TIMEOUT_MS) as loaded:
            w.engine_panel.workers_edit.setText(endpoint)
            qtbot.keyClick(w.engine_panel.workers_edit, Qt.Key.Key_Return)
        assert endpoint in loaded.args[0].note  # "the target runs all 30 layers ... on"
        assert w.store.get_setting("workers", "") == endpoint

        with qtbot.waitSignal(w.engine_ready, timeout=ANSWER_TIMEOUT_MS) as reopened:
            type_and_send(qtbot, w, "Write a very long story about a dragon who bakes bread.")
            qtbot.waitUntil(lambda: len(w.transcript.messages[-1].content) > 20,
                            timeout=ANSWER_TIMEOUT_MS)
            worker.kill()
        assert "worker was lost" in reopened.args[0].note
    assert endpoint not in reopened.args[0].note  # this machine's engine now
    question, answer = w.transcript.messages[-2:]
    assert question.content.startswith("Write a very long story")
    assert answer.status == FAILED and answer.content  # what came before stays
    assert endpoint in answer.info["error"] and "stopped answering" in answer.info["error"]
    # The user's setting keeps the worker; the next answer comes from this machine.
    assert w.engine_panel.workers_edit.text() == endpoint
    with qtbot.waitSignal(w.controller.answer_finished, timeout=ANSWER_TIMEOUT_MS) as done:
        type_and_send(qtbot, w, "Hello again")
    assert done.args[0].text


def test_the_lend_switch_serves_this_computer_on_loopback(qtbot, tmp_path: Path) -> None:  # noqa: ANN001
    from app.benchmarks.loopback_worker import free_port
    from app.conversation_store import ConversationStore
    from app.gui.worker_switch import WorkerSwitch
    from engine.workers.handshake import probe_worker

    with ConversationStore(tmp_path / "chat.sqlite3") as store:
        switch = WorkerSwitch(store)
        qtbot.addWidget(switch)
        switch.port.setValue(free_port())
        with qtbot.waitSignal(switch.state_changed, timeout=ANSWER_TIMEOUT_MS) as serving:
            switch.enabled.setChecked(True)
        endpoint = serving.args[0]
        assert endpoint.startswith("127.0.0.1:") and "ssh -N -L" in switch.state.text()
        assert probe_worker(endpoint).devices
        with qtbot.waitSignal(switch.state_changed) as stopped:
            switch.enabled.setChecked(False)
        assert stopped.args[0] == "" and switch.process is None and switch.port.isEnabled()
