"""The conversation store on its own (no Qt, no model): durability and recovery."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from app.conversation_store import COMPLETE, INTERRUPTED, STREAMING, ChatSettings, ConversationStore


def test_messages_round_trip_in_order(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "c.db") as store:
        assert store.journal_mode() == "wal"
        conv = store.create_conversation("first", "be brief",
                                         ChatSettings(temperature=0.7, seed=3))
        store.add_message(conv.id, "user", "hello")
        store.add_message(conv.id, "assistant", "hi there", info={"summary": "2 tokens"})
        msgs = store.messages(conv.id)
        assert [(m.position, m.role, m.content) for m in msgs] == [
            (0, "user", "hello"), (1, "assistant", "hi there")]
        assert msgs[1].info == {"summary": "2 tokens"}
        again = store.conversation(conv.id)
        assert again.system_prompt == "be brief"
        assert again.settings == ChatSettings(temperature=0.7, seed=3)


def test_streaming_answer_is_marked_interrupted_on_next_open(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    store = ConversationStore(db)
    conv = store.create_conversation()
    store.add_message(conv.id, "user", "tell me")
    msg = store.add_message(conv.id, "assistant", "", STREAMING)
    store.update_message(msg.id, "Once upon", STREAMING)
    # No close: as if the process died here. A second connection sees what was committed.
    reopened = ConversationStore(db)
    assert reopened.n_recovered == 1
    got = reopened.message(msg.id)
    assert (got.content, got.status) == ("Once upon", INTERRUPTED)
    assert reopened.conversation(conv.id).n_interrupted == 1
    reopened.close()
    store.close()


def test_branch_update_and_delete(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "c.db") as store:
        conv = store.create_conversation()
        for i in range(4):
            store.add_message(conv.id, "user" if i % 2 == 0 else "assistant", f"m{i}")
        store.branch_at(conv.id, 2)
        assert [m.content for m in store.messages(conv.id)] == ["m0", "m1"]
        new = store.add_message(conv.id, "user", "m2b")
        assert new.position == 2 and (new.sibling_index, new.n_siblings) == (1, 2)
        store.update_message(new.id, "m2c", COMPLETE)
        assert store.message(new.id).content == "m2c"
        with pytest.raises(ValueError):
            store.update_message(new.id, "x", "nonsense")
        store.delete_conversation(conv.id)
        assert store.conversations() == []
        assert store.messages(conv.id) == []


def test_conversations_newest_first_and_settings(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "c.db") as store:
        a = store.create_conversation("a")
        b = store.create_conversation("b")
        store.add_message(a.id, "user", "bump a")
        assert [c.title for c in store.conversations()] == ["a", "b"]
        store.update_conversation(b.id, title="b2")
        assert store.conversation(b.id).title == "b2"
        assert store.get_setting("models", []) == []
        store.set_setting("models", ["/x.gguf"])
        store.set_setting("models", ["/x.gguf", "/y.gguf"])
        assert store.get_setting("models") == ["/x.gguf", "/y.gguf"]
    with pytest.raises(sqlite3.ProgrammingError):
        store.conversations()


def test_unknown_settings_keys_are_ignored() -> None:
    assert ChatSettings.from_json('{"temperature": 0.5, "future_knob": 1}') == \
        ChatSettings(temperature=0.5)


def _chat(store: ConversationStore) -> tuple[int, list[int]]:
    conv = store.create_conversation()
    ids = [store.add_message(conv.id, r, t).id for r, t in
           (("user", "q"), ("assistant", "a1"), ("user", "q2"), ("assistant", "b1"))]
    return conv.id, ids


def test_edits_and_regenerations_keep_the_old_versions_as_siblings(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "c.db") as store:
        cid, ids = _chat(store)
        store.branch_at(cid, 3)  # regenerate the last answer
        b2 = store.add_message(cid, "assistant", "b2")
        path = store.messages(cid)
        assert [m.content for m in path] == ["q", "a1", "q2", "b2"]
        assert (path[3].sibling_index, path[3].n_siblings) == (1, 2)
        assert [m.content for m in store.siblings(b2.id)] == ["b1", "b2"]
        store.branch_at(cid, 0)  # edit the first question: a whole new conversation
        store.add_message(cid, "user", "q edited")
        store.add_message(cid, "assistant", "c1")
        assert [m.content for m in store.messages(cid)] == ["q edited", "c1"]
        # Back to the first version: below it, the newest version at each place.
        store.switch_to(ids[0])
        assert [m.content for m in store.messages(cid)] == ["q", "a1", "q2", "b2"]
        store.switch_to(ids[3])
        assert [m.content for m in store.messages(cid)] == ["q", "a1", "q2", "b1"]
        # Deleting the version on show shows the other one; the rest stays whole.
        store.delete_branch(ids[3])
        assert [m.content for m in store.messages(cid)] == ["q", "a1", "q2", "b2"]
        store.delete_branch(ids[0])  # the first version and all below it
        assert [m.content for m in store.messages(cid)] == ["q edited", "c1"]
        assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 2


def _version_1_database(path: Path) -> None:
    """A database as Tandem wrote it before branches (schema version 1)."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '', settings TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
            status TEXT NOT NULL, info TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL,
            updated_at REAL NOT NULL, UNIQUE (conversation_id, position));
        CREATE TABLE app_settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO conversations VALUES (1, 'old', 'sys', '{"temperature": 0.5}', 1, 2);
        INSERT INTO conversations VALUES (2, 'empty', '', '{}', 1, 1);
        INSERT INTO messages VALUES (7, 1, 0, 'user', 'hi', 'complete', '{}', 1, 1);
        INSERT INTO messages VALUES (9, 1, 1, 'assistant', 'hello', 'complete',
                                     '{"summary": "3 tokens"}', 1, 1);
        INSERT INTO messages VALUES (12, 1, 2, 'user', 'more', 'complete', '{}', 1, 1);
        INSERT INTO messages VALUES (13, 1, 3, 'assistant', 'half', 'streaming', '{}', 1, 1);
        INSERT INTO app_settings VALUES ('models', '["/x.gguf"]');
    """)
    db.commit()
    db.close()


def test_a_version_1_database_is_migrated_losing_nothing(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    _version_1_database(path)
    with ConversationStore(path) as store:
        assert store.schema_version() == 3  # through version 2
        msgs = store.messages(1)
        assert [(m.id, m.content, m.parent_id) for m in msgs] == [
            (7, "hi", None), (9, "hello", 7), (12, "more", 9), (13, "half", 12)]
        assert msgs[1].info == {"summary": "3 tokens"} and msgs[3].status == INTERRUPTED
        assert store.conversation(1).settings.temperature == 0.5
        assert store.messages(2) == [] and store.get_setting("models") == ["/x.gguf"]
        store.branch_at(1, 3)
        assert store.add_message(1, "assistant", "whole").id > 13  # ids never reused
        assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with ConversationStore(path) as again:  # opened again: nothing to migrate
        assert [m.content for m in again.messages(1)][-1] == "whole"


def test_a_kill_during_branch_switches_leaves_a_sound_database(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "c.db"
    with ConversationStore(path) as store:
        cid, ids = _chat(store)
        store.branch_at(cid, 1)
        store.add_message(cid, "assistant", "a2")
    script = (f"from app.conversation_store import ConversationStore\n"
              f"s = ConversationStore({str(path)!r})\n"
              f"print('ready', flush=True)\n"
              f"while True:\n"
              f"    for m in s.siblings({ids[1]}):\n"
              f"        s.switch_to(m.id)\n"
              f"        s.branch_at({cid}, 3)\n"
              f"        s.add_message({cid}, 'assistant', 'again')\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with ConversationStore(path) as store:
        db = store.db
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
        orphans = db.execute("SELECT COUNT(*) FROM messages m WHERE m.parent_id IS NOT NULL"
                             " AND NOT EXISTS (SELECT 1 FROM messages p WHERE"
                             " p.id = m.parent_id)").fetchone()[0]
        assert orphans == 0
        leaf = db.execute("SELECT current_leaf_id FROM conversations WHERE id = ?",
                          (cid,)).fetchone()[0]
        assert store.message(leaf).conversation_id == cid  # the leaf exists
        path_msgs = store.messages(cid)
        assert path_msgs[0].parent_id is None and path_msgs[-1].id == leaf


def _version_2_database(path: Path) -> None:
    """A database as Tandem wrote it before attachments (schema version 2)."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '', settings TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL, updated_at REAL NOT NULL, current_leaf_id INTEGER);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
            position INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
            status TEXT NOT NULL, info TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL,
            updated_at REAL NOT NULL);
        CREATE INDEX messages_by_parent ON messages (conversation_id, parent_id);
        CREATE TABLE app_settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO conversations VALUES (1, 'old', 'sys', '{"temperature": 0.5}', 1, 2, 9);
        INSERT INTO messages VALUES (7, 1, NULL, 0, 'user', 'hi', 'complete', '{}', 1, 1);
        INSERT INTO messages VALUES (8, 1, 7, 1, 'assistant', 'first', 'complete', '{}', 1, 1);
        INSERT INTO messages VALUES (9, 1, 7, 1, 'assistant', 'second', 'complete',
                                     '{"summary": "3 tokens"}', 1, 1);
        INSERT INTO app_settings VALUES ('models', '["/x.gguf"]');
        PRAGMA user_version = 2;
    """)
    db.commit()
    db.close()


def test_a_version_2_database_gains_attachments_losing_nothing(tmp_path: Path) -> None:
    from app.documents.reading import Document

    path = tmp_path / "v2.sqlite3"
    _version_2_database(path)
    with ConversationStore(path) as store:
        assert store.schema_version() == 3
        msgs = store.messages(1)
        assert [(m.id, m.content, m.parent_id, m.n_siblings) for m in msgs] == [
            (7, "hi", None, 1), (9, "second", 7, 2)]
        assert msgs[1].info == {"summary": "3 tokens"}
        assert store.get_setting("models") == ["/x.gguf"]
        assert store.path_attachments(1) == []
        att = store.add_attachment(1, Document("n.txt", "text", "migrated fine"), 7)
        assert store.search_passages(1, "migrated")[0].attachment_id == att.id
        assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with ConversationStore(path) as again:  # opened again: nothing to migrate
        assert again.schema_version() == 3 and again.path_attachments(1)[0].name == "n.txt"
        again.delete_conversation(1)
        assert again.db.execute("SELECT COUNT(*) FROM attachment_chunks").fetchone()[0] == 0


def test_a_failed_migration_leaves_version_2(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import app.conversation_store as cs

    path = tmp_path / "v2.sqlite3"
    _version_2_database(path)
    monkeypatch.setattr(cs, "ATTACHMENT_SCHEMA", (*cs.ATTACHMENT_SCHEMA, "NOT SQL"))
    with pytest.raises(sqlite3.OperationalError):
        ConversationStore(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
    assert "attachments" not in tables and "attachment_chunks" not in tables
    db.close()
    monkeypatch.undo()
    with ConversationStore(path) as store:
        assert store.schema_version() == 3 and len(store.messages(1)) == 2


def test_replayed_tool_results_come_only_from_versions_of_this_branch(tmp_path) -> None:  # noqa: ANN001
    """A regenerate replays calls the old versions of *its* answer made, never those of a
    branch that started from another question at the same depth."""
    from app.tools.turns import DONE, new_call, replayable

    def answer(cid: int, city: str, result: str) -> None:
        msg = store.add_message(cid, "assistant", "")
        call = {**new_call(msg.id, 0, "weather", "w", "weather", {"city": city}),
                "state": DONE, "result": result}
        store.update_message(msg.id, "", COMPLETE, {"tool_calls": [call]})

    store = ConversationStore(tmp_path / "chat.sqlite3")
    cid = store.create_conversation().id
    store.add_message(cid, "user", "Weather in Oslo?")
    answer(cid, "Oslo", "from the Oslo question")
    store.branch_at(cid, 0)  # the question edited: another branch at the same depth
    store.add_message(cid, "user", "Weather in Oslo, please, for my trip?")
    answer(cid, "Oslo", "from the other question")
    store.branch_at(cid, 1)  # regenerate the answer on this branch
    records = store.tool_call_records(cid, 1)
    assert [r["result"] for r in records] == ["from the other question"]
    assert [r["result"] for r in replayable(records, 10**9).values()] == \
        ["from the other question"]
    # Back on the first question's branch, its own result only.
    first_question = store.siblings(store.messages(cid)[0].id)[0]
    store.switch_to(first_question.id)
    assert [r["result"] for r in store.tool_call_records(cid, 1)] == ["from the Oslo question"]
    # From the top (no message above), every version is below.
    assert len(store.tool_call_records(cid, 0)) == 2
