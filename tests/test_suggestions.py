"""A first start suggests models that fit this machine, with the speed to expect, and the
window shows them (with this computer in one line) on an empty chat."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine.hub.fit import MachineMemory  # noqa: E402
from engine.hub.suggestions import SUGGESTED, memory_bandwidth, suggestions  # noqa: E402
from tests.gui_helpers import open_window, send_and_wait  # noqa: E402

GB = 10**9


def test_only_models_that_fit_are_suggested_largest_first() -> None:
    roomy = suggestions(MachineMemory(32 * GB, 24 * GB), bandwidth=24 * GB, most=10)
    assert len(roomy) == len(SUGGESTED)  # every one fits in 24 GB
    sizes = [s.model.size_bytes for s in roomy]
    assert sizes == sorted(sizes, reverse=True)
    small = suggestions(MachineMemory(4 * GB, 3 * GB), bandwidth=24 * GB, most=10)
    assert small and all(s.model.size_bytes < 2 * GB for s in small)  # 3 GB free
    assert suggestions(MachineMemory(1 * GB, GB // 2), 24 * GB) == []
    gpu = suggestions(MachineMemory(8 * GB, 4 * GB, vram_free=12 * GB), 24 * GB, most=1)
    assert gpu[0].where == "on the GPU" and "tokens/s" in gpu[0].describe()
    # A model twice the size decodes about half as fast: one token reads every weight.
    a, b = roomy[0], roomy[-1]
    assert a.tok_per_s * a.model.size_bytes == pytest.approx(b.tok_per_s * b.model.size_bytes)


def test_the_bandwidth_is_measured_once_and_kept(tmp_path: Path) -> None:
    first = memory_bandwidth(tmp_path)
    assert 1 * GB < first < 10_000 * GB
    assert memory_bandwidth(tmp_path) == first  # read back, not measured again


def test_an_empty_chat_shows_the_machine_and_models_that_fit(qtbot, tmp_path: Path,  # noqa: ANN001
                                                            model_path: Path) -> None:
    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path)
    welcome = w.chat.welcome
    assert welcome.isVisible() and not w.chat.transcript.isVisible()
    assert welcome.machine.text().startswith("This computer: ") and "cores" in \
        welcome.machine.text()
    assert "is ready" in welcome.ready.text()
    assert len(welcome.buttons) == len(w.engine_info.suggested) >= 1  # 24 GB here
    send_and_wait(qtbot, w, "Hello")
    assert not welcome.isVisible() and w.chat.transcript.isVisible()
