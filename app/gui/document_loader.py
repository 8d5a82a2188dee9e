"""Reading attached files off the GUI thread: a big PDF takes seconds to read, and the
window must keep drawing and answering meanwhile.

One read at a time (a pool of one thread): the machine may have two cores, one of which
the engine is using, and files read one after the other arrive in the order given.
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

from app.documents.reading import Document, DocumentError, read_document

log = logging.getLogger(__name__)

# A paste this long becomes an attachment instead of a wall of text in the message box.
PASTE_CHARS = 1500
PASTE_LINES = 30


def is_long_paste(text: str) -> bool:
    return len(text) > PASTE_CHARS or text.count("\n") + 1 > PASTE_LINES


def paste_name(text: str) -> str:
    n = text.strip("\n").count("\n") + 1
    return f"Pasted text, {n:,} line{'s' if n != 1 else ''}"


class _Relay(QObject):
    """Carries a job's result to the GUI thread (queued: the receiver lives there)."""

    done = Signal(str, object)  # path, Document
    failed = Signal(str, str)  # path, the sentence for the user


class _ReadJob(QRunnable):
    def __init__(self, path: Path, relay: _Relay) -> None:
        super().__init__()
        self.path, self.relay = path, relay

    def run(self) -> None:
        try:
            doc = read_document(self.path)
        except DocumentError as exc:
            self.relay.failed.emit(str(self.path), str(exc))
        except Exception as exc:  # a bug must reach the user as a sentence, not a crash
            log.exception("reading %s failed", self.path)
            self.relay.failed.emit(str(self.path), f"{self.path.name} could not be read "
                                   f"({type(exc).__name__}: {exc})")
        else:
            self.relay.done.emit(str(self.path), doc)


class DocumentLoader(QObject):
    """``read(paths)`` reads files in a worker thread; each arrives as ``loaded`` or
    ``failed`` in the GUI thread, and ``reading_changed`` lists the names still being
    read (the busy chip)."""

    loaded = Signal(object)  # Document
    failed = Signal(str)  # DocumentError's sentence
    reading_changed = Signal(object)  # list[str]: names being read

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(1)
        self._relay = _Relay(self)
        self._relay.done.connect(self._on_done)
        self._relay.failed.connect(self._on_failed)
        self._reading: list[str] = []  # paths, in the order asked

    @property
    def reading(self) -> list[str]:
        """The names of the files still being read."""
        return [Path(p).name for p in self._reading]

    def read(self, paths: list[Path]) -> None:
        for path in paths:
            self._reading.append(str(path))
            self.pool.start(_ReadJob(Path(path), self._relay))
        if paths:
            self.reading_changed.emit(self.reading)

    def wait(self, timeout_ms: int = 30_000) -> bool:
        """Drop the reads not started and wait for the one running (the app closes)."""
        self.pool.clear()
        return self.pool.waitForDone(timeout_ms)

    def _finish(self, path: str) -> None:
        if path in self._reading:
            self._reading.remove(path)
        self.reading_changed.emit(self.reading)

    def _on_done(self, path: str, doc: Document) -> None:
        self._finish(path)
        self.loaded.emit(doc)

    def _on_failed(self, path: str, message: str) -> None:
        self._finish(path)
        self.failed.emit(message)
