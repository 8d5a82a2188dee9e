"""What the window sends as a prediction (OpenAI's Predicted Outputs) with a question:
the text the answer will most likely repeat.

A request to change a source file is answered with the file again, a few lines changed;
drafting from the file makes the unchanged lines nearly free. So the prediction is the
newest source file attached on the conversation's path, else the last code block of the
newest answer (a follow-up that edits code the model wrote). Drafting from it never
changes the answer; where the answer does not repeat it, its drafts stop being proposed
after a few misses (engine.drafters.prediction learns their acceptance).

It is sent only with a message that asks for an edit (``asks_for_edit``: one of a few
verbs such as fix, change, rename, add, remove), since every prediction sent is tokenized
and indexed again; a question about the file gets none. And it is cut to about
``CONTEXT_MULTIPLE`` contexts of tokens (estimated at ``CHARS_PER_TOKEN``): an answer is
at most one context long, so more of the file is never drafted from.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from app.documents.records import Attachment

# The longest fenced block ends the answer's code: ``` or ~~~, with a language or not.
_FENCED = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
MIN_PREDICTION_CHARS = 80  # a shorter text is no file: nothing worth drafting from


# Verbs of an edit, as a request for one says them (their -s, -ed and -ing forms too).
EDIT_VERBS = ("edit", "change", "fix", "rewrite", "refactor", "rename", "update", "modify",
              "add", "remove", "delete", "replace", "insert", "correct", "convert", "patch")
_IRREGULAR = ("rewrote", "rewritten")
# A prediction is cut to this many contexts of tokens: an answer is at most one context
# long, and the drafter finds its place anywhere in the prediction, so a second one is
# slack for an answer that starts further in.
CONTEXT_MULTIPLE = 2
# Characters a token, estimated low so the cut errs long (as the window's estimate of a
# document's tokens does: BPE vocabularies average 3-4 on English and source code).
CHARS_PER_TOKEN = 3
_WORD = re.compile(r"[a-z]+")


def _forms(verb: str) -> set[str]:
    """``verb`` with its -s, -ed and -ing forms (change: changes, changed, changing;
    modify: modifies, modified, modifying)."""
    if verb.endswith("e"):
        return {verb, verb + "s", verb + "d", verb[:-1] + "ing"}
    if verb.endswith("y"):
        return {verb, verb[:-1] + "ies", verb[:-1] + "ied", verb + "ing"}
    return {verb, verb + "s", verb + "es", verb + "ed", verb + "ing"}


_EDIT_WORDS = frozenset(w for v in EDIT_VERBS for w in _forms(v)) | set(_IRREGULAR)


def asks_for_edit(message: str) -> bool:
    """Whether ``message`` (what the user typed, not the documents with it) asks for an
    edit: one of its words is a form of one of ``EDIT_VERBS``."""
    return any(w in _EDIT_WORDS for w in _WORD.findall(message.lower()))


def capped(text: str, n_ctx: int) -> str:
    """``text`` cut to about ``CONTEXT_MULTIPLE`` * ``n_ctx`` tokens, at a line end where
    one is in the last half of what is kept."""
    limit = CONTEXT_MULTIPLE * n_ctx * CHARS_PER_TOKEN
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", limit // 2, limit)
    return text[:cut + 1] if cut >= 0 else text[:limit]


def edit_prediction(attachments: Sequence[Attachment], answers: Sequence[str],
                    message: str, n_ctx: int) -> str:
    """The prediction for the answer to ``message`` (what the user typed): "" unless it
    asks for an edit; else the newest code attachment (``attachments`` in path order),
    else the last fenced code block of the newest of ``answers``, "" when there is
    neither; cut to ``CONTEXT_MULTIPLE`` contexts of ``n_ctx`` tokens."""
    if not asks_for_edit(message):
        return ""
    return capped(_file_to_edit(attachments, answers), n_ctx)


def _file_to_edit(attachments: Sequence[Attachment], answers: Sequence[str]) -> str:
    for attachment in reversed(attachments):
        if attachment.kind == "code" and len(attachment.text) >= MIN_PREDICTION_CHARS:
            return attachment.text
    for answer in reversed(answers):
        blocks = [m.group(2) for m in _FENCED.finditer(answer)]
        if blocks:
            block = blocks[-1]
            return block if len(block) >= MIN_PREDICTION_CHARS else ""
    return ""
