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


def test_truncate_update_and_delete(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "c.db") as store:
        conv = store.create_conversation()
        for i in range(4):
            store.add_message(conv.id, "user" if i % 2 == 0 else "assistant", f"m{i}")
        store.truncate(conv.id, 2)
        assert [m.content for m in store.messages(conv.id)] == ["m0", "m1"]
        new = store.add_message(conv.id, "user", "m2b")
        assert new.position == 2
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
