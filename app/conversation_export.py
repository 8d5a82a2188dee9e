"""Conversations out and back in: Markdown to read or share, JSON to keep or move.

The JSON is OpenAI's message list (``{"role", "content"}``, the system prompt first) so
other tools read it as it is, wrapped with what Tandem needs to restore the chat: title,
settings, and each answer's status and generation figures under ``"tandem"``, with the
documents attached to a message as ``"tandem" -> "attachments"`` (version 2; version 1
files, without them, still import). Importing checks everything before anything is
written, and says what is wrong in one line.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.conversation_store import (
    COMPLETE,
    INTERRUPTED,
    STATUSES,
    STREAMING,
    Attachment,
    ChatSettings,
    Conversation,
    ConversationStore,
    Message,
)
from app.documents.reading import KINDS, Document
from app.tools.turns import calls_of, describe_call

FORMAT = "tandem.conversation"
VERSION = 2  # 2: attachments
ROLES = ("user", "assistant")
MAX_IMPORT_BYTES = 64 << 20  # a chat larger than this is not a chat export


@dataclass(frozen=True)
class ImportedMessage:
    role: str
    content: str
    status: str = COMPLETE
    info: dict = field(default_factory=dict)
    attachments: tuple[Document, ...] = ()


@dataclass(frozen=True)
class ImportedConversation:
    title: str
    system_prompt: str
    settings: ChatSettings
    messages: tuple[ImportedMessage, ...]


# A message's id to the documents attached to it (``message_attachments`` makes one).
Attached = Mapping[int, list[Attachment]]


def message_attachments(store: ConversationStore, messages: list[Message]) -> Attached:
    """What ``to_json``, ``to_markdown`` and ``write_export`` take as ``attachments``."""
    return {m.id: found for m in messages if (found := store.message_attachments(m.id))}


def to_json(conversation: Conversation, messages: list[Message],
            attachments: Attached | None = None) -> dict:
    out_messages: list[dict] = []
    if conversation.system_prompt:
        out_messages.append({"role": "system", "content": conversation.system_prompt})
    for m in messages:
        entry: dict = {"role": m.role, "content": m.content}
        docs = (attachments or {}).get(m.id, [])
        if m.status != COMPLETE or m.info or docs:
            entry["tandem"] = {"status": m.status, **m.info}
        if docs:
            entry["tandem"]["attachments"] = [
                {"name": a.name, "kind": a.kind, "text": a.text, "pages": list(a.pages)}
                for a in docs]
        out_messages.append(entry)
    return {"format": FORMAT, "version": VERSION, "title": conversation.title,
            "created_at": conversation.created_at, "exported_at": time.time(),
            "settings": asdict(conversation.settings), "messages": out_messages}


def to_markdown(conversation: Conversation, messages: list[Message],
                attachments: Attached | None = None) -> str:
    lines = [f"# {conversation.title}", ""]
    if conversation.system_prompt:
        lines += ["> **System:** " + conversation.system_prompt.replace("\n", "\n> "), ""]
    for m in messages:
        who = "You" if m.role == "user" else "Assistant"
        note = m.info.get("summary", "") if m.role == "assistant" else ""
        if m.status not in (COMPLETE, STREAMING):
            note = f"{m.status}; {note}" if note else m.status
        lines += [f"### {who}" + (f" *({note})*" if note else ""), "", m.content, ""]
        lines += [line for call in calls_of(m.info) for line in (describe_call(call), "")]
        docs = (attachments or {}).get(m.id, [])
        if docs:  # named, not copied: the JSON export keeps their text
            lines += ["*Attached: " + ", ".join(a.name for a in docs) + "*", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_export(conversation: Conversation, messages: list[Message], path: Path,
                 attachments: Attached | None = None) -> str:
    """Markdown for ``.md``/``.markdown``, JSON otherwise; returns the format written."""
    path = Path(path)
    if path.suffix.lower() in (".md", ".markdown"):
        path.write_text(to_markdown(conversation, messages, attachments), encoding="utf-8")
        return "markdown"
    path.write_text(json.dumps(to_json(conversation, messages, attachments), indent=1,
                               ensure_ascii=False) + "\n", encoding="utf-8")
    return "json"


def read_import(path: Path) -> ImportedConversation:
    """Raises ValueError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        # Only a regular file is opened: a FIFO or a device would block or never end.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{path.name} is not a regular file: not a conversation export")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_IMPORT_BYTES + 1)
        if len(raw) > MAX_IMPORT_BYTES:
            raise ValueError(f"{path.name} is over {MAX_IMPORT_BYTES >> 20} MiB: not a "
                             "conversation export")
        data = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path.name} is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path.name} nests too deeply: not a conversation export") from None
    try:
        return from_json(data, fallback_title=path.stem)
    except ValueError as exc:
        raise ValueError(f"{path.name}: {exc}") from None


