"""Cut a document into passages of about ``target_chars`` for search.

A chunk is an exact slice of the document's text (``text[start:start + len(chunk.text)]``)
with no whitespace at either end; chunks come in order, do not overlap, and together hold
every non-blank character. Cuts fall at page starts (a chunk is on one page, so a passage
cites the right one), then at blank lines, else line ends, else sentence ends, else
anywhere (a space near the limit when there is one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise

from app.documents.reading import Document

# Coarse to fine; each match's end is a place to cut.
_SEPARATORS = (
    re.compile(r"\n[ \t]*\n\s*"),  # paragraphs
    re.compile(r"\n"),  # lines
    re.compile(r"(?<=[.!?;:。！？])\s+"),  # sentences
)


@dataclass(frozen=True)
class Chunk:
    index: int  # 0-based, in document order
    start: int  # offset of ``text`` in the document's text
    page: int | None  # the page ``start`` is on (PDF), else None
    text: str


def split_into_chunks(document: Document, target_chars: int = 1200) -> list[Chunk]:
    """The document's chunks, none empty, each at most ``target_chars`` long."""
    target = max(1, target_chars)
    text = document.text
    bounds = [0, *[p for p in document.pages if 0 < p < len(text)], len(text)]
    chunks: list[Chunk] = []
    for page_start, page_end in pairwise(bounds):
        for a, b in _split(text, page_start, page_end, 0, target):
            s, e = _trim(text, a, b)
            if s < e:
                chunks.append(Chunk(len(chunks), s, document.page_at(s), text[s:e]))
    return chunks


def _trim(text: str, a: int, b: int) -> tuple[int, int]:
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return a, b


def _split(text: str, a: int, b: int, level: int, target: int) -> list[tuple[int, int]]:
    """Spans covering [a, b): pieces at this level packed up to ``target``, a piece too
    long split at the next level."""
    s, e = _trim(text, a, b)
    if e - s <= target:
        return [(a, b)]
    if level == len(_SEPARATORS):
        return _hard_cut(text, a, b, target)
    out: list[tuple[int, int]] = []
    start = end = a
    for piece_start, piece_end in _pieces(text, a, b, _SEPARATORS[level]):
        ps, pe = _trim(text, piece_start, piece_end)
        if pe - ps > target:
            if end > start:
                out.append((start, end))
            out.extend(_split(text, piece_start, piece_end, level + 1, target))
            start = end = piece_end
            continue
        # Packed length: from the first non-blank of the chunk to this piece's last one.
        if end > start and pe - _trim(text, start, end)[0] > target:
            out.append((start, end))
            start = piece_start
        end = piece_end
    if end > start:
        out.append((start, end))
    return out


def _pieces(text: str, a: int, b: int, separator: re.Pattern[str]) -> list[tuple[int, int]]:
    cuts = [m.end() for m in separator.finditer(text, a, b) if a < m.end() < b]
    bounds = [a, *cuts, b]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _hard_cut(text: str, a: int, b: int, target: int) -> list[tuple[int, int]]:
    """Slices of at most ``target`` non-blank-trimmed characters, at a space in the last
    half of the window where there is one."""
    out = []
    while a < b:
        a = _trim(text, a, b)[0]
        if a >= b:
            break
        end = min(a + target, b)
        if end < b:
            space = text.rfind(" ", a + target // 2, end + 1)
            if space > a:
                end = space
        out.append((a, end))
        a = end
    return out
