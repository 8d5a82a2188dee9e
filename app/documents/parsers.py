"""The parsers for PDF, DOCX and HTML. They run in the reader's child process alone
(``reader_child``), under its memory and time limits: a hostile file can make any of
them take gigabytes or loop, and the app must not be the process that does.

Each returns the text (and a PDF's page starts) or raises DocumentError with a sentence
for the user.
"""

from __future__ import annotations

import io
import re
import zipfile

from app.documents.docx_zip import text_parts_copy
from app.documents.errors import DocumentError, clean_text, too_long

PDF, DOCX, HTML = "pdf", "docx", "html"

# pypdf's own bounds on what one stream may decode to (its defaults are 75 MB): a page's
# text never needs this much, and the child's address-space limit is the backstop.
PYPDF_STREAM_LIMIT = 32 * 1024 * 1024
_PYPDF_LIMITS = ("maximum_declared_stream_length", "array_based_stream_maximum_output_length",
                 "jbig2_maximum_output_length", "lzw_maximum_output_length",
                 "run_length_maximum_output_length", "zlib_maximum_output_length",
                 "brotli_maximum_output_length", "image_maximum_buffer_size")


def preload(kind: str) -> None:
    """Import the parser ``kind`` needs (before the child limits its memory) and set the
    parser's own limits."""
    if kind == PDF:
        import dataclasses

        import pypdf

        known = {f.name for f in dataclasses.fields(pypdf.Configuration)}
        limits = {name: PYPDF_STREAM_LIMIT for name in _PYPDF_LIMITS if name in known}
        # The external jbig2dec would run outside this child's limits; text needs no image.
        pypdf.overwrite_configuration(**limits, jbig2dec_binary=None)
    elif kind == DOCX:
        import docx  # noqa: F401
    elif kind == HTML:
        import bs4  # noqa: F401


def parse(kind: str, data: bytes, name: str, max_chars: int) -> tuple[str, tuple[int, ...]]:
    """``data`` read as ``kind``; text over ``max_chars`` is refused here, so that no
    more than that goes back to the app."""
    if kind == PDF:
        text, pages = _read_pdf(data, name, max_chars)
    elif kind == DOCX:
        text, pages = _read_docx(data, name), ()
    elif kind == HTML:
        text, pages = _read_html(data, name), ()
    else:
        raise ValueError(f"no parser for {kind!r}")
    if len(text) > max_chars:
        raise too_long(name, len(text), max_chars)
    return text, pages


# --- PDF ----------------------------------------------------------------------------
def _read_pdf(data: bytes, name: str, max_chars: int) -> tuple[str, tuple[int, ...]]:
    """The text layer page by page; pages joined by a blank line, their starts kept."""
    # The header may follow some junk; readers accept it within the first KB.
    if b"%PDF" not in data[:1024]:
        raise DocumentError(
            f"{name} is not a PDF, whatever its name says: open it and save it as a PDF,"
            " or rename it to what it is", name)
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and not _decrypt_empty(reader):
            raise DocumentError(
                f"{name} is encrypted: open it, save a copy without a password, and attach"
                " that", name)
        parts: list[str] = []
        pages: list[int] = []
        offset = 0
        for page in reader.pages:
            text = clean_text(page.extract_text() or "").strip()
            if parts:
                offset += 2  # the blank line between pages
            pages.append(offset)
            parts.append(text)
            offset += len(text)
            if offset > max_chars:
                break  # too long: said by the caller; no need to read the rest
    except (DocumentError, MemoryError, RecursionError):
        raise
    except Exception:  # pypdf raises many kinds on a broken file; the user needs one
        raise DocumentError(
            f"{name} is damaged and could not be read as a PDF: open it in a PDF viewer,"
            " save a new copy, and attach that", name) from None
    if not pages:
        raise DocumentError(f"{name} has no pages: attach a PDF with text in it", name)
    return "\n\n".join(parts), tuple(pages)


def _decrypt_empty(reader: object) -> bool:
    """Many "encrypted" PDFs only restrict printing and open with an empty password."""
    try:
        return bool(reader.decrypt(""))  # type: ignore[attr-defined]
    except Exception:  # AES without the cryptography package, unknown handlers
        return False