def from_json(data: object, fallback_title: str = "Imported chat") -> ImportedConversation:
    """A Tandem export, or a bare OpenAI message list (or ``{"messages": [...]}``)."""
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ValueError("expected a list of messages or an object with \"messages\"")
    version = data.get("version", VERSION)
    if type(version) is not int:
        raise ValueError(f"its version {version!r} is not a number")
    if data.get("format", FORMAT) != FORMAT or version > VERSION:
        raise ValueError(f"written by a newer or another program ({data.get('format')} "
                         f"version {data.get('version')})")
    system, messages = "", []
    for i, m in enumerate(data["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i + 1} has no text content")
        role = m.get("role")
        if role == "system":
            if messages or system:
                raise ValueError(f"message {i + 1}: a system prompt only comes first")
            system = m["content"]
            continue
        if role not in ROLES:
            raise ValueError(f"message {i + 1} has the role {role!r} (user, assistant or "
                             "system)")
        extra = m.get("tandem") if isinstance(m.get("tandem"), dict) else {}
        status = extra.get("status", COMPLETE)
        if status == STREAMING:  # exported while it was being written
            status = INTERRUPTED
        elif status not in STATUSES:
            raise ValueError(f"message {i + 1} has an unknown status {status!r}")
        info = {k: v for k, v in extra.items() if k not in ("status", "attachments")}
        docs = _attachments(extra.get("attachments", []), i)
        messages.append(ImportedMessage(role, m["content"], status, info, docs))
    settings = ChatSettings()
    if isinstance(data.get("settings"), dict):
        try:
            settings = ChatSettings.from_json(json.dumps(data["settings"]))
        except TypeError as exc:
            raise ValueError(f"its settings do not apply: {exc}") from None
    title = data.get("title") if isinstance(data.get("title"), str) else fallback_title
    return ImportedConversation(title or fallback_title, system, settings, tuple(messages))


def _attachments(data: object, i: int) -> tuple[Document, ...]:
    """A message's exported attachments as Documents; ValueError saying what is wrong."""
    where = f"message {i + 1}"
    if not isinstance(data, list):
        raise ValueError(f"{where}: its attachments are not a list")
    docs = []
    for j, a in enumerate(data):
        if not isinstance(a, dict):
            raise ValueError(f"{where}: attachment {j + 1} is not an object")
        name, kind, text, pages = a.get("name"), a.get("kind"), a.get("text"), a.get("pages", [])
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: attachment {j + 1} has no name")
        if kind not in KINDS:
            raise ValueError(f"{where}: attachment {name!r} has the kind {kind!r} "
                             f"({', '.join(KINDS)})")
        if not isinstance(text, str):
            raise ValueError(f"{where}: attachment {name!r} has no text")
        if (not isinstance(pages, list) or not all(type(p) is int for p in pages)
                or pages != sorted(pages) or any(not 0 <= p <= len(text) for p in pages)):
            raise ValueError(f"{where}: attachment {name!r} has pages that are not "
                             "ascending offsets in its text")
        docs.append(Document(name, kind, text, tuple(pages)))
    return tuple(docs)


def import_into(store: ConversationStore, imported: ImportedConversation) -> Conversation:
    """A new conversation in ``store`` holding ``imported`` (all of it, or nothing)."""
    return store.add_conversation(imported.title, imported.system_prompt, imported.settings,
                                  [(m.role, m.content, m.status, m.info)
                                   for m in imported.messages],
                                  [m.attachments for m in imported.messages])
