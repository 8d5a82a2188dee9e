"""The model wizard driven offscreen against the local fake Hub: search, select,
download target and head, pause, cancel and resume, import."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402 - the platform must be set before Qt loads

import pytest  # noqa: E402

from engine.hub.cache_layout import RepoCache  # noqa: E402
from engine.hub.fit import MachineMemory  # noqa: E402
from engine.hub.local_models import ModelRegistry  # noqa: E402
from tests.hub_server import (  # noqa: E402
    HEAD_REPO,
    TARGET_REPO,
    FakeHub,
    standard_repos,
    write_tiny_gguf,
)

pytest.importorskip("pytestqt")
GiB = 2**30


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory):
    return standard_repos(tmp_path_factory.mktemp("repos"))


@pytest.fixture()
def hub(repos):
    with FakeHub(repos) as h:
        yield h


@pytest.fixture()
def dialog(qtbot, hub: FakeHub, tmp_path: Path):
    from app.gui.model_wizard import ModelWizardDialog

    d = ModelWizardDialog(None, hub_endpoint=hub.endpoint, cache_dir=tmp_path / "cache",
                          registry=ModelRegistry(tmp_path / "home" / "models" / "models.json"),
                          memory=MachineMemory(16 * GiB, 8 * GiB, None))
    qtbot.addWidget(d)
    yield d
    d.shutdown()


# The tests wait on widget state, not on the worker's signals: a pytest-qt blocker on a
# signal emitted in the worker thread would run (and stop its timer) in that thread.
def open_repo(qtbot, d, repo_id: str) -> None:
    d.query.setText("llama")
    qtbot.mouseClick(d.search_button, _left())
    qtbot.waitUntil(lambda: d.repos.count() == 3, timeout=10_000)
    row = next(i for i in range(d.repos.count()) if d.repos.item(i).text().startswith(repo_id))
    d.repos.setCurrentRow(row)
    qtbot.waitUntil(lambda: d.details is not None, timeout=10_000)


def _left():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def select_quant(d, quant: str) -> None:
    row = next(i for i in range(d.files.rowCount()) if d.files.item(i, 0).text() == quant)
    d.files.selectRow(row)


def test_search_select_download_appears_in_local_list(qtbot, dialog, tmp_path: Path) -> None:
    d = dialog
    open_repo(qtbot, d, TARGET_REPO)
    assert [d.files.item(i, 0).text() for i in range(d.files.rowCount())] == ["Q4_K_M",
                                                                              "Q8_0"]
    assert d.files.item(0, 2).text() == "fits in RAM"
    assert HEAD_REPO in d.heads.currentText()  # the fitting head is preselected
    select_quant(d, "Q4_K_M")
    assert d.download_button.isEnabled()
    with qtbot.waitSignal(d.model_added, timeout=20_000) as blocker:
        qtbot.mouseClick(d.download_button, _left())
    model = blocker.args[0]
    assert model.name == f"{TARGET_REPO}:Q4_K_M" and Path(model.path).is_file()
    assert model.head_repo == HEAD_REPO
    assert any(model.name in d.local.item(i).text() for i in range(d.local.count()))
    assert d.progress_bar.value() == 1000 and "ready" in d.status.text()


def test_pause_cancel_then_resume(qtbot, dialog, hub: FakeHub) -> None:
    d = dialog
    hub.faults.delay_per_chunk_s = 0.02  # ~1 s for the Q8_0 file: time to press buttons
    open_repo(qtbot, d, TARGET_REPO)
    select_quant(d, "Q8_0")
    d.heads.setCurrentIndex(0)  # no head
    qtbot.mouseClick(d.download_button, _left())
    qtbot.waitUntil(lambda: " of " in d.status.text(), timeout=10_000)  # progress shown
    qtbot.mouseClick(d.pause_button, _left())
    assert d.pause_button.text() == "Resume", (d.status.text(), d.pause_button.isEnabled())
    qtbot.waitUntil(lambda: "paused" in d.status.text(), timeout=10_000)
    qtbot.mouseClick(d.pause_button, _left())  # resume
    assert d.keep_partial.isChecked()
    qtbot.mouseClick(d.cancel_button, _left())
    qtbot.waitUntil(lambda: "Cancelled" in d.status.text(), timeout=10_000)
    assert "kept" in d.status.text()
    choice = d.details.rows[1][0]
    part = RepoCache(d.worker.cache_dir, TARGET_REPO).incomplete(choice.files[0].etag)
    n_part = part.stat().st_size
    assert 0 < n_part < choice.n_bytes
    # Download again: it continues from the partial file.
    hub.faults.delay_per_chunk_s = 0.0
    with qtbot.waitSignal(d.model_added, timeout=20_000):
        qtbot.mouseClick(d.download_button, _left())
    assert hub.file_gets(choice.name)[-1] == f"bytes={n_part}-"


def test_failed_download_is_shown_and_not_listed(qtbot, dialog, hub: FakeHub) -> None:
    d = dialog
    hub.faults.corrupt.add("Tiny-Llama-Q4_K_M.gguf")
    open_repo(qtbot, d, TARGET_REPO)
    select_quant(d, "Q4_K_M")
    qtbot.mouseClick(d.download_button, _left())
    qtbot.waitUntil(lambda: "Failed" in d.status.text(), timeout=20_000)
    assert "sha256" in d.status.text() and d.local.count() == 0
    assert d.download_button.isEnabled()


def test_import(qtbot, dialog, tmp_path: Path) -> None:
    d = dialog
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    assert d.import_file(bad) is None and "not a GGUF" in d.status.text()
    with qtbot.waitSignal(d.model_added):
        model = d.import_file(write_tiny_gguf(tmp_path / "mine-Q4_0.gguf"))
    assert model is not None and d.local.count() == 1 and "mine-Q4_0" in d.local.item(0).text()


@pytest.fixture()
def draft_dialog(qtbot, model_path: Path, tmp_path: Path):
    from app.gui.model_wizard import ModelWizardDialog
    from engine.hub.local_models import LocalModel
    from tests.draft_repos import draft_repos, write_user_catalog
    from tests.vocab_gguf import write_vocab_gguf

    registry = ModelRegistry(tmp_path / "home" / "models" / "models.json")
    write_user_catalog(tmp_path / "home")  # pairs an incompatible draft too
    local = write_vocab_gguf(tmp_path / "local-draft.gguf", model_path, name="local")
    registry.add(LocalModel("local-draft", str(local), "import", local.stat().st_size, "F32"))
    (tmp_path / "repos").mkdir()
    with FakeHub(draft_repos(tmp_path / "repos", model_path)) as hub:
        d = ModelWizardDialog(None, hub_endpoint=hub.endpoint, cache_dir=tmp_path / "cache",
                              registry=registry, memory=MachineMemory(16 * GiB, 8 * GiB, None))
        qtbot.addWidget(d)
        yield d, hub
        d.shutdown()


def test_drafts_shown_checked_and_downloaded_with_the_target(qtbot, draft_dialog) -> None:
    from tests.draft_repos import CATALOG_DRAFT, OTHER_DRAFT, TARGET

    d, hub = draft_dialog
    d.query.setText("SmolLM2-Big")
    qtbot.mouseClick(d.search_button, _left())
    qtbot.waitUntil(lambda: d.repos.count() == 1, timeout=10_000)
    d.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: d.details is not None, timeout=20_000)
    cells = {d.files.item(i, 0).text(): d.files.item(i, 3).text()
             for i in range(d.files.rowCount())}
    # Each row's default: the compatible local GGUF (nothing to download), checked.
    assert set(cells) == {"Q4_K_M", "Q8_0"}
    assert all(c.startswith("local-draft (on this machine, vocabulary ✓") for c in cells.values())
    # The incompatible pairing is never offered; why is said.
    assert OTHER_DRAFT in d.draft_note.text() and "vocabulary type" in d.draft_note.text()
    assert d.files.currentRow() == 1 and d.files.item(1, 0).text() == "Q8_0"
    offered = [d.drafts.itemText(i) for i in range(d.drafts.count())]
    assert offered[0] == "none" and len(offered) == 3 and CATALOG_DRAFT in offered[2]
    assert not any(OTHER_DRAFT in t for t in offered)
    select_quant(d, "Q4_K_M")  # the 3 MB catalog draft is over a quarter of it
    assert [d.drafts.itemText(i) for i in range(d.drafts.count())] == offered[:2]
    select_quant(d, "Q8_0")
    # The fit counts the draft chosen: the catalog's (downloaded) one is bigger.
    tip_local = d.files.item(1, 2).toolTip()
    d.drafts.setCurrentIndex(2)
    d.drafts.activated.emit(2)
    assert "draft model with its KV cache" in d.files.item(1, 2).toolTip()
    assert d.files.item(1, 2).toolTip() != tip_local and CATALOG_DRAFT in d.files.item(1, 3).text()
    with qtbot.waitSignal(d.model_added, timeout=30_000) as blocker:
        qtbot.mouseClick(d.download_button, _left())
    model = blocker.args[0]
    assert model.name == f"{TARGET}:Q8_0" and model.draft_repo == CATALOG_DRAFT
    assert Path(model.draft_path).is_file() and Path(model.path).is_file()
    assert len(hub.file_gets("smollm2-360m-instruct-q8_0.gguf")) >= 2  # header, then file
    assert any("draft" in d.local.item(i).text() and model.name in d.local.item(i).text()
               for i in range(d.local.count()))
