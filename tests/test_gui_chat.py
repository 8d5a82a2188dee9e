"""The chat window driven offscreen against the real engine and the bundled model."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from app.conversation_store import COMPLETE, STOPPED, ConversationStore  # noqa: E402
from tests.gui_helpers import (  # noqa: E402
    ANSWER_TIMEOUT_MS,
    open_window,
    select_row,
    send_and_wait,
    type_and_send,
)


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    return tmp_path / "chat.sqlite3"


def test_send_streams_the_answer_and_saves_it(qtbot, db: Path, model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=32)
    deltas: list[str] = []
    w.worker.text.connect(lambda _rid, s: deltas.append(s))
    outcome = send_and_wait(qtbot, w, "Write a Python function that adds two numbers.")
    lag = w.controller.loop_monitor.last
    print(f"\nevent-loop delay while generating {outcome.stats.n_new} tokens "
          f"({outcome.stats.tok_per_s:.1f} tok/s): {lag.describe()}, mean {lag.mean_ms:.1f} ms")
    assert lag.n_ticks > 0
    assert len(deltas) > 1, "the answer should arrive in pieces"
    assert "".join(deltas) == outcome.text
    msgs = w.store.messages(w.controller.current_id)
    assert [(m.role, m.status) for m in msgs] == [("user", COMPLETE), ("assistant", COMPLETE)]
    assert msgs[1].content == outcome.text and outcome.text
    assert "tok/s" in msgs[1].info["summary"]
    assert w.transcript.messages[-1].content == outcome.text
    conv = w.store.conversation(w.controller.current_id)
    assert conv.title.startswith("Write a Python function")
    # The dashboard shows the answer's numbers and its tokens by origin.
    assert w.dashboard.tok_s.value.text() not in ("–", "…")
    assert w.dashboard.tokens.text.toPlainText() == outcome.text
    assert len(outcome.token_kinds) == outcome.stats.n_new


def test_stop_mid_answer_keeps_the_partial_answer(qtbot, db: Path, model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=1500)
    type_and_send(qtbot, w, "Tell me a long story about a dragon and a village.")
    qtbot.waitUntil(lambda: len(w.transcript.messages) == 2
                    and len(w.transcript.messages[-1].content) > 80, timeout=ANSWER_TIMEOUT_MS)
    assert w.chat.stop_button.isEnabled() and not w.chat.send_button.isEnabled()
    with qtbot.waitSignal(w.controller.answer_finished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        w.chat.stop_button.click()
    outcome = blocker.args[0]
    print(f"\nstopped after {outcome.stats.n_new} tokens; event-loop delay: "
          f"{w.controller.loop_monitor.last.describe()}")
    assert outcome.finish_reason == "cancelled"
    assert 0 < outcome.stats.n_new < 1500
    saved = w.store.messages(w.controller.current_id)[-1]
    assert (saved.status, saved.content) == (STOPPED, outcome.text)
    assert w.chat.send_button.isEnabled() and not w.chat.stop_button.isEnabled()


def test_regenerate_makes_a_new_version_of_the_last_answer(qtbot, db: Path,
                                                           model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=16)
    first = send_and_wait(qtbot, w, "Name three colours.")
    old_id = w.store.messages(w.controller.current_id)[-1].id
    assert w.chat.regenerate_button.isEnabled()
    with qtbot.waitSignal(w.controller.answer_finished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        w.chat.regenerate_button.click()
    again = blocker.args[0]
    assert again.text == first.text  # greedy: the same answer
    msgs = w.store.messages(w.controller.current_id)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].id != old_id and (msgs[1].sibling_index, msgs[1].n_siblings) == (1, 2)
    assert len(w.transcript.messages) == 2
    assert [m.id for m in w.store.siblings(old_id)] == [old_id, msgs[1].id]  # both kept


def test_edit_and_resend_starts_a_new_version_of_the_message(qtbot, db: Path,
                                                             model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=16)
    send_and_wait(qtbot, w, "What is the capital of France?")
    send_and_wait(qtbot, w, "And of Italy?")
    assert len(w.transcript.messages) == 4
    select_row(w, 0)
    assert w.chat.edit_button.isEnabled()
    w.chat.edit_button.click()
    assert w.chat.composer.toPlainText() == "What is the capital of France?"
    assert w.chat.edit_banner.isVisibleTo(w)
    w.chat.composer.clear()
    outcome = send_and_wait(qtbot, w, "What is the capital of Spain?")
    msgs = w.store.messages(w.controller.current_id)
    assert [(m.role, m.content) for m in msgs] == [
        ("user", "What is the capital of Spain?"), ("assistant", outcome.text)]
    assert [m.content for m in w.transcript.messages] == [m.content for m in msgs]
    assert msgs[0].n_siblings == 2  # the first question and its 3 followers stay a version


def test_restart_finds_the_conversation(qtbot, db: Path, model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=16)
    outcome = send_and_wait(qtbot, w, "Say hello.")
    conv_id = w.controller.current_id
    w.close()
    w2 = open_window(qtbot, db, model_path)
    titles = [c.title for c in w2.conversations.model.conversations]
    assert titles == ["Say hello."]
    assert w2.controller.current_id == conv_id
    assert [m.content for m in w2.transcript.messages] == ["Say hello.", outcome.text]
    # The conversation goes on with the same history after the restart.
    send_and_wait(qtbot, w2, "Again, please.")
    assert len(ConversationStore(db).messages(conv_id)) == 4


def test_conversations_keep_their_own_settings(qtbot, db: Path, model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=20)
    first = w.controller.current_id
    w.settings_panel.system_prompt.setPlainText("You are terse.")
    w.settings_panel.temperature.setValue(0.8)
    w.settings_panel.seed.setValue(7)
    second = w.controller.new_conversation()
    w.settings_panel.temperature.setValue(0.0)
    assert w.store.conversation(first).settings.temperature == pytest.approx(0.8)
    assert w.store.conversation(first).settings.seed == 7
    assert w.store.conversation(first).system_prompt == "You are terse."
    assert w.store.conversation(second).settings.temperature == 0.0
    w.controller.open_conversation(first)
    assert w.settings_panel.temperature.value() == pytest.approx(0.8)
    assert w.settings_panel.system_prompt.toPlainText() == "You are terse."
    # Seeded sampling is reproducible through the app too.
    a = send_and_wait(qtbot, w, "Pick a random animal.")
    with qtbot.waitSignal(w.controller.answer_finished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        w.chat.regenerate_button.click()
    assert blocker.args[0].text == a.text


def test_closing_mid_answer_saves_it_as_stopped(qtbot, db: Path, model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=1500)
    type_and_send(qtbot, w, "Tell me a long story about a dragon and a village.")
    qtbot.waitUntil(lambda: len(w.transcript.messages) == 2
                    and len(w.transcript.messages[-1].content) > 40, timeout=ANSWER_TIMEOUT_MS)
    shown = w.transcript.messages[-1].content
    conv_id = w.controller.current_id
    w.close()
    assert not w.thread_.isRunning()
    with ConversationStore(db) as store:
        answer = store.messages(conv_id)[-1]
        assert answer.status == STOPPED and store.n_recovered == 0
        assert answer.content.startswith(shown)


def test_a_base_model_is_shown_continuing_the_text(qtbot, db: Path, model_path: Path,
                                                   tmp_path: Path) -> None:
    """A GGUF without a chat template whose name says base: the window says so, asks for
    text to continue, and labels the model's reply as a continuation of it."""
    from engine.gguf.architectures import write_architecture_gguf

    base = write_architecture_gguf("llama", tmp_path / "Tiny-1B-Base.gguf", model_path,
                                   chat_template=False, name="Tiny-1B-Base")
    w = open_window(qtbot, db, base, max_tokens=8)
    assert w.engine_info.completion and "is a base model" in w.engine_info.note
    assert w.engine_panel.note.isVisible() or w.engine_panel.note.text()
    assert "continue" in w.chat.composer.placeholderText()
    assert w.chat.delegate.model_author == "Continuation"
    outcome = send_and_wait(qtbot, w, "Once upon a time")
    assert outcome.stats.n_new == 8