# --- DOCX ---------------------------------------------------------------------------
def _read_docx(data: bytes, name: str) -> str:
    """Paragraphs and tables in body order; a table row is its cells joined by " | "."""
    if data.startswith(b"\xd0\xcf\x11\xe0"):  # OLE: an old .doc or a password-protected file
        raise DocumentError(
            f"{name} is an old Word file or has a password: open it in Word, save it as"
            " .docx without a password, and attach that", name)
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise DocumentError(
            f"{name} is not a Word document, whatever its name says: open it and save it"
            " as .docx, or rename it to what it is", name)
    import docx
    from docx.table import Table

    text_only = text_parts_copy(data, name)
    try:
        document = docx.Document(text_only)
        blocks: list[str] = []
        for item in document.iter_inner_content():
            if isinstance(item, Table):
                blocks.append(_table_text(item))
            else:
                blocks.append(item.text)
    except (MemoryError, RecursionError):
        raise
    except Exception:  # python-docx, lxml and zipfile raise many kinds on a broken file
        raise DocumentError(
            f"{name} is damaged and could not be read as a Word document: open it in Word,"
            " save a new copy, and attach that", name) from None
    text = "\n\n".join(b.strip() for b in blocks if b.strip())
    return clean_text(text)


def _table_text(table: object) -> str:
    rows = []
    for row in table.rows:  # type: ignore[attr-defined]
        cells: list[str] = []
        last = None
        for cell in row.cells:
            if cell._tc is last:  # a merged cell comes once per grid column it spans
                continue
            last = cell._tc
            cells.append(" ".join(cell.text.split()))
        rows.append(" | ".join(cells))
    return "\n".join(rows)


# --- HTML ---------------------------------------------------------------------------
_DROP = ("script", "style", "nav", "noscript", "template", "svg", "head")
_BLOCKS = ("p", "div", "section", "article", "main", "header", "footer", "aside", "h1", "h2",
           "h3", "h4", "h5", "h6", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "pre",
           "blockquote", "figure", "figcaption", "form", "hr", "address", "details",
           "summary")
_HIDDEN_STYLE = re.compile(r"display\s*:\s*none|visibility\s*:\s*hidden", re.IGNORECASE)


def is_hidden(tag: object) -> bool:
    """An element a browser does not show: ``hidden``, ``aria-hidden="true"``, or an
    inline ``display: none`` / ``visibility: hidden``. Text a reader never sees must not
    reach the model (it is where a page hides instructions)."""
    attrs = getattr(tag, "attrs", None)
    if not attrs:
        return False
    if "hidden" in attrs or str(attrs.get("aria-hidden", "")).strip().lower() == "true":
        return True
    return bool(_HIDDEN_STYLE.search(str(attrs.get("style", ""))))


def _read_html(data: bytes, name: str) -> str:
    """The visible text, a line per block; scripts, styles, navigation and hidden
    elements dropped."""
    from bs4 import BeautifulSoup

    try:
        soup = BeautifulSoup(data, "html.parser")
        title = soup.title.get_text(" ", strip=True) if soup.title else ""
        text = _visible_text(soup)
    except (MemoryError, RecursionError):
        raise
    except Exception:  # the parser is lenient; this is for what it still cannot take
        raise DocumentError(
            f"{name} could not be read as a web page: save it as text and attach that",
            name) from None
    lines = [" ".join(line.split()).removesuffix(" |") for line in clean_text(text).split("\n")]
    body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    if title and not body.startswith(title):
        body = f"{title}\n\n{body}" if body else title
    return body


def _visible_text(root: object) -> str:
    """The text of ``root``'s tree in one walk with a stack of its own (a page nested
    100,000 deep must not hit the recursion limit, and editing the tree with a newline
    per block cost a scan of the siblings each, quadratic in a long page): a newline
    around each block, " | " after a table cell, nothing of a dropped or hidden element."""
    from bs4 import CData, NavigableString, Tag

    out: list[str] = []
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if not isinstance(node, Tag):
            # Comments, doctypes and the like are NavigableString subclasses: not text.
            if type(node) is NavigableString or isinstance(node, CData):
                out.append(str(node))
            continue
        if leaving:
            out.append(" | " if node.name in ("td", "th") else "\n")
            continue
        if node.name in _DROP or is_hidden(node):
            continue
        if node.name == "br":
            out.append("\n")
            continue
        block = node.name in _BLOCKS
        if block:
            out.append("\n")
        if block or node.name in ("td", "th"):
            stack.append((node, True))
        stack.extend((child, False) for child in reversed(node.contents))
    return "".join(out)
