"""The errors reading a document raises; a module of their own so that the reader's child
process (``reader_child``) and its keeper (``reader_process``) share them without
importing each other."""

from __future__ import annotations


class DocumentError(Exception):
    """A file Tandem cannot read; ``str()`` is one sentence for the user."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class ReadCancelled(DocumentError):
    """The read was stopped on request (the chip's ×, or the app closing)."""


def clean_text(text: str) -> str:
    """Newlines as ``\\n`` and no NULs (SQLite and the tokenizer see the same text)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")


def too_long(name: str, n_chars: int, max_chars: int) -> DocumentError:
    return DocumentError(
        f"{name} holds {n_chars:,} characters of text, more than the {max_chars:,}"
        " Tandem takes: attach a part of it", name)


def size_text(n: int) -> str:
    """Binary units, as file managers show them: 64 MiB reads "64 MB"."""
    if n >= 1024 * 1024:
        return f"{n / (1024 * 1024):.1f} MB".replace(".0 MB", " MB")
    return f"{max(1, round(n / 1024))} KB"
