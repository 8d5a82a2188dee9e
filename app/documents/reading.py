"""Read a file into text: plain text, Markdown, code, PDF, DOCX or HTML.

Every failure is a ``DocumentError`` whose message names the file, says what is wrong
and what to do; no parser's traceback gets out (a user attaches whatever they have).

Reading is bounded: only a regular file is opened (a FIFO would block the open, a device
never ends), and PDF, DOCX and HTML are parsed in a child process with a memory limit and
a timeout (``reader_process``), which ``DocumentRead.cancel()`` kills. Plain text is
decoded here: its cost is its size, which is checked first.
"""

from __future__ import annotations

import bisect
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from app.documents.errors import DocumentError as DocumentError
from app.documents.errors import ReadCancelled as ReadCancelled
from app.documents.errors import clean_text as clean_text
from app.documents.errors import size_text, too_long
from app.documents.reader_process import ReaderProcess, ReadLimits

# Limits: a bigger file is almost surely not meant for a chat, and reading it would
# stall the app. Module globals so tests can lower them.
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_CHARS = 4_000_000
# A parse's child: killed after this long, and its allocations past this much fail.
READ_TIMEOUT_S = 60.0
READ_MEMORY_BYTES = 1024 * 1024 * 1024

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
    return DocumentRead(path).result()


class DocumentRead:
    """One file to read. ``result()`` reads it (it blocks: call it off the GUI thread);
    ``cancel()``, from any thread, stops it: the child parsing it is killed, and
    ``result()`` raises ReadCancelled."""

    def __init__(self, path: Path, timeout_s: float | None = None,
                 memory_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.name = self.path.name or str(self.path)
        self.timeout_s = READ_TIMEOUT_S if timeout_s is None else timeout_s
        self.memory_bytes = READ_MEMORY_BYTES if memory_bytes is None else memory_bytes
        self.process = ReaderProcess()

    @property
    def cancelled(self) -> bool:
        return self.process.killed

    def cancel(self) -> None:
        self.process.kill()

    def result(self) -> Document:
        name = self.name
        if self.cancelled:
            raise ReadCancelled(f"Stopped reading {name}: it is not attached", name)
        fd = _open_regular(self.path, name)
        try:
            kind = kind_for(self.path)
            if kind in (PDF, DOCX, HTML):
                limits = ReadLimits(self.timeout_s, self.memory_bytes, MAX_FILE_BYTES,
                                    MAX_CHARS)
                text, pages = self.process.run(fd, kind, name, limits)
            else:
                data = _read_all(fd, name)
                pages = ()
                if kind is None:
                    text, kind = _decode_unknown(data, name), TEXT
                else:
                    text = _decode_text(data, name)
        finally:
            os.close(fd)
        return _finish(name, kind, text, pages)


def document_from_text(name: str, text: str) -> Document:
    """A long text pasted into the message box, kept as a document named ``name``."""
    return _finish(name, TEXT, text, ())


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
        raise too_long(name, len(text), MAX_CHARS)
    return Document(name, kind, text, pages)


def _open_regular(path: Path, name: str) -> int:
    """A descriptor open on the regular file ``path`` names (symlinks resolved), its size
    within MAX_FILE_BYTES. Anything else is refused before it is opened: opening a FIFO
    waits for a writer forever, and a device such as /dev/zero never ends."""
    try:
        real = path.resolve(strict=True)
        mode = os.stat(real).st_mode
        if stat.S_ISDIR(mode):
            raise DocumentError(
                f"{name} is a folder: attach the files in it one by one", name)
        _check_regular(mode, name)
        # Non-blocking, and not through a link: should the name now lead elsewhere, the
        # open neither hangs on a FIFO nor follows it, and the fstat below sees it.
        flags = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_BINARY", 0))
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise DocumentError(
            f"{name} was not found: check that the file is still there and attach it"
            " again", name) from None
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python 3.11)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise DocumentError(
            f"{name} could not be read ({reason}): check that you may open it", name) from None
    try:
        info = os.fstat(fd)
        _check_regular(info.st_mode, name)
        if info.st_size > MAX_FILE_BYTES:
            raise DocumentError(
                f"{name} is {size_text(info.st_size)}, more than the"
                f" {size_text(MAX_FILE_BYTES)} Tandem reads: attach a smaller file or a part"
                " of it", name)
        if info.st_size == 0:
            raise DocumentError(f"{name} is empty: there is nothing in it to read", name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(mode: int, name: str) -> None:
    if stat.S_ISREG(mode):
        return
    what = ("a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
    raise DocumentError(
        f"{name} is {what}, not a saved file, and Tandem reads saved files only: save"
        " what it holds to a file and attach that", name)


def _read_all(fd: int, name: str) -> bytes:
    """The file's bytes, MAX_FILE_BYTES at most (a file may grow after its size was
    checked)."""
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise DocumentError(
            f"{name} could not be read ({e.strerror or e}): check that you may open it",
            name) from None
    if len(data) > MAX_FILE_BYTES:
        raise DocumentError(
            f"{name} is more than the {size_text(MAX_FILE_BYTES)} Tandem reads: attach a"
            " smaller file or a part of it", name)
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
