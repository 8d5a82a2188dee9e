"""The app's switch serves the window's engine to other programs through the OpenAI API."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import httpx2 as httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from tests.gui_helpers import open_window, send_and_wait  # noqa: E402


def test_switch_serves_the_loaded_model_beside_the_chat(qtbot, tmp_path: Path,
                                                        model_path: Path) -> None:
    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path)
    switch = w.api_switch
    switch.port.setValue(0)  # any free port
    with qtbot.waitSignal(switch.state_changed, timeout=10_000) as blocker:
        switch.enabled.setChecked(True)
    url = blocker.args[0]
    assert url.startswith("http://127.0.0.1:") and url in switch.address.text()
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    assert answer.choices[0].message.content
    assert answer.model_extra["tandem"]["drafter"]
    # The chat still works with the server on: both use the one engine in turn.
    assert send_and_wait(qtbot, w, "Hello!").text
    switch.enabled.setChecked(False)
    assert switch.address.text() == "Off" and switch.server is None
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/models", timeout=5)
    switch.enabled.setChecked(True)  # and on again, then the window closes with it on
    assert switch.server is not None
    w.close()
    assert switch.server is None


def test_the_switch_answers_requests_together_each_as_alone(qtbot, tmp_path: Path,
                                                            model_path: Path) -> None:
    """With "requests at once" at 2, two requests sent together are decoded together on
    the window's engine (its thread, between the chat's answers), and each answer is
    the one it gets alone; the chat goes on beside them, and the window closes with
    them served."""
    import concurrent.futures

    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path)
    switch = w.api_switch
    switch.port.setValue(0)
    switch.at_once.setValue(2)
    with qtbot.waitSignal(switch.state_changed, timeout=30_000) as blocker:
        switch.enabled.setChecked(True)
    url = blocker.args[0]
    assert "2 requests at once" in switch.address.text(), switch.address.text()
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=180)
    questions = ["Name three colours.", "Count from one to five."]

    def ask(question: str) -> str:
        answer = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": question}], max_tokens=24)
        return answer.choices[0].message.content or ""

    alone = [ask(q) for q in questions]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(ask, questions))
    assert together == alone and all(alone)
    lanes = switch.server.lane.lanes  # type: ignore[union-attr]
    assert max(lanes.rows_decoded) == 2  # their tokens were rows of one batch
    assert send_and_wait(qtbot, w, "Hello!").text
    assert ask(questions[0]) == alone[0]  # and after the chat's answer
    # Another model: the lanes' context goes before the old model does (a request then is
    # refused, not left waiting), and the server comes back with lanes on the new one.
    switch.worker.call_in_worker(switch.server.lane.abandon)  # type: ignore[union-attr]
    with pytest.raises(openai.APIStatusError):
        ask(questions[1])
    with qtbot.waitSignal(switch.state_changed, timeout=30_000):
        switch._model_ready(None)
    client = openai.OpenAI(base_url=switch.server.url, api_key="unused",  # type: ignore[union-attr]
                           max_retries=0, timeout=180)
    assert ask(questions[1]) == alone[1]
    w.close()
