"""The engine panel's draft selector offscreen: heads and the local draft models that
pass the header compatibility check with the selected model (never an incompatible or
oversized one), a model's paired draft selected by default, and choosing a draft model
loading the real engine with the draft drafter (F32 target, bundled Q4_0 draft)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from app.conversation_store import ConversationStore  # noqa: E402
from app.gui.engine_panel import DRAFT_PREFIX, EnginePanel  # noqa: E402
from engine.hub.draft_pairing import BUNDLED_DRAFT_FILE  # noqa: E402
from engine.hub.local_models import LocalModel, ModelRegistry  # noqa: E402
from tests.vocab_gguf import other_vocab, write_vocab_gguf  # noqa: E402

pytest.importorskip("pytestqt")


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_path: Path) -> Path:
    """A Tandem data directory with the prepared bundled model (a link to the real one)
    and a registry holding the F32 conversion, paired with the bundled model as its
    draft, and a small GGUF of another vocabulary."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / BUNDLED_DRAFT_FILE).symlink_to(model_path)
    monkeypatch.setenv("TANDEM_HOME", str(home))
    return home


def _register(home: Path, f32: Path, other: Path) -> Path:
    registry = ModelRegistry(home / "models" / "models.json")
    bundled = home / "models" / BUNDLED_DRAFT_FILE
    registry.add(LocalModel("f32", str(f32), "import", f32.stat().st_size, "F32",
                            draft_path=str(bundled)))
    registry.add(LocalModel("other", str(other), "import", other.stat().st_size, "F32"))
    return bundled


def _entries(panel: EnginePanel) -> list[str]:
    return [str(panel.head_box.itemData(i)) for i in range(panel.head_box.count())]


def _pick_model(qtbot, panel: EnginePanel, path: str):  # noqa: ANN001, ANN202
    panel.model_box.setCurrentIndex(panel.model_box.findData(path))
    with qtbot.waitSignal(panel.choice_changed) as blocker:
        panel.model_box.activated.emit(panel.model_box.currentIndex())
    return blocker.args[0]


def test_lists_compatible_drafts_only_and_selects_the_paired_one(
        qtbot, home: Path, model_path: Path, f32_model_path: Path, tmp_path: Path) -> None:
    # Small enough to draft for the F32 model, but another vocabulary: never listed.
    other = write_vocab_gguf(tmp_path / "other-vocab.gguf", model_path, edit=other_vocab)
    bundled = _register(home, f32_model_path, other)
    store = ConversationStore(tmp_path / "chat.sqlite3")
    panel = EnginePanel(store)
    qtbot.addWidget(panel)
    choice = _pick_model(qtbot, panel, str(f32_model_path))
    drafts = [e for e in _entries(panel) if e.startswith(DRAFT_PREFIX)]
    assert drafts == [DRAFT_PREFIX + str(bundled)]  # not the other vocabulary
    assert "draft model" in panel.head_box.currentText()  # the paired draft, by default
    assert choice.draft_model == bundled and choice.head_dir is None
    assert choice.drafter == "auto"  # auto weighs the draft model
    # The bundled model gets no draft model: the F32 one is four times its size.
    _pick_model(qtbot, panel, "")
    assert not any(e.startswith(DRAFT_PREFIX) for e in _entries(panel))
    assert panel.choice().draft_model is None
    # Back to F32; picking a head and then the draft model switches the drafter.
    _pick_model(qtbot, panel, str(f32_model_path))
    panel.head_box.setCurrentIndex(0)
    panel.head_box.activated.emit(0)
    assert panel.choice().draft_model is None and panel.choice().head_dir is None
    i = panel.head_box.findData(DRAFT_PREFIX + str(bundled))
    panel.head_box.setCurrentIndex(i)
    with qtbot.waitSignal(panel.choice_changed) as blocker:
        panel.head_box.activated.emit(i)
    choice = blocker.args[0]
    assert (choice.drafter, choice.draft_model) == ("draft", bundled)
    assert panel.drafter_box.currentData() == "draft"
    # Remembered for the next start.
    again = EnginePanel(store)
    qtbot.addWidget(again)
    assert again.choice() == choice
    store.close()


