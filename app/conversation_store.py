"""Conversations on disk: one SQLite file (WAL), no Qt.

Durability contract: every write is its own committed transaction, so whatever was
written survives the app being killed. An answer being generated is saved as it streams
with status ``streaming``; opening the store turns any ``streaming`` message left by a
process that died into ``interrupted``, which the app shows as such.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.decoding.sampling import CHAT_DEFAULTS
from engine.hub.model_store import data_dir
from engine.runtime.context_fit import DEFAULT_POLICY

DB_FILE = "conversations.sqlite3"

# Message statuses. Only ``streaming`` is transient; the others are final.
COMPLETE = "complete"
STREAMING = "streaming"
INTERRUPTED = "interrupted"  # the app died while this answer was being written
STOPPED = "stopped"  # the user pressed Stop
FAILED = "failed"  # the engine failed; the content holds what came before
STATUSES = (COMPLETE, STREAMING, INTERRUPTED, STOPPED, FAILED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- ids never reused: views cache by id
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL,
    info TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE (conversation_id, position)
);
CREATE TABLE IF NOT EXISTS app_settings (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class ChatSettings:
    """Per-conversation sampling settings. ``seed`` None draws a fresh seed each time."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    seed: int | None = None
    min_p: float = CHAT_DEFAULTS.min_p
    repeat_penalty: float = CHAT_DEFAULTS.repeat_penalty
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # When the chat outgrows the context: "drop_oldest" turns, or "stop" with an error.
    context_policy: str = DEFAULT_POLICY

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChatSettings:
        known = cls.__dataclass_fields__
        data = {k: v for k, v in json.loads(text or "{}").items() if k in known}
        return cls(**data)


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str = ""
    settings: ChatSettings = field(default_factory=ChatSettings)
    created_at: float = 0.0
    updated_at: float = 0.0
    n_interrupted: int = 0  # messages in it marked interrupted (for the list)


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    position: int  # 0-based order in its conversation
    role: str  # "user" or "assistant"
    content: str
    status: str = COMPLETE
    info: dict = field(default_factory=dict)  # generation summary, error text, ...


