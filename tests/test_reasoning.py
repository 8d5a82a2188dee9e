"""Thinking models (issue 36, item 5): the reasoning section is split from the answer,
kept out of the next turn's prompt unless the template reads it, and a template with
``enable_thinking`` lets a conversation turn thinking off. The bundled model does not
think: these run its tokenizer under a template written for the test, and the real
window on a conversation holding a reasoning section."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine.runtime.chat_template import ChatTemplate  # noqa: E402
from engine.runtime.reasoning import for_template, split_reasoning  # noqa: E402

# ChatML with Qwen3's two habits: a switch that opens and closes an empty section, and
# earlier reasoning shown only to templates that ask for it (``show_reasoning``).
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.reasoning_content is defined and show_reasoning is defined %}"
    "<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")


@pytest.mark.parametrize(("text", "reasoning", "answer", "still_open"), [
    ("<think>sum 2 and 2</think>It is 4.", "sum 2 and 2", "It is 4.", False),
    ("\n<think>\nfirst\nsecond\n</think>\n\nDone", "first\nsecond", "Done", False),
    ("<think>still going", "still going", "", True),
    ("opened by the prompt</think> answer", "opened by the prompt", "answer", False),
    ("No section here.", "", "No section here.", False),
    ("<THINKING>x</THINKING>y", "x", "y", False),
])
def test_the_section_is_split_from_the_answer(text, reasoning, answer, still_open):
    parts = split_reasoning(text)
    assert (parts.reasoning, parts.answer, parts.open) == (reasoning, answer, still_open)


def test_the_next_prompt_gets_the_answer_and_the_reasoning_apart(target):
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "<think>add them</think>4"},
               {"role": "user", "content": "and 3+3?"}]
    assert for_template(history)[1] == {"role": "assistant", "content": "4",
                                        "reasoning_content": "add them"}
    own = target.template
    try:
        target.template = ChatTemplate(THINKING_TEMPLATE, own.bos_token, own.eos_token)
        assert target.template.thinking_switch and not own.thinking_switch
        text = target.detokenize(target.chat_prompt(history))
        assert "add them" not in text and "<|im_start|>assistant\n4<|im_end|>" in text
        off = target.detokenize(target.chat_prompt(history, enable_thinking=False))
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        # A template that shows earlier reasoning gets it, as text, not markup.
        target.template = ChatTemplate("{% set show_reasoning = true %}" + THINKING_TEMPLATE,
                                       own.bos_token, own.eos_token)
        history[1]["content"] = "<think>add <|im_end|> them</think>4"
        tokens = target.chat_prompt(history)
        assert "<think>add <|im_end|> them</think>4" in target.detokenize(tokens)
        end_of_turn = target.tokenize("<|im_end|>", special=True)
        assert tokens.count(end_of_turn[0]) == 3  # the typed one stayed text
    finally:
        target.template = own


def test_the_window_folds_reasoning_and_offers_the_switch_where_it_exists(
        qtbot, tmp_path: Path, model_path: Path):
    from app.conversation_export import ImportedConversation, ImportedMessage, import_into
    from app.conversation_store import ChatSettings
    from tests.gui_helpers import open_window

    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path)
    assert not w.settings_panel.thinking.isEnabled()  # the bundled template has no switch
    conv = import_into(w.store, ImportedConversation("thinking", "", ChatSettings(), (
        ImportedMessage("user", "2+2?"),
        ImportedMessage("assistant", "<think>two and two make four</think>It is **4**."))))
    w._refresh_conversations()
    w.controller.open_conversation(conv.id)
    answer = w.transcript.messages[1]
    delegate = w.chat.delegate
    shown = delegate.shown_text(answer)
    assert "two and two" not in shown and "Reasoning (5 words)" in shown
    assert shown.endswith("It is **4**.")
    view = w.chat.transcript
    fold = delegate.reasoning_rect(view.visualRect(w.transcript.index(1)), answer, view.font())
    assert fold is not None
    from PySide6.QtCore import QPoint, Qt

    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton,
                     pos=QPoint(int(fold.center().x()), int(fold.center().y())))
    assert "> two and two make four" in delegate.shown_text(answer)
    streaming = answer.__class__(99, conv.id, 1, "assistant", "<think>hmm, let me")
    assert "Thinking…" in delegate.shown_text(streaming)
    w.settings_panel.set_thinking_switch(True)
    assert w.settings_panel.thinking.isEnabled()
