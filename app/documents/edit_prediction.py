"""What the window sends as a prediction (OpenAI's Predicted Outputs) with a question:
the text the answer will most likely repeat.

A request to change a source file is answered with the file again, a few lines changed;
drafting from the file makes the unchanged lines nearly free. So the prediction is the
newest source file attached on the conversation's path, else the last code block of the
newest answer (a follow-up that edits code the model wrote). Drafting from it never
changes the answer; where the answer does not repeat it, its drafts stop being proposed
after a few misses (engine.drafters.prediction learns their acceptance).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from app.documents.records import Attachment

# The longest fenced block ends the answer's code: ``` or ~~~, with a language or not.
_FENCED = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
MIN_PREDICTION_CHARS = 80  # a shorter text is no file: nothing worth drafting from


def edit_prediction(attachments: Sequence[Attachment], answers: Sequence[str]) -> str:
    """The prediction for the next answer: the newest code attachment (``attachments`` in
    path order), else the last fenced code block of the newest of ``answers``; "" when
    there is neither."""
    for attachment in reversed(attachments):
        if attachment.kind == "code" and len(attachment.text) >= MIN_PREDICTION_CHARS:
            return attachment.text
    for answer in reversed(answers):
        blocks = [m.group(2) for m in _FENCED.finditer(answer)]
        if blocks:
            block = blocks[-1]
            return block if len(block) >= MIN_PREDICTION_CHARS else ""
    return ""
