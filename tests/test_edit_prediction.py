"""The window's prediction for a question: the file the answer will likely repeat."""

from __future__ import annotations

from app.documents.edit_prediction import edit_prediction
from app.documents.records import Attachment

CODE = "def area(width, height):\n    return width * height\n" * 3


def _attached(kind: str, text: str, id_: int = 1) -> Attachment:
    return Attachment(id_, 1, 1, f"file{id_}", kind, text)


def test_the_newest_code_attachment_is_the_prediction():
    older, newer = _attached("code", CODE, 1), _attached("code", CODE.upper(), 2)
    notes = _attached("markdown", "# Notes\n" * 40, 3)
    assert edit_prediction([older, newer, notes], []) == CODE.upper()


def test_else_the_last_code_block_of_the_newest_answer():
    answers = ["```python\nold = 1\n```", f"Here it is:\n\n```python\n{CODE}```\nDone."]
    assert edit_prediction([], answers) == CODE
    assert edit_prediction([_attached("pdf", CODE)], answers) == CODE  # a PDF is no file
    assert edit_prediction([], ["no code here"]) == ""
    assert edit_prediction([], ["```\nx = 1\n```"]) == ""  # too short to draft from
