"""Reading attached files off the GUI thread: a big PDF takes seconds to read, and the
window must keep drawing and answering meanwhile.

One read at a time (a pool of one thread): the machine may have two cores, one of which
the engine is using, and files read one after the other arrive in the order given. Each
read can be cancelled (the reading chip's ×): its child process is killed, or it never
starts, and it leaves the list of files being read at once, so a Send waits on it no
longer. A read that times out or whose reader dies leaves it as a failure.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

from app.documents.reading import Document, DocumentError, DocumentRead

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

    done = Signal(int, object)  # job id, Document
    failed = Signal(int, str)  # job id, the sentence for the user


class _ReadJob(QRunnable):
    def __init__(self, job_id: int, read: DocumentRead, relay: _Relay) -> None:
        super().__init__()
        self.job_id, self.read, self.relay = job_id, read, relay

    def run(self) -> None:
        try:
            doc = self.read.result()
        except DocumentError as exc:  # ReadCancelled too: the loader drops it
            self.relay.failed.emit(self.job_id, str(exc))
        except Exception as exc:  # a bug must reach the user as a sentence, not a crash
            log.exception("reading %s failed", self.read.path)
            self.relay.failed.emit(self.job_id, f"{self.read.name} could not be read "
                                   f"({type(exc).__name__}: {exc})")
        else:
            self.relay.done.emit(self.job_id, doc)


class DocumentLoader(QObject):
    """``read(paths)`` reads files in a worker thread; each arrives as ``loaded`` or
    ``failed`` in the GUI thread, and ``reading_changed`` lists the names still being
    read (the busy chips); ``cancel(i)`` stops the i-th of them."""

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
        self._ids = itertools.count(1)
        self._jobs: dict[int, DocumentRead] = {}  # not finished, in the order asked
        self._reading: list[int] = []  # the jobs the user still waits on (not cancelled)

    @property
    def reading(self) -> list[str]:
        """The names of the files still being read."""
        return [self._jobs[i].name for i in self._reading]

    def read(self, paths: list[Path]) -> None:
        for path in paths:
            job_id, read = next(self._ids), DocumentRead(Path(path))
            self._jobs[job_id] = read
            self._reading.append(job_id)
            self.pool.start(_ReadJob(job_id, read, self._relay))
        if paths:
            self.reading_changed.emit(self.reading)

    def cancel(self, index: int) -> None:
        """Stop reading the ``index``-th file of ``reading``: it is dropped now, and its
        child process, if it started, is killed."""
        if not 0 <= index < len(self._reading):
            return
        read = self._jobs[self._reading.pop(index)]
        read.cancel()
        self.reading_changed.emit(self.reading)
        self.failed.emit(f"Stopped reading {read.name}: it is not attached.")

    def wait(self, timeout_ms: int = 30_000) -> bool:
        """Drop the reads not started, stop the one running and wait for its thread (the
        app closes)."""
        self.pool.clear()
        for read in self._jobs.values():
            read.cancel()
        return self.pool.waitForDone(timeout_ms)

    def _finish(self, job_id: int) -> bool:
        """Forget the job; True when the user still waited on it (not cancelled)."""
        self._jobs.pop(job_id, None)
        if job_id not in self._reading:
            return False
        self._reading.remove(job_id)
        self.reading_changed.emit(self.reading)
        return True

    def _on_done(self, job_id: int, doc: Document) -> None:
        if self._finish(job_id):
            self.loaded.emit(doc)

    def _on_failed(self, job_id: int, message: str) -> None:
        if self._finish(job_id):
            self.failed.emit(message)
