"""Read a file into text: plain text, Markdown, code, PDF, DOCX or HTML.

Every failure is a ``DocumentError`` whose message names the file, says what is wrong
and what to do; no parser's traceback gets out (a user attaches whatever they have).
"""

from __future__ import annotations

import bisect
import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

# Limits: a bigger file is almost surely not meant for a chat, and reading it would
# stall the app. Module globals so tests can lower them.
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_CHARS = 4_000_000

TEXT, MARKDOWN, CODE, PDF, DOCX, HTML = "text", "markdown", "code", "pdf", "docx", "html"
KINDS = (TEXT, MARKDOWN, CODE, PDF, DOCX, HTML)

_TEXT_EXT = {"txt", "text", "log", "csv", "tsv", "rst"}
_MARKDOWN_EXT = {"md", "markdown"}
_CODE_EXT = {
    "py", "js", "ts", "tsx", "jsx", "c", "h", "cpp", "hpp", "cc", "java", "kt", "go", "rs",
    "rb", "php", "cs", "swift", "sh", "bash", "zsh", "sql", "json", "yaml", "yml", "toml",
    "ini", "cfg", "xml", "css", "scss", "lua", "r", "m", "scala", "pl", "hs", "ex", "exs",
    "dart", "vue", "svelte", "makefile", "dockerfile",
}
_CODE_NAMES = {"makefile", "dockerfile"}
_HTML_EXT = {"html", "htm"}

# Where a text file is given by name, a share of control characters above this says binary.
_CONTROL_SHARE = 0.01
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class DocumentError(Exception):
    """A file Tandem cannot read; ``str()`` is one sentence for the user."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Document:
    """A document's text. ``pages``: the offsets in ``text`` where each page starts (PDF
    only)."""

    name: str
    kind: str
    text: str
    pages: tuple[int, ...] = ()

    def page_at(self, offset: int) -> int | None:
        """The 1-based page holding ``offset``; None when the document has no pages."""
        if not self.pages:
            return None
        return max(1, bisect.bisect_right(self.pages, offset))

    @property
    def n_chars(self) -> int:
        return len(self.text)


def kind_for(path: Path) -> str | None:
    """The kind a file's name says, or None for a name Tandem does not know."""
    name = path.name.lower()
    ext = path.suffix.lower().lstrip(".")
    if name in _CODE_NAMES or ext in _CODE_EXT:
        return CODE
    if ext in _TEXT_EXT:
        return TEXT
    if ext in _MARKDOWN_EXT:
        return MARKDOWN
    if ext == "pdf":
        return PDF
    if ext == "docx":
        return DOCX
    if ext in _HTML_EXT:
        return HTML
    return None


def read_document(path: Path) -> Document:
    """Read ``path`` into a Document; raises DocumentError with a message for the user."""
    path = Path(path)
    name = path.name or str(path)
    data = _read_bytes(path, name)
    kind = kind_for(path)
    if kind == PDF:
        text, pages = _read_pdf(data, name)
    elif kind == DOCX:
        text, pages = _read_docx(data, name), ()
    elif kind == HTML:
        text, pages = _read_html(data, name), ()
    elif kind is None:
        text, pages = _decode_unknown(data, name), ()
        kind = TEXT
    else:
        text, pages = _decode_text(data, name), ()
    return _finish(name, kind, text, pages)


def document_from_text(name: str, text: str) -> Document:
    """A long text pasted into the message box, kept as a document named ``name``."""
    return _finish(name, TEXT, text, ())


