"""Branches in the real window (issue 36, item 3): regenerating or editing keeps the old
version, "‹ n/m ›" switches between versions, a version can be deleted, and a follow-up
after a switch reuses the cached prompt up to where the branches part."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

from PySide6.QtCore import QPoint, Qt  # noqa: E402

from tests.gui_helpers import ANSWER_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402


def _texts(w) -> list[str]:  # noqa: ANN001
    return [m.content for m in w.transcript.messages]


def _click_version(qtbot, w, row: int, step: int) -> None:  # noqa: ANN001
    """Click the "‹" (step -1) or "›" (+1) drawn on a message, as a user would."""
    view = w.chat.transcript
    index = w.transcript.index(row)
    msg = w.transcript.messages[row]
    rects = view.message_delegate.version_rects(view.visualRect(index), msg, view.font())
    assert rects is not None, "a message with one version shows no switch"
    center = (rects[0] if step < 0 else rects[2]).center()
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton,
                     pos=QPoint(int(center.x()), int(center.y())))


def test_versions_are_kept_switched_and_deleted(qtbot, tmp_path: Path, model_path: Path):
    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path, max_tokens=12)
    c = w.controller
    send_and_wait(qtbot, w, "Name a colour.")
    first_answer = w.transcript.messages[1]
    assert first_answer.n_siblings == 1
    # Regenerate: a second version of the answer; the first stays.
    with qtbot.waitSignal(c.answer_finished, timeout=ANSWER_TIMEOUT_MS):
        assert c.regenerate()
    second = w.transcript.messages[1]
    assert (second.sibling_index, second.n_siblings) == (1, 2)
    assert second.id != first_answer.id
    _click_version(qtbot, w, 1, -1)
    assert w.transcript.messages[1].id == first_answer.id
    assert (w.transcript.messages[1].sibling_index, w.transcript.messages[1].n_siblings) == (0, 2)
    _click_version(qtbot, w, 1, +1)
    assert w.transcript.messages[1].id == second.id
    # Edit the question: a new branch from the top; the old question and its answers stay.
    user = w.transcript.messages[0]
    with qtbot.waitSignal(c.answer_finished, timeout=ANSWER_TIMEOUT_MS):
        assert c.edit_and_resend(user.id, "Name a fruit.")
    assert _texts(w)[0] == "Name a fruit." and w.transcript.messages[0].n_siblings == 2
    assert c.switch_version(w.transcript.messages[0].id, -1)
    assert _texts(w)[0] == "Name a colour." and w.transcript.messages[1].n_siblings == 2
    assert len(w.store.messages(c.current_id)) == 2
    # A follow-up on the older branch finds its prompt cached up to where they part.
    outcome = send_and_wait(qtbot, w, "Another one?")
    assert outcome.stats.n_prompt_reused > 0
    # Delete the version on show: the other one shows, with its own answer.
    assert c.delete_version(w.transcript.messages[0].id)
    assert _texts(w)[0] == "Name a fruit." and w.transcript.messages[0].n_siblings == 1
    assert len(_texts(w)) == 2
    db = w.store.db
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 2
