"""How a user turn with attached documents is told to the model.

The documents go whole when they fit the token budget, each in a ``<document>`` block
(PDF pages marked ``[page N]``); otherwise the passages that best match the question go,
each in a ``<passage>`` block, in document order. The question comes last. The text is a
pure function of its inputs: a turn's prompt is stored and replayed, so drafting and
plain decoding must see the same one.

A document's text cannot end its block: a ``<document`` or ``<passage`` tag, opening or
closing, in the text or a name gets a backslash after its ``<`` (``</document>`` reads
``<\\/document>``), as ``</script>`` is written ``<\\/script>`` inside a script. No tag
starts with ``<\\``, so no document can close its block and open one of its own, and the
text stays readable, changed by one visible character.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from app.documents.records import Attachment, Passage

SEARCH_LIMIT = 32  # passages asked of search; those that fit the budget are kept
PREVIEW_CHARS = 300  # of a whole document, for the window to show what was given

PARTIAL_NOTE = ("The attached documents are too long to give whole; these are the passages"
                " that best match the question.")


@dataclass(frozen=True)
class ComposedTurn:
    text: str  # what the model reads for this user message
    passages: tuple[Passage, ...]  # what was given: passages, or one per whole document
    whole: bool  # documents given whole (True), or passages of them (False)


def compose_turn(question: str, attachments: list[Attachment], token_budget: int,
                 count_tokens: Callable[[str], int],
                 search: Callable[[str, int], list[Passage]]) -> ComposedTurn:
    """The documents whole when they fit ``token_budget`` with the question, else the best
    passages from ``search(question, limit)`` that fit, shown in document order."""
    if not attachments:
        return ComposedTurn(question, (), True)
    text = _join(whole_documents(attachments), question)
    if count_tokens(text) <= token_budget:
        previews = tuple(Passage(a.id, a.name, 1 if a.pages else None, 0,
                                 a.text[:PREVIEW_CHARS]) for a in attachments)
        return ComposedTurn(text, previews, True)
    found = search(question, SEARCH_LIMIT) or search("", SEARCH_LIMIT)  # no match: the start
    order = {a.id: i for i, a in enumerate(attachments)}

    def in_document_order(ps: list[Passage]) -> list[Passage]:
        return sorted(ps, key=lambda p: (order.get(p.attachment_id, len(order)),
                                         p.attachment_id, p.start))

    chosen: list[Passage] = []
    seen: set[tuple[int, int]] = set()
    for passage in found:  # best first
        key = (passage.attachment_id, passage.start)
        if key in seen:
            continue
        trial = in_document_order([*chosen, passage])
        if count_tokens(_join(passages_text(trial), question)) <= token_budget:
            chosen = trial
            seen.add(key)
    return ComposedTurn(_join(passages_text(chosen), question), tuple(chosen), False)


def tokens_wanted(attachments: list[Attachment], count_tokens: Callable[[str], int]) -> int:
    """Tokens the documents take given whole (the question not counted)."""
    return count_tokens(whole_documents(attachments)) if attachments else 0


def whole_documents(attachments: list[Attachment]) -> str:
    return "\n\n".join(_document_block(a) for a in attachments)


def passages_text(passages: list[Passage]) -> str:
    """The passages' blocks after a note that they are a part; "" for none."""
    if not passages:
        return ""
    blocks = [_passage_block(p) for p in passages]
    return "\n\n".join([PARTIAL_NOTE, *blocks])


def _join(context: str, question: str) -> str:
    return f"{context}\n\n{question}" if context else question


def _document_block(attachment: Attachment) -> str:
    return (f'<document name="{_attr(attachment.name)}">\n{escape_tags(_paged(attachment))}'
            "\n</document>")


def _passage_block(passage: Passage) -> str:
    page = "" if passage.page is None else f' page="{passage.page}"'
    return (f'<passage document="{_attr(passage.name)}"{page}>\n'
            f"{escape_tags(passage.text.strip())}\n</passage>")


_BLOCK_TAG = re.compile(r"<(?=\s*/?\s*(?:document|passage)\b)", re.IGNORECASE)


def escape_tags(text: str) -> str:
    """``text`` with a backslash after the ``<`` of each block tag, opening or closing."""
    return _BLOCK_TAG.sub(r"<\\", text)


def _paged(attachment: Attachment) -> str:
    """The text, with ``[page N]`` at each page's start when it has pages."""
    text, pages = attachment.text, attachment.pages
    if not pages:
        return text.strip()
    bounds = [*pages, len(text)]
    return "\n\n".join(f"[page {i + 1}]\n{text[bounds[i]:bounds[i + 1]].strip()}".rstrip()
                       for i in range(len(pages)))


def _attr(name: str) -> str:
    # A file name inside a quoted attribute: no quote or newline ends it early.
    return escape_tags(" ".join(name.replace('"', "'").split()))
