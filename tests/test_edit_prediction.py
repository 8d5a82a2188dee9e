"""The window's prediction for a question: the file the answer will likely repeat, sent
only when the question asks for an edit, and cut to a multiple of the context."""

from __future__ import annotations

import pytest

from app.documents.edit_prediction import (
    CHARS_PER_TOKEN,
    CONTEXT_MULTIPLE,
    asks_for_edit,
    edit_prediction,
)
from app.documents.records import Attachment

CODE = "def area(width, height):\n    return width * height\n" * 3
EDIT = "Fix the bug in this file."
N_CTX = 4096


def _attached(kind: str, text: str, id_: int = 1) -> Attachment:
    return Attachment(id_, 1, 1, f"file{id_}", kind, text)


def test_the_newest_code_attachment_is_the_prediction():
    older, newer = _attached("code", CODE, 1), _attached("code", CODE.upper(), 2)
    notes = _attached("markdown", "# Notes\n" * 40, 3)
    assert edit_prediction([older, newer, notes], [], EDIT, N_CTX) == CODE.upper()


def test_else_the_last_code_block_of_the_newest_answer():
    answers = ["```python\nold = 1\n```", f"Here it is:\n\n```python\n{CODE}```\nDone."]
    assert edit_prediction([], answers, EDIT, N_CTX) == CODE
    assert edit_prediction([_attached("pdf", CODE)], answers, EDIT, N_CTX) == CODE  # no file
    assert edit_prediction([], ["no code here"], EDIT, N_CTX) == ""
    assert edit_prediction([], ["```\nx = 1\n```"], EDIT, N_CTX) == ""  # too short


@pytest.mark.parametrize("message", [
    "Rename area to surface.", "Please add a docstring", "can you REFACTOR this?",
    "Change the return type", "fixing the loop would help", "Rewrite it in one line",
    "remove the unused import", "Update the comments.", "modify the signature",
    "Replace width with w", "the tests need editing", "I'd like it rewritten"])
def test_a_message_that_asks_for_an_edit_sends_the_file(message: str):
    assert asks_for_edit(message)
    assert edit_prediction([_attached("code", CODE)], [], message, N_CTX) == CODE


@pytest.mark.parametrize("message", [
    "What does this file do?", "Explain the area function.", "Is there a bug here?",
    "Summarize it", "address this question: who wrote it?", "Which edition is this?", ""])
def test_a_question_about_the_file_sends_none(message: str):
    assert not asks_for_edit(message)
    assert edit_prediction([_attached("code", CODE)], [f"```\n{CODE}```"], message,
                           N_CTX) == ""


def test_a_file_longer_than_two_contexts_is_cut_at_a_line_end():
    n_ctx = 512
    line = "x = compute(width, height)  # one line of a long file\n"
    long_file = line * (CONTEXT_MULTIPLE * n_ctx * CHARS_PER_TOKEN // len(line) + 50)
    sent = edit_prediction([_attached("code", long_file)], [], EDIT, n_ctx)
    assert len(sent) <= CONTEXT_MULTIPLE * n_ctx * CHARS_PER_TOKEN < len(long_file)
    assert long_file.startswith(sent) and sent.endswith("\n")
    assert len(sent) > CONTEXT_MULTIPLE * n_ctx * CHARS_PER_TOKEN - len(line)
    # A file within the cap goes whole.
    assert edit_prediction([_attached("code", CODE)], [], EDIT, n_ctx) == CODE