def test_a_chat_set_to_answer_as_json_gets_json(qtbot, db: Path, model_path: Path) -> None:
    """The settings' "Answer as JSON" with a schema: the answer parses and matches it; a
    schema that is not JSON is refused with a message, and nothing is sent."""
    import json

    w = open_window(qtbot, db, model_path, max_tokens=80)
    problems: list[str] = []
    w.controller.problem.connect(problems.append)
    w.settings_panel.answer_json.setChecked(True)
    assert w.settings_panel.json_schema.isEnabled()
    w.settings_panel.json_schema.setPlainText(json.dumps({
        "type": "object", "required": ["city", "country"],
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}))
    outcome = send_and_wait(qtbot, w, "Paris is the capital of France. Give the city and "
                                      "its country.")
    place = json.loads(outcome.text)
    assert set(place) == {"city", "country"}
    settings = w.store.conversation(w.controller.current_id).settings
    assert settings.answer_json and '"country"' in settings.json_schema
    w.settings_panel.json_schema.setPlainText("{not json")
    n = len(w.store.messages(w.controller.current_id))
    type_and_send(qtbot, w, "And Rome?")
    qtbot.waitUntil(lambda: bool(problems), timeout=10_000)
    assert "JSON schema" in problems[-1]
    assert len(w.store.messages(w.controller.current_id)) <= n + 1  # no answer started
