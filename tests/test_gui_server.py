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
