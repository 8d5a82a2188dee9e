"""What an answer was given from its user message's documents: the "Sources" line under
the answer and the dialog that lists the passages.

A user message that brought documents keeps in its info what the model read with it
(``app.gui.document_turn``): ``passages`` (dicts of ``Passage.to_dict``) and ``whole``:
the documents given entire (a passage each then holds the start of one, to show) or only
the passages that best matched the question.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html import escape

from PySide6.QtWidgets import QDialog, QDialogButtonBox, QTextBrowser, QVBoxLayout, QWidget

from app.conversation_store import Message
from app.documents.records import Passage


@dataclass(frozen=True)
class Sources:
    passages: tuple[Passage, ...]
    whole: bool  # each passage is the start of a document given whole

    def line(self) -> str:
        """ "Sources: report.pdf p.3, p.7 · notes.md" for passages, in the order of the
        documents, or "Sources: report.pdf (whole)"."""
        if self.whole:
            return "Sources: " + ", ".join(f"{p.name} (whole)" for p in self.passages)
        by_name: dict[str, list[int]] = {}
        for p in self.passages:
            pages = by_name.setdefault(p.name, [])
            if p.page is not None and p.page not in pages:
                pages.append(p.page)
        parts = [f"{name} {', '.join(f'p.{n}' for n in sorted(pages))}" if pages else name
                 for name, pages in by_name.items()]
        return "Sources: " + " · ".join(parts)


def sources_of(user: Message | None) -> Sources | None:
    """What a user message's documents gave its answer; None when it brought none."""
    if user is None or user.role != "user" or not user.info.get("passages"):
        return None
    try:
        passages = tuple(Passage.from_dict(d) for d in user.info["passages"])
    except (ValueError, TypeError):  # a hand-edited database: no line rather than a crash
        return None
    return Sources(passages, bool(user.info.get("whole")))


class SourcesDialog(QDialog):
    """The passages an answer was given, each under its document's name and page."""

    def __init__(self, sources: Sources, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Sources")
        self.resize(640, 480)
        self.browser = QTextBrowser()
        self.browser.setOpenLinks(False)
        self.browser.setHtml(sources_html(sources))
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.browser, 1)
        layout.addWidget(buttons)


_PDF_LINE_BREAK = re.compile(r"(?<!\n)\n(?!\n)")  # one line break: not a paragraph's


def sources_html(sources: Sources) -> str:
    """The dialog's text: a heading per passage (name, page) and the passage as it was
    given (escaped: a document's text is not markup)."""
    n = len(sources.passages)
    if sources.whole:
        intro = ("The model was given these documents whole with the question; here is how "
                 "each begins." if n != 1 else "The model was given this document whole "
                 "with the question; here is how it begins.")
    elif n == 1:
        intro = ("The documents were too long to give whole: the model was given this "
                 "passage, the one that best matched the question.")
    else:
        intro = (f"The documents were too long to give whole: the model was given these {n} "
                 "passages, those that best matched the question.")
    blocks = [f"<p>{escape(intro)}</p>"]
    for p in sources.passages:
        where = "" if sources.whole or p.page is None else f", page {p.page}"
        text = p.text.strip() + (" …" if sources.whole else "")
        if p.page is not None:  # a PDF's text layer breaks lines where the page did
            text = _PDF_LINE_BREAK.sub(" ", text)
        blocks.append(f"<h4>{escape(p.name)}{where}</h4>"
                      f"<blockquote style='white-space: pre-wrap'>{escape(text)}</blockquote>")
    return "\n".join(blocks)