def clean_text(text: str) -> str:
    """Newlines as ``\\n`` and no NULs (SQLite and the tokenizer see the same text)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")


def _finish(name: str, kind: str, text: str, pages: tuple[int, ...]) -> Document:
    # Readers with pages clean each page before counting offsets: here a no-op for them.
    text = clean_text(text)
    if not text.strip():
        if kind == PDF:
            raise DocumentError(
                f"{name} has no text layer (it looks like a scanned PDF): run it through"
                " OCR, for example with ocrmypdf, and attach the result", name)
        raise DocumentError(f"{name} has no text in it: attach a document with text", name)
    if len(text) > MAX_CHARS:
        raise DocumentError(
            f"{name} holds {len(text):,} characters of text, more than the {MAX_CHARS:,}"
            " Tandem takes: attach a part of it", name)
    return Document(name, kind, text, pages)


def _size(n: int) -> str:
    # Binary units, as file managers show them: 64 MiB reads "64 MB".
    if n >= 1024 * 1024:
        return f"{n / (1024 * 1024):.1f} MB".replace(".0 MB", " MB")
    return f"{max(1, round(n / 1024))} KB"


def _read_bytes(path: Path, name: str) -> bytes:
    try:
        if path.is_dir():
            raise DocumentError(
                f"{name} is a folder: attach the files in it one by one", name)
        if not path.exists():
            raise DocumentError(
                f"{name} was not found: check that the file is still there and attach it"
                " again", name)
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DocumentError(
                f"{name} is {_size(size)}, more than the {_size(MAX_FILE_BYTES)} Tandem"
                " reads: attach a smaller file or a part of it", name)
        data = path.read_bytes()
    except OSError as e:
        raise DocumentError(
            f"{name} could not be read ({e.strerror or e}): check that you may open it",
            name) from None
    if not data:
        raise DocumentError(f"{name} is empty: there is nothing in it to read", name)
    return data


# --- plain text ---------------------------------------------------------------------
def _decode_bom(data: bytes) -> str | None:
    """Text with a byte order mark, or None when there is none."""
    for bom, codec in ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe", "utf-16"),
                       (b"\xfe\xff", "utf-16")):
        if data.startswith(bom):
            try:
                return data.decode(codec)
            except UnicodeDecodeError:
                return None
    return None


def _not_text(name: str) -> DocumentError:
    return DocumentError(
        f"{name} is not a document Tandem can read: it holds binary data, not text;"
        " attach a text, Markdown, code, PDF, Word (.docx) or HTML file", name)


def _decode_unknown(data: bytes, name: str) -> str:
    """A name Tandem does not know: text only when it is plainly Unicode text."""
    text = _decode_bom(data)
    if text is not None:
        return text
    if b"\x00" in data:
        raise _not_text(name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _not_text(name) from None


def _decode_text(data: bytes, name: str) -> str:
    """A file named as text: UTF-8 (or a BOM's codec), else Windows-1252, as old editors
    on Windows save. Binary data is refused; a stray NUL in a log is not binary."""
    text = _decode_bom(data)
    if text is not None:
        return text
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("cp1252", errors="replace")
    if len(_CONTROL.findall(text)) > _CONTROL_SHARE * len(text):
        raise _not_text(name)
    return text


# --- PDF ----------------------------------------------------------------------------
def _read_pdf(data: bytes, name: str) -> tuple[str, tuple[int, ...]]:
    """The text layer page by page; pages joined by a blank line, their starts kept."""
    # The header may follow some junk; readers accept it within the first KB.
    if b"%PDF" not in data[:1024]:
        raise DocumentError(
            f"{name} is not a PDF, whatever its name says: open it and save it as a PDF,"
            " or rename it to what it is", name)
    from pypdf import PdfReader  # imported here: the app starts without loading it

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
            if offset > MAX_CHARS:
                break  # _finish says it is too long; no need to read the rest
    except DocumentError:
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
    import docx  # imported here: the app starts without loading it
    from docx.table import Table

    try:
        document = docx.Document(io.BytesIO(data))
        blocks: list[str] = []
        for item in document.iter_inner_content():
            if isinstance(item, Table):
                blocks.append(_table_text(item))
            else:
                blocks.append(item.text)
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


def _read_html(data: bytes, name: str) -> str:
    """The visible text, a line per block; scripts, styles and navigation dropped."""
    from bs4 import BeautifulSoup  # imported here: the app starts without loading it

    try:
        soup = BeautifulSoup(data, "html.parser")
        title = soup.title.get_text(" ", strip=True) if soup.title else ""
        for tag in soup.find_all(_DROP):
            tag.decompose()
        for tag in soup.find_all("br"):
            tag.replace_with("\n")
        for tag in soup.find_all(("td", "th")):
            tag.insert_after(" | ")
        for tag in soup.find_all(_BLOCKS):
            tag.insert_before("\n")
            tag.insert_after("\n")
        text = soup.get_text()
    except Exception:  # the parser is lenient; this is for what it still cannot take
        raise DocumentError(
            f"{name} could not be read as a web page: save it as text and attach that",
            name) from None
    lines = [" ".join(line.split()).removesuffix(" |") for line in clean_text(text).split("\n")]
    body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    if title and not body.startswith(title):
        body = f"{title}\n\n{body}" if body else title
    return body