def test_a_chosen_draft_model_loads_the_draft_drafter(qtbot, home: Path, model_path: Path,
                                                      f32_model_path: Path,
                                                      tmp_path: Path) -> None:
    from app.gui.engine_worker import EngineWorker

    other = write_vocab_gguf(tmp_path / "other-vocab.gguf", model_path, edit=other_vocab)
    bundled = _register(home, f32_model_path, other)
    store = ConversationStore(tmp_path / "chat.sqlite3")
    panel = EnginePanel(store)
    qtbot.addWidget(panel)
    _pick_model(qtbot, panel, str(f32_model_path))
    panel.drafter_box.setCurrentIndex(panel.drafter_box.findData("draft"))
    with qtbot.waitSignal(panel.choice_changed) as blocker:
        panel.drafter_box.activated.emit(panel.drafter_box.currentIndex())
    choice = blocker.args[0]
    assert (choice.drafter, choice.draft_model) == ("draft", bundled)
    worker = EngineWorker()
    ready, failed = [], []
    worker.ready.connect(ready.append)
    worker.failed.connect(failed.append)
    worker.load(replace(choice, n_ctx=512, n_threads=2))  # in this thread: the test waits
    try:
        assert not failed, failed
        assert ready[0].drafter == "draft" and ready[0].model_path == str(f32_model_path)
        engine = worker.current_engine()
        assert engine is not None and engine.drafter is not None
        assert engine.drafter.is_draft_model
    finally:
        worker.shutdown()
        store.close()


def test_drafters_the_model_cannot_use_are_greyed_with_the_reason(
        qtbot, home: Path, model_path: Path, tmp_path: Path) -> None:
    """The bundled model has no MTP block: offered greyed, the tooltip says why; a
    synthetic Qwen3.5 with one offers it, and picking that model keeps the choice."""
    from PySide6.QtCore import Qt

    from engine.gguf.architectures import TinyShape, write_architecture_gguf

    store = ConversationStore(tmp_path / "chats.db")
    panel = EnginePanel(store)
    qtbot.addWidget(panel)
    mtp = panel.drafter_box.findData("mtp")
    item = panel.drafter_box.model().item(mtp)
    assert not item.isEnabled()
    tip = panel.drafter_box.itemData(mtp, Qt.ItemDataRole.ToolTipRole)
    assert tip.startswith("Not offered") and "no next-token" in tip
    assert panel.drafter_box.model().item(panel.drafter_box.findData("eagle3")).isEnabled()

    qwen = write_architecture_gguf("qwen35", tmp_path / "qwen35-mtp.gguf", model_path,
                                   TinyShape(hidden=128, n_layers=2, ffn=256, ssm_state=32,
                                             mtp_layers=1))
    store.set_setting("models", [str(qwen)])
    panel._fill()
    _pick_model(qtbot, panel, str(qwen))
    assert panel.drafter_box.model().item(mtp).isEnabled()
    assert not panel.drafter_box.model().item(panel.drafter_box.findData("eagle3")).isEnabled()


def test_the_drafter_box_offers_the_engines_list(qtbot, home: Path, tmp_path: Path) -> None:
    """The box lists the engine's offered drafters in its order (drafts from memory
    among them), each a name the engine takes."""
    from engine.drafters import DRAFTER_NAMES, OFFERED_DRAFTERS

    store = ConversationStore(tmp_path / "chat.sqlite3")
    panel = EnginePanel(store)
    qtbot.addWidget(panel)
    box = panel.drafter_box
    assert [box.itemData(i) for i in range(box.count())] == list(OFFERED_DRAFTERS)
    assert "memory" in OFFERED_DRAFTERS and set(OFFERED_DRAFTERS) <= {"auto", *DRAFTER_NAMES}
    store.close()


def test_an_added_eagle3_head_loads_the_eagle3_drafter(qtbot, home: Path, model_path: Path,
                                                       tmp_path: Path) -> None:
    """"Add head…" takes an EAGLE-3 GGUF as well as a torch head's folder: the head box
    lists it, the choice drafts with it, and the engine runs it (the drafter box's
    EAGLE-3 and MTP entries load, where they used to fail as unknown drafters)."""
    from app.gui.engine_worker import EngineWorker
    from engine.drafters.eagle3 import Eagle3Drafter
    from engine.gguf.eagle3 import is_eagle3_head
    from tests.test_eagle3_drafter import copying_head

    head = copying_head(tmp_path / "copying.gguf", model_path)
    assert is_eagle3_head(head) and not is_eagle3_head(model_path)
    store = ConversationStore(tmp_path / "chat.sqlite3")
    panel = EnginePanel(store)
    qtbot.addWidget(panel)
    with qtbot.waitSignal(panel.choice_changed) as blocker:
        panel.add_head(head)
    choice = blocker.args[0]
    assert (choice.drafter, choice.head_dir) == ("eagle3", head)
    assert panel.head_box.currentText() == "copying.gguf (EAGLE-3)"
    worker = EngineWorker()
    ready, failed = [], []
    worker.ready.connect(ready.append)
    worker.failed.connect(failed.append)
    worker.load(replace(choice, model_path=model_path, n_ctx=512, n_threads=2))
    try:
        assert not failed, failed
        assert ready[0].drafter == "eagle3"
        assert isinstance(worker.current_engine().drafter, Eagle3Drafter)
    finally:
        worker.shutdown()
        store.close()
