"""The reader's child process: ``python -m app.documents.reader_child KIND NAME MAX_BYTES
MAX_CHARS MEMORY_BYTES CPU_SECONDS``, the file on stdin; one JSON object on stdout,
``{"text": ..., "pages": [...]}`` or ``{"error": "the sentence for the user"}``.

It imports its parser and reads the file, then limits itself: its address space to what
it has plus MEMORY_BYTES (an allocation past that fails with MemoryError, not the machine's swap),
its CPU time (a backstop should the app die and leave it running), and the size of any
file it writes. ``reader_process`` starts it, and kills it on a timeout or a cancel.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings

from app.documents import parsers
from app.documents.errors import DocumentError, size_text

# The size of stderr's file (the app keeps its tail for the log); parsers' warnings muted.
MAX_WRITTEN_BYTES = 1024 * 1024


def address_space() -> int | None:
    """This process's virtual size in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def limit_self(memory_bytes: int, cpu_seconds: int) -> None:
    try:
        import resource
    except ImportError:  # Windows: the timeout in reader_process still applies
        return

    def lower(which: int, value: int) -> None:
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        if soft == resource.RLIM_INFINITY or value < soft:
            resource.setrlimit(which, (value, hard))

    size = address_space()
    if size is not None:
        lower(resource.RLIMIT_AS, size + memory_bytes)
    lower(resource.RLIMIT_CPU, cpu_seconds)
    lower(resource.RLIMIT_FSIZE, MAX_WRITTEN_BYTES)


def read_input(max_bytes: int) -> bytes | None:
    """stdin's bytes; None past ``max_bytes`` (the file grew after the app looked)."""
    chunks: list[bytes] = []
    n = 0
    while chunk := sys.stdin.buffer.read1(1024 * 1024):
        n += len(chunk)
        if n > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def parse(data: bytes, kind: str, name: str, max_chars: int, memory_bytes: int) -> dict:
    try:
        text, pages = parsers.parse(kind, data, name, max_chars)
    except DocumentError as exc:
        return {"error": str(exc)}
    except MemoryError:
        return {"error": f"{name} needs more than {size_text(memory_bytes)} of memory to"
                         " read, more than Tandem gives a document: attach a part of it,"
                         " or save it as text"}
    except RecursionError:
        return {"error": f"{name} is nested too deeply to read: save it as text and attach"
                         " that"}
    return {"text": text, "pages": list(pages)}


def main(argv: list[str]) -> int:
    kind, name = argv[0], argv[1]
    max_bytes, max_chars, memory_bytes, cpu_seconds = (int(a) for a in argv[2:6])
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    parsers.preload(kind)
    data = read_input(max_bytes)
    limit_self(memory_bytes, cpu_seconds)
    if data is None:
        reply = {"error": f"{name} is more than the {size_text(max_bytes)} Tandem reads:"
                          " attach a smaller file or a part of it"}
    else:
        reply = parse(data, kind, name, max_chars, memory_bytes)
    sys.stdout.buffer.write(json.dumps(reply).encode("ascii"))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
