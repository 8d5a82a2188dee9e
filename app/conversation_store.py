"""Conversations on disk: one SQLite file (WAL), no Qt.

Durability contract: every write is its own committed transaction, so whatever was
written survives the app being killed. An answer being generated is saved as it streams
with status ``streaming``; opening the store turns any ``streaming`` message left by a
process that died into ``interrupted``, which the app shows as such.

Messages form a tree (schema version 2): each has a parent (none for the first), and
editing a message or regenerating an answer starts a sibling instead of deleting what
was there. A conversation's ``current_leaf_id`` ends the branch on show; ``messages()``
is the path from the root to it. Databases of version 1 (a list per conversation) are
migrated on open, in one transaction: each message's parent is the one before it.

Version 3 adds attachments (documents sent with a message) and their searchable chunks;
``app.attachment_store`` has their tables and methods. Databases of version 1 or 2 are
migrated on open, in one transaction.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from app.attachment_store import ATTACHMENT_SCHEMA, AttachmentTables
from app.documents.reading import Document
from app.documents.records import Attachment as Attachment  # re-exported: the store's records
from app.documents.records import Passage as Passage
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

SCHEMA_VERSION = 3
_MESSAGES = """
CREATE TABLE {name} (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- ids never reused: views cache by id
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,  -- NULL: the first
    position INTEGER NOT NULL,  -- depth: 0 for the first message
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL,
    info TEXT NOT NULL DEFAULT '{{}}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
)"""
_ATTACHMENTS = ";\n".join(ATTACHMENT_SCHEMA)
_SCHEMA = f"""
BEGIN;
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{{}}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    current_leaf_id INTEGER  -- the branch on show ends here; NULL: no messages
);
{_MESSAGES.format(name="messages")};
CREATE INDEX messages_by_parent ON messages (conversation_id, parent_id);
CREATE TABLE IF NOT EXISTS app_settings (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
{_ATTACHMENTS};
PRAGMA user_version = {SCHEMA_VERSION};
COMMIT;
"""
# The path from the first message to the conversation's current leaf.
_PATH = """
WITH RECURSIVE path(id) AS (
    SELECT current_leaf_id FROM conversations WHERE id = ? AND current_leaf_id IS NOT NULL
    UNION ALL
    SELECT m.parent_id FROM messages m JOIN path ON m.id = path.id
    WHERE m.parent_id IS NOT NULL)
SELECT m.*,
    (SELECT COUNT(*) FROM messages s WHERE s.conversation_id = m.conversation_id
     AND s.parent_id IS m.parent_id) AS n_siblings,
    (SELECT COUNT(*) FROM messages s WHERE s.conversation_id = m.conversation_id
     AND s.parent_id IS m.parent_id AND s.id < m.id) AS sibling_index
FROM messages m JOIN path ON m.id = path.id ORDER BY m.position
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
    thinking: bool = True  # a thinking model thinks (where its template has a switch)
    answer_json: bool = False  # answers are JSON: an object, or matching ``json_schema``
    json_schema: str = ""  # a JSON schema's text (with answer_json)
    use_tools: bool = True  # offer the running tool servers' tools (Settings > Tools)
    tool_rounds: int = 6  # answers in a row that may call tools before one must answer
    tool_choice: str = "auto"  # "required": each answer calls a tool, up to tool_rounds

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
    parent_id: int | None = None
    sibling_index: int = 0  # among the versions at this place (edits, regenerations)
    n_siblings: int = 1


class ConversationStore(AttachmentTables):
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
        self._open_schema()
        self._db.execute("PRAGMA foreign_keys=ON")
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

    def schema_version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def _open_schema(self) -> None:
        """Create the tables, or migrate an older version's (foreign keys off meanwhile,
        as SQLite asks for a table rebuild; one transaction: a kill leaves the old one)."""
        db = self.db
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "messages" not in tables:
            db.executescript(_SCHEMA)
            return
        version = self.schema_version()
        if version >= SCHEMA_VERSION:
            return
        db.execute("PRAGMA foreign_keys=OFF")
        with self._transaction():
            if version < 2:
                self._migrate_to_2()
            for statement in ATTACHMENT_SCHEMA:  # version 3
                db.execute(statement)
            if db.execute("PRAGMA foreign_key_check").fetchall():
                raise sqlite3.IntegrityError("the migrated messages do not hold together")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _migrate_to_2(self) -> None:
        """Version 1 kept a list per conversation; version 2 a tree."""
        db = self.db
        db.execute("ALTER TABLE conversations ADD COLUMN current_leaf_id INTEGER")
        db.execute(_MESSAGES.format(name="messages_v2"))
        # Version 1 kept each conversation as a list: the parent is the message before.
        db.execute(
            "INSERT INTO messages_v2 (id, conversation_id, parent_id, position, role,"
            " content, status, info, created_at, updated_at)"
            " SELECT m.id, m.conversation_id, (SELECT p.id FROM messages p"
            "  WHERE p.conversation_id = m.conversation_id AND p.position < m.position"
            "  ORDER BY p.position DESC LIMIT 1), m.position, m.role, m.content,"
            " m.status, m.info, m.created_at, m.updated_at FROM messages m")
        db.execute("DROP TABLE messages")
        db.execute("ALTER TABLE messages_v2 RENAME TO messages")
        db.execute("CREATE INDEX messages_by_parent ON messages (conversation_id,"
                   " parent_id)")
        db.execute("UPDATE conversations SET current_leaf_id = (SELECT m.id FROM"
                   " messages m WHERE m.conversation_id = conversations.id"
                   " ORDER BY m.position DESC LIMIT 1)")

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
                         messages: list[tuple[str, str, str, dict]],
                         attachments: Sequence[Sequence[Document]] = ()) -> Conversation:
        """A conversation with its messages (role, content, status, info) and the
        documents attached to each (``attachments[i]`` for ``messages[i]``), in one
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
            parent = None
            for i, (role, content, status, info) in enumerate(messages):
                parent = self.db.execute(
                    "INSERT INTO messages (conversation_id, parent_id, position, role,"
                    " content, status, info, created_at, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (conversation_id, parent, i, role, content, status, json.dumps(info),
                     now, now)).lastrowid
                for document in attachments[i] if i < len(attachments) else ():
                    self._insert_attachment(conversation_id, document, parent)
            self._set_leaf(conversation_id, parent)
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
        """The branch on show, first message first, each with its place among its
        versions."""
        rows = self.db.execute(_PATH, (conversation_id,)).fetchall()
        return [self._message(r) for r in rows]

    def siblings(self, message_id: int) -> list[Message]:
        """The versions at a message's place (itself included), oldest first."""
        msg = self.message(message_id)
        rows = self.db.execute("SELECT * FROM messages WHERE conversation_id = ? AND"
                               " parent_id IS ? ORDER BY id",
                               (msg.conversation_id, msg.parent_id)).fetchall()
        return [self._message(r) for r in rows]

    def switch_to(self, message_id: int) -> None:
        """Show the branch through ``message_id``: below it, the newest version at each
        place. One statement: a kill leaves the old branch or the new one."""
        msg = self.message(message_id)
        leaf = self.db.execute(
            "WITH RECURSIVE down(id) AS (SELECT ? UNION ALL SELECT (SELECT MAX(c.id) FROM"
            " messages c WHERE c.parent_id = down.id) FROM down WHERE EXISTS (SELECT 1"
            " FROM messages c WHERE c.parent_id = down.id)) SELECT id FROM down"
            " ORDER BY (SELECT position FROM messages WHERE messages.id = down.id) DESC"
            " LIMIT 1", (message_id,)).fetchone()[0]
        self.db.execute("UPDATE conversations SET current_leaf_id = ?, updated_at = ?"
                        " WHERE id = ?", (leaf, time.time(), msg.conversation_id))

    def delete_branch(self, message_id: int) -> None:
        """Delete a version and everything after it; when it was on show, the chat shows
        the newest other version at that place, or ends before it."""
        msg = self.message(message_id)
        others = [m for m in self.siblings(message_id) if m.id != message_id]
        on_show = message_id in {m.id for m in self.messages(msg.conversation_id)}
        with self._transaction():
            self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))  # cascades
            if on_show:
                self._set_leaf(msg.conversation_id, msg.parent_id)
        if on_show and others:
            self.switch_to(others[-1].id)

    def _set_leaf(self, conversation_id: int, leaf: int | None) -> None:
        self.db.execute("UPDATE conversations SET current_leaf_id = ?, updated_at = ?"
                        " WHERE id = ?", (leaf, time.time(), conversation_id))

    def message(self, message_id: int) -> Message:
        """Raises KeyError for an unknown id."""
        row = self.db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return self._message(row)

    @staticmethod
    def _message(row: sqlite3.Row) -> Message:
        keys = row.keys()
        return Message(row["id"], row["conversation_id"], row["position"], row["role"],
                       row["content"], row["status"], json.loads(row["info"] or "{}"),
                       row["parent_id"],
                       row["sibling_index"] if "sibling_index" in keys else 0,
                       row["n_siblings"] if "n_siblings" in keys else 1)

    def add_message(self, conversation_id: int, role: str, content: str,
                    status: str = COMPLETE, info: dict | None = None) -> Message:
        """Append a message at the end of the branch on show (a new version at that
        place when the branch was cut back with ``branch_at``)."""
        if status not in STATUSES:
            raise ValueError(f"unknown message status {status!r}")
        now = time.time()
        with self._transaction():
            row = self.db.execute(
                "SELECT c.current_leaf_id, m.position FROM conversations c LEFT JOIN"
                " messages m ON m.id = c.current_leaf_id WHERE c.id = ?",
                (conversation_id,)).fetchone()
            if row is None:
                raise KeyError(f"no conversation {conversation_id}")
            parent = row[0]
            position = 0 if parent is None else row[1] + 1
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, parent_id, position, role, content,"
                " status, info, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, parent, position, role, content, status,
                 json.dumps(info or {}), now, now))
            self._set_leaf(conversation_id, cur.lastrowid)
            n = self.db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ? AND"
                                " parent_id IS ?", (conversation_id, parent)).fetchone()[0]
        return Message(cur.lastrowid, conversation_id, position, role, content, status,
                       dict(info or {}), parent, n - 1, n)

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

    def tool_call_records(self, conversation_id: int, from_position: int = 0) -> list[dict]:
        """The tool calls kept in the answers at ``from_position`` or below it that
        descend from the branch on show's message just above it (every version of what
        followed it, none of another branch's), oldest first (app.tools.turns: a
        regenerate replays them)."""
        path = self.messages(conversation_id)
        anchor = path[from_position - 1].id if 0 < from_position <= len(path) else None
        if from_position > len(path):
            return []
        rows = self.db.execute(
            "WITH RECURSIVE below(id) AS ("
            " SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ?"
            " UNION ALL SELECT m.id FROM messages m JOIN below ON m.parent_id = below.id)"
            " SELECT info FROM messages WHERE id IN below AND role = 'assistant'"
            " AND info LIKE '%\"tool_calls\"%' ORDER BY id",
            (conversation_id, anchor)).fetchall()
        found: list[dict] = []
        for (info,) in rows:
            calls = json.loads(info or "{}").get("tool_calls")
            found += [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) \
                else []
        return found

    def branch_at(self, conversation_id: int, position: int) -> None:
        """Cut the branch on show back to before ``position`` (regenerate, edit and
        resend): the next message added becomes a new version there, and what was
        there stays, one click away."""
        path = self.messages(conversation_id)[:max(0, position)]
        self._set_leaf(conversation_id, path[-1].id if path else None)

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