class ConversationStore:
    """The conversations database. Use from one thread (the GUI's); ``close()`` is
    idempotent. Raises sqlite3.Error on a database the app cannot use."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else data_dir() / DB_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: each statement, or each explicit transaction, commits at once.
        self._db: sqlite3.Connection | None = sqlite3.connect(self.path, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a committed transaction survives a killed process (only a
        # power cut may lose the last ones) and streaming saves stay cheap.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self.n_recovered = self._recover()

    # --- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise sqlite3.ProgrammingError("the conversation store is closed")
        return self._db

    def journal_mode(self) -> str:
        return self.db.execute("PRAGMA journal_mode").fetchone()[0]

    def _recover(self) -> int:
        """Mark answers a dead process left mid-stream as interrupted; returns how many."""
        cur = self.db.execute("UPDATE messages SET status = ? WHERE status = ?",
                              (INTERRUPTED, STREAMING))
        return cur.rowcount

    # --- conversations ---------------------------------------------------------------
    def create_conversation(self, title: str = "New chat", system_prompt: str = "",
                            settings: ChatSettings | None = None) -> Conversation:
        now = time.time()
        settings = settings or ChatSettings()
        cur = self.db.execute(
            "INSERT INTO conversations (title, system_prompt, settings, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?)", (title, system_prompt, settings.to_json(), now, now))
        return Conversation(cur.lastrowid, title, system_prompt, settings, now, now)

    def add_conversation(self, title: str, system_prompt: str, settings: ChatSettings,
                         messages: list[tuple[str, str, str, dict]]) -> Conversation:
        """A conversation with its messages (role, content, status, info), in one
        transaction: an import is whole or absent."""
        for _, _, status, _ in messages:
            if status not in STATUSES:
                raise ValueError(f"unknown message status {status!r}")
        now = time.time()
        with self._transaction():
            cur = self.db.execute(
                "INSERT INTO conversations (title, system_prompt, settings, created_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?)",
                (title, system_prompt, settings.to_json(), now, now))
            conversation_id = cur.lastrowid
            self.db.executemany(
                "INSERT INTO messages (conversation_id, position, role, content, status, info,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(conversation_id, i, role, content, status, json.dumps(info), now, now)
                 for i, (role, content, status, info) in enumerate(messages)])
        return self.conversation(conversation_id)

    def conversations(self) -> list[Conversation]:
        """All conversations, most recently updated first."""
        rows = self.db.execute(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id"
            " AND m.status = ?) AS n_interrupted FROM conversations c"
            " ORDER BY c.updated_at DESC, c.id DESC", (INTERRUPTED,)).fetchall()
        return [self._conversation(r) for r in rows]

    def conversation(self, conversation_id: int) -> Conversation:
        """Raises KeyError for an unknown id."""
        row = self.db.execute(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id"
            " AND m.status = ?) AS n_interrupted FROM conversations c WHERE c.id = ?",
            (INTERRUPTED, conversation_id)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return self._conversation(row)

    @staticmethod
    def _conversation(row: sqlite3.Row) -> Conversation:
        return Conversation(row["id"], row["title"], row["system_prompt"],
                            ChatSettings.from_json(row["settings"]), row["created_at"],
                            row["updated_at"], row["n_interrupted"])

    def update_conversation(self, conversation_id: int, *, title: str | None = None,
                            system_prompt: str | None = None,
                            settings: ChatSettings | None = None) -> Conversation:
        """Change what is given; returns the conversation as stored."""
        old = self.conversation(conversation_id)
        new = replace(old, title=old.title if title is None else title,
                      system_prompt=old.system_prompt if system_prompt is None
                      else system_prompt,
                      settings=settings or old.settings)
        self.db.execute("UPDATE conversations SET title = ?, system_prompt = ?, settings = ?"
                        " WHERE id = ?",
                        (new.title, new.system_prompt, new.settings.to_json(), conversation_id))
        return new

    def delete_conversation(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _touch(self, conversation_id: int) -> None:
        self.db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?",
                        (time.time(), conversation_id))

    # --- messages --------------------------------------------------------------------
    def messages(self, conversation_id: int) -> list[Message]:
        rows = self.db.execute("SELECT * FROM messages WHERE conversation_id = ?"
                               " ORDER BY position", (conversation_id,)).fetchall()
        return [self._message(r) for r in rows]

    def message(self, message_id: int) -> Message:
        """Raises KeyError for an unknown id."""
        row = self.db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return self._message(row)

    @staticmethod
    def _message(row: sqlite3.Row) -> Message:
        return Message(row["id"], row["conversation_id"], row["position"], row["role"],
                       row["content"], row["status"], json.loads(row["info"] or "{}"))

    def add_message(self, conversation_id: int, role: str, content: str,
                    status: str = COMPLETE, info: dict | None = None) -> Message:
        """Append a message at the end of the conversation."""
        if status not in STATUSES:
            raise ValueError(f"unknown message status {status!r}")
        now = time.time()
        with self._transaction():
            row = self.db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM messages"
                                  " WHERE conversation_id = ?", (conversation_id,)).fetchone()
            position = row[0]
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, position, role, content, status, info,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, position, role, content, status, json.dumps(info or {}),
                 now, now))
            self._touch(conversation_id)
        return Message(cur.lastrowid, conversation_id, position, role, content, status,
                       dict(info or {}))

    def update_message(self, message_id: int, content: str, status: str,
                       info: dict | None = None) -> None:
        """Replace a message's content and status (one transaction). ``info`` None keeps
        what is stored."""
        if status not in STATUSES:
            raise ValueError(f"unknown message status {status!r}")
        with self._transaction():
            if info is None:
                self.db.execute("UPDATE messages SET content = ?, status = ?, updated_at = ?"
                                " WHERE id = ?", (content, status, time.time(), message_id))
            else:
                self.db.execute("UPDATE messages SET content = ?, status = ?, info = ?,"
                                " updated_at = ? WHERE id = ?",
                                (content, status, json.dumps(info), time.time(), message_id))
            row = self.db.execute("SELECT conversation_id FROM messages WHERE id = ?",
                                  (message_id,)).fetchone()
            if row is not None:
                self._touch(row[0])

    def truncate(self, conversation_id: int, position: int) -> None:
        """Delete the messages at ``position`` and after (regenerate, edit and resend)."""
        with self._transaction():
            self.db.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?",
                            (conversation_id, position))
            self._touch(conversation_id)

    # --- app settings ----------------------------------------------------------------
    def get_setting(self, key: str, default: object = None) -> object:
        row = self.db.execute("SELECT value FROM app_settings WHERE key = ?",
                              (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_setting(self, key: str, value: object) -> None:
        self.db.execute("INSERT INTO app_settings (key, value) VALUES (?, ?)"
                        " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                        (key, json.dumps(value)))

    def _transaction(self) -> _Transaction:
        return _Transaction(self.db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on an exception."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
