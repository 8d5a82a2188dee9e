"""Killing the app mid-answer loses nothing written: the partial answer is on disk and
shows as interrupted on the next start."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import signal  # noqa: E402
import sqlite3  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from app.conversation_store import INTERRUPTED, ConversationStore  # noqa: E402
from tests.gui_helpers import open_window  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _streamed(db: Path) -> tuple[str, str] | None:
    """The assistant message as another process sees it (read only: no recovery)."""
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            row = con.execute("SELECT content, status FROM messages WHERE role = 'assistant'"
                              " ORDER BY id DESC LIMIT 1").fetchone()
    except sqlite3.OperationalError:  # the app has not created its tables yet
        return None
    return row


def test_sigkill_mid_answer_keeps_the_partial_answer(qtbot, tmp_path: Path,
                                                     model_path: Path) -> None:
    db = tmp_path / "chat.sqlite3"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.gui", "--db", str(db), "--model", str(model_path),
         "--threads", "2", "--max-tokens", "2000",
         "--send", "Write a very long story about a dragon who learns to bake bread."],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        row = None
        while time.monotonic() < deadline and proc.poll() is None:
            row = _streamed(db)
            if row and row[1] == "streaming" and len(row[0]) >= 40:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert row is not None and row[1] == "streaming", row
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    seen_before_kill = row[0]

    with ConversationStore(db) as store:
        assert store.n_recovered == 1
        conv = store.conversations()[0]
        assert conv.n_interrupted == 1
        answer = store.messages(conv.id)[-1]
        assert answer.status == INTERRUPTED
        assert answer.content.startswith(seen_before_kill)
        print(f"\nkilled mid-answer: {len(answer.content)} characters kept, marked interrupted")

    # The next start shows it: the list marks the conversation, the transcript the answer.
    w = open_window(qtbot, db, model_path)
    assert w.conversations.model.data(w.conversations.model.index(0)).startswith("⚠")
    last = w.transcript.messages[-1]
    assert (last.status, last.content) == (INTERRUPTED, answer.content)
    assert w.chat.regenerate_button.isEnabled()
