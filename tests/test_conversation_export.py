"""Conversations out and back in (issue 36, item 4): Markdown and JSON (OpenAI messages
with Tandem's figures), imported whole or refused with the reason; from the real store,
the real window and the real ``tandem chat`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.conversation_export import (
    from_json,
    import_into,
    message_attachments,
    read_import,
    write_export,
)
from app.conversation_store import COMPLETE, STOPPED, ChatSettings, ConversationStore

STATS = {"summary": "42 tokens, 80.0 tok/s, 1.50 tokens/step", "finish_reason": "eos",
         "stats": {"n_new": 42, "tok_per_s": 80.0, "mean_accepted": 1.5}}


@pytest.fixture()
def store(tmp_path: Path):
    with ConversationStore(tmp_path / "chat.sqlite3") as s:
        yield s


def _filled(store: ConversationStore) -> int:
    conv = store.create_conversation("Rivers", "Answer briefly.",
                                     ChatSettings(temperature=0.7, seed=5, max_tokens=64))
    store.add_message(conv.id, "user", "Name three rivers.")
    store.add_message(conv.id, "assistant", "Nile, Amazon, Danube.", COMPLETE, STATS)
    store.add_message(conv.id, "user", "And in Asia? **bold** `code`")
    store.add_message(conv.id, "assistant", "Yangtze, Mek", STOPPED, {"summary": "stopped"})
    return conv.id


def test_json_round_trip_keeps_everything(store: ConversationStore, tmp_path: Path):
    cid = _filled(store)
    path = tmp_path / "rivers.json"
    assert write_export(store.conversation(cid), store.messages(cid), path) == "json"
    data = json.loads(path.read_text())
    # OpenAI's message list, the system prompt first; Tandem's figures beside.
    assert data["messages"][0] == {"role": "system", "content": "Answer briefly."}
    assert data["messages"][2]["tandem"]["stats"]["tok_per_s"] == 80.0
    assert "tandem" not in data["messages"][1]  # a plain user message stays plain
    new = import_into(store, read_import(path))
    assert new.id != cid and new.title == "Rivers" and new.system_prompt == "Answer briefly."
    assert new.settings == store.conversation(cid).settings
    before = [(m.role, m.content, m.status, m.info) for m in store.messages(cid)]
    after = [(m.role, m.content, m.status, m.info) for m in store.messages(new.id)]
    assert after == before


def test_markdown_reads_as_a_chat(store: ConversationStore, tmp_path: Path):
    cid = _filled(store)
    path = tmp_path / "rivers.md"
    assert write_export(store.conversation(cid), store.messages(cid), path) == "markdown"
    text = path.read_text()
    assert text.startswith("# Rivers\n")
    assert "> **System:** Answer briefly." in text
    assert "### You\n\nName three rivers." in text
    assert f"### Assistant *({STATS['summary']})*\n\nNile, Amazon, Danube." in text
    assert "### Assistant *(stopped; stopped)*" in text  # the status is not hidden
    assert "**bold** `code`" in text  # the user's Markdown is kept as written


def test_a_bare_openai_message_list_imports(store: ConversationStore, tmp_path: Path):
    path = tmp_path / "from-elsewhere.json"
    path.write_text(json.dumps([{"role": "system", "content": "Be kind."},
                                {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello!"}]))
    new = import_into(store, read_import(path))
    assert new.title == "from-elsewhere" and new.system_prompt == "Be kind."
    assert [m.content for m in store.messages(new.id)] == ["Hi", "Hello!"]


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "is not JSON"),
    ('{"messages": "no"}', "expected a list of messages"),
    ('[{"role": "tool", "content": "x"}]', "has the role 'tool'"),
    ('[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]',
     "a system prompt only comes first"),
    ('[{"role": "user", "content": 3}]', "message 1 has no text content"),
    ('[{"role": "user", "content": "a", "tandem": {"status": "weird"}}]', "unknown status"),
    ('{"format": "tandem.conversation", "version": 99, "messages": []}', "newer"),
    ('[{"role": "user", "content": "a", "tandem": {"attachments": "x"}}]',
     "message 1: its attachments are not a list"),
    ('[{"role": "user", "content": "a", "tandem": {"attachments": [3]}}]',
     "attachment 1 is not an object"),
    ('[{"role": "user", "content": "a", "tandem": {"attachments": [{"kind": "text",'
     ' "text": "t"}]}}]', "attachment 1 has no name"),
    ('[{"role": "user", "content": "a", "tandem": {"attachments": [{"name": "n",'
     ' "kind": "exe", "text": "t"}]}}]', "has the kind 'exe'"),
    ('[{"role": "user", "content": "a", "tandem": {"attachments": [{"name": "n",'
     ' "kind": "text", "text": 5}]}}]', "'n' has no text"),
    ('[{"role": "user", "content": "a", "tandem": {"attachments": [{"name": "n",'
     ' "kind": "pdf", "text": "t", "pages": [0, 9]}]}}]', "pages that are not"),
])
def test_a_bad_file_is_refused_with_the_reason_and_nothing_is_written(
        store: ConversationStore, tmp_path: Path, content: str, message: str):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        import_into(store, read_import(path))
    assert str(info.value).startswith("bad.json")
    assert store.conversations() == []


def test_an_answer_exported_mid_stream_comes_back_interrupted():
    imported = from_json([{"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b",
                           "tandem": {"status": "streaming"}}])
    assert imported.messages[1].status == "interrupted"


def _with_attachments(store: ConversationStore) -> int:
    from app.documents.reading import Document

    cid = _filled(store)
    first, _, third, _ = store.messages(cid)
    store.add_attachment(cid, Document("notes.md", "markdown", "# Rivers\nlong ones"), first.id)
    store.add_attachment(cid, Document("atlas.pdf", "pdf", "Nile\n\nAmazon basin", (0, 6)),
                         first.id)
    store.add_attachment(cid, Document("asia.txt", "text", "Yangtze and Mekong"), third.id)
    return cid


def test_attachments_export_and_import_with_their_message(store: ConversationStore,
                                                          tmp_path: Path):
    cid = _with_attachments(store)
    msgs = store.messages(cid)
    attached = message_attachments(store, msgs)
    path = tmp_path / "rivers.json"
    write_export(store.conversation(cid), msgs, path, attached)
    data = json.loads(path.read_text())
    assert data["version"] == 2
    assert data["messages"][1]["tandem"]["attachments"] == [
        {"name": "notes.md", "kind": "markdown", "text": "# Rivers\nlong ones", "pages": []},
        {"name": "atlas.pdf", "kind": "pdf", "text": "Nile\n\nAmazon basin", "pages": [0, 6]}]
    new = import_into(store, read_import(path))
    new_msgs = store.messages(new.id)
    assert [m.info for m in new_msgs] == [m.info for m in msgs]  # no "attachments" in info
    got = [[(a.name, a.kind, a.text, a.pages) for a in store.message_attachments(m.id)]
           for m in new_msgs]
    want = [[(a.name, a.kind, a.text, a.pages) for a in store.message_attachments(m.id)]
            for m in msgs]
    assert got == want and got[0] and got[2]
    found = store.search_passages(new.id, "Amazon")  # indexed too
    assert [(p.name, p.page, p.text) for p in found] == [("atlas.pdf", 2, "Amazon basin")]
    md = tmp_path / "rivers.md"
    write_export(store.conversation(cid), msgs, md, attached)
    assert "Name three rivers.\n\n*Attached: notes.md, atlas.pdf*\n" in md.read_text()


def test_a_version_1_export_still_imports(store: ConversationStore):
    data = {"format": "tandem.conversation", "version": 1, "title": "Old",
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "yo",
                          "tandem": {"status": "complete", "summary": "1 token"}}]}
    new = import_into(store, from_json(data))
    assert [(m.content, m.info) for m in store.messages(new.id)] == [
        ("hi", {}), ("yo", {"summary": "1 token"})]
    assert store.path_attachments(new.id) == []


def test_the_window_exports_and_imports(qtbot, tmp_path: Path, model_path: Path):
    from tests.gui_helpers import open_window, send_and_wait

    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path, max_tokens=12)
    send_and_wait(qtbot, w, "Name a colour.")
    out = tmp_path / "chat.json"
    assert w.export_conversation(out) and "exported" in w.statusBar().currentMessage()
    assert w.export_conversation(tmp_path / "chat.md")
    assert (tmp_path / "chat.md").read_text().count("### ") == 2
    n_before = len(w.store.conversations())
    new_id = w.import_conversation(out)
    assert new_id is not None and w.controller.current_id == new_id
    assert len(w.store.conversations()) == n_before + 1
    assert w.transcript.rowCount() == 2  # the imported chat is open
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert w.import_conversation(bad) is None
    assert "not JSON" in w.statusBar().currentMessage()
    assert len(w.store.conversations()) == n_before + 1


def test_tandem_chat_exports_and_continues_an_export(tandem_home, model_path, tmp_path):
    env = dict(os.environ, TANDEM_HOME=str(tandem_home))
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "chat", "--threads", "2", "--max-tokens", "8",
         "--drafter", "none", "--system", "Be brief."],
        input=f"Name a fruit.\n/export {md}\n/export {js}\n/quit\n", capture_output=True,
        text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "### You\n\nName a fruit." in md.read_text()
    data = json.loads(js.read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    assert data["messages"][2]["tandem"]["stats"]["n_new"] >= 1
    again = subprocess.run(
        [sys.executable, "-m", "app.cli", "chat", "--threads", "2", "--max-tokens", "8",
         "--drafter", "none", "--load", str(js)],
        input=f"And another?\n/export {js}\n/quit\n", capture_output=True, text=True,
        env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "continuing" in again.stdout
    roles = [m["role"] for m in json.loads(js.read_text())["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    bad = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--load",
                          str(tmp_path / "missing.json")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert bad.returncode == 2 and "cannot read missing.json" in bad.stderr
