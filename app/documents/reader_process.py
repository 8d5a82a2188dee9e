"""A parse in a child process the app can bound and kill (``reader_child`` is the child).

Why a process: pypdf, python-docx and BeautifulSoup run in Python and C code that a
hostile file can drive to gigabytes or into a loop; a thread cannot be stopped, and its
memory is the app's. A child has an address-space limit, a wall-clock timeout after which
it is killed, and ``kill()`` for the user's cancel. It is started as its own interpreter
(``sys.executable -m``, as the engine's process is), not forked: the GUI has threads.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from app.documents.errors import DocumentError, ReadCancelled, size_text

log = logging.getLogger(__name__)

_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_CHILD = "app.documents.reader_child"
# The child's CPU-time limit past the timeout: it ends even if the app dies first.
_CPU_MARGIN_S = 10
_LOG_TAIL = 2000


@dataclass(frozen=True)
class ReadLimits:
    timeout_s: float  # wall clock, from the child's start; then it is killed
    memory_bytes: int  # the child's address space above what it has after its imports
    max_bytes: int  # the file
    max_chars: int  # the text


class ReaderProcess:
    """One parse in a child. ``run`` blocks (a worker thread calls it); ``kill``, from
    any thread, stops it, and ``run`` then raises ReadCancelled. ``pid`` and ``process``
    are set once the child started (``started``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._killed = False
        self.process: subprocess.Popen[bytes] | None = None
        self.started = threading.Event()

    @property
    def killed(self) -> bool:
        return self._killed

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            if self.process is not None and self.process.poll() is None:
                self.process.kill()

    def run(self, file: int, kind: str, name: str, limits: ReadLimits
            ) -> tuple[str, tuple[int, ...]]:
        """Parse the file open on descriptor ``file`` as ``kind``: the text and a PDF's
        page starts; DocumentError when it cannot, ReadCancelled after ``kill()``."""
        cpu_s = math.ceil(limits.timeout_s) + _CPU_MARGIN_S
        command = [sys.executable, "-m", _CHILD, kind, name, str(limits.max_bytes),
                   str(limits.max_chars), str(limits.memory_bytes), str(cpu_s)]
        with tempfile.TemporaryFile(prefix="tandem-reader-") as errors:
            with self._lock:
                if self._killed:
                    raise _cancelled(name)
                self.process = child = subprocess.Popen(
                    command, stdin=file, stdout=subprocess.PIPE, stderr=errors,
                    cwd=_PROJECT_ROOT)
            self.started.set()
            try:
                out, _ = child.communicate(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                if self._killed:
                    raise _cancelled(name) from None
                raise DocumentError(
                    f"{name} took more than {limits.timeout_s:g} s to read, so Tandem"
                    " stopped: the file may be damaged or built to stall a reader; save it"
                    " as text, or attach a part of it", name) from None
            finally:
                if child.poll() is None:  # interrupted: no child outlives its read
                    child.kill()
                    child.wait()
            if self._killed:
                raise _cancelled(name)
            return _reply(out, child.returncode, name, errors, limits)


def _cancelled(name: str) -> ReadCancelled:
    return ReadCancelled(f"Stopped reading {name}: it is not attached", name)


def _reply(out: bytes, returncode: int, name: str, errors: IO[bytes], limits: ReadLimits
           ) -> tuple[str, tuple[int, ...]]:
    try:
        reply = json.loads(out) if out else None
    except ValueError:
        reply = None
    if isinstance(reply, dict):
        if isinstance(reply.get("error"), str):
            raise DocumentError(reply["error"], name)
        text, pages = reply.get("text"), reply.get("pages")
        if isinstance(text, str) and isinstance(pages, list) \
                and all(isinstance(p, int) for p in pages):
            return text, tuple(pages)
    errors.seek(0)
    tail = errors.read()[-_LOG_TAIL:].decode("utf-8", "replace")
    log.warning("the reader of %s ended (%s) without a reply: %s", name, _how(returncode),
                tail)
    raise DocumentError(
        f"{name} could not be read: the reader stopped ({_how(returncode)}); the file may"
        f" be damaged or need more than the {size_text(limits.memory_bytes)} of memory"
        " Tandem gives a document: save it as text and attach that", name)


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"
