"""Attachments in the conversations database: the documents and their searchable chunks.

``ConversationStore`` takes these methods from ``AttachmentTables``; the tables are part
of schema version 3 (``ATTACHMENT_SCHEMA``). An attachment belongs to a conversation and,
once its message is sent, to that message: deleting either deletes it. Its chunks live in
an FTS5 table, which foreign keys do not reach, so a trigger deletes them with it. A
chunk's rowid is ``attachment_id << 32 | index``: that trigger deletes a rowid range.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import AbstractContextManager

from app.documents.chunks import split_into_chunks
from app.documents.fts_query import match_expression
from app.documents.reading import Document
from app.documents.records import Attachment, Passage

_ROWID_SHIFT = 1 << 32  # chunks per attachment, at most

# One statement each: the migration runs them inside its own transaction.
ATTACHMENT_SCHEMA = (
    """CREATE TABLE attachments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    message_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,  -- NULL: not sent yet
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    text TEXT NOT NULL,
    pages TEXT NOT NULL DEFAULT '[]',  -- JSON: where each PDF page starts in text
    created_at REAL NOT NULL
)""",
    # Foreign keys' children indexed: cascades find them without a scan.
    "CREATE INDEX attachments_by_message ON attachments (message_id)",
    "CREATE INDEX attachments_by_conversation ON attachments (conversation_id)",
    """CREATE VIRTUAL TABLE attachment_chunks USING fts5(text, attachment_id UNINDEXED,
    conversation_id UNINDEXED, page UNINDEXED, start UNINDEXED,
    tokenize='unicode61 remove_diacritics 2')""",
    f"""CREATE TRIGGER attachments_drop_chunks AFTER DELETE ON attachments BEGIN
    DELETE FROM attachment_chunks WHERE rowid BETWEEN old.id * {_ROWID_SHIFT}
        AND old.id * {_ROWID_SHIFT} + {_ROWID_SHIFT - 1};
END""",
)


class AttachmentTables:
    """Attachment methods of ConversationStore (a mixin: it brings no state, and uses
    the store's ``db``, ``_transaction()`` and ``messages()``)."""

    db: sqlite3.Connection

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def messages(self, conversation_id: int) -> list:
        raise NotImplementedError

    def add_attachment(self, conversation_id: int, document: Document,
                       message_id: int | None = None) -> Attachment:
        """Store ``document`` and index its chunks, in one transaction. Raises KeyError
        for an unknown conversation."""
        with self._transaction():
            if self.db.execute("SELECT 1 FROM conversations WHERE id = ?",
                               (conversation_id,)).fetchone() is None:
                raise KeyError(f"no conversation {conversation_id}")
            return self._insert_attachment(conversation_id, document, message_id)

    def _insert_attachment(self, conversation_id: int, document: Document,
                           message_id: int | None) -> Attachment:
        """The writes of ``add_attachment``, inside the caller's transaction."""
        chunks = split_into_chunks(document)
        cur = self.db.execute(
            "INSERT INTO attachments (conversation_id, message_id, name, kind, text, pages,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (conversation_id, message_id, document.name, document.kind, document.text,
             json.dumps(list(document.pages)), time.time()))
        attachment_id = cur.lastrowid
        self.db.executemany(
            "INSERT INTO attachment_chunks (rowid, text, attachment_id, conversation_id,"
            " page, start) VALUES (?, ?, ?, ?, ?, ?)",
            [(attachment_id * _ROWID_SHIFT + c.index, c.text, attachment_id, conversation_id,
              c.page, c.start) for c in chunks])
        return Attachment(attachment_id, conversation_id, message_id, document.name,
                          document.kind, document.text, document.pages)

    def attach_to_message(self, attachment_ids: list[int], message_id: int) -> None:
        """Give pending attachments to the message they were sent with (attachments of
        another conversation are left alone). Raises KeyError for an unknown message."""
        row = self.db.execute("SELECT conversation_id FROM messages WHERE id = ?",
                              (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        self.db.execute(
            "UPDATE attachments SET message_id = ? WHERE conversation_id = ? AND id IN"
            " (SELECT value FROM json_each(?))",
            (message_id, row[0], json.dumps([int(i) for i in attachment_ids])))

    def copy_attachments(self, attachment_ids: list[int],
                         message_id: int | None) -> list[Attachment]:
        """Copies (text and chunks) given to ``message_id`` or pending (None), in the
        given order: an edited message keeps its documents while the old version keeps
        its own."""
        out = []
        with self._transaction():
            for old_id in attachment_ids:
                row = self.db.execute("SELECT * FROM attachments WHERE id = ?",
                                      (old_id,)).fetchone()
                if row is None:
                    raise KeyError(f"no attachment {old_id}")
                new_id = self.db.execute(
                    "INSERT INTO attachments (conversation_id, message_id, name, kind, text,"
                    " pages, created_at) SELECT conversation_id, ?, name, kind, text, pages,"
                    " ? FROM attachments WHERE id = ?",
                    (message_id, time.time(), old_id)).lastrowid
                self.db.execute(
                    "INSERT INTO attachment_chunks (rowid, text, attachment_id,"
                    " conversation_id, page, start) SELECT rowid - ? + ?, text, ?,"
                    " conversation_id, page, start FROM attachment_chunks"
                    " WHERE rowid BETWEEN ? AND ?",
                    (old_id * _ROWID_SHIFT, new_id * _ROWID_SHIFT, new_id,
                     old_id * _ROWID_SHIFT, old_id * _ROWID_SHIFT + _ROWID_SHIFT - 1))
                out.append(_attachment(self.db.execute(
                    "SELECT * FROM attachments WHERE id = ?", (new_id,)).fetchone()))
        return out

    def attachment(self, attachment_id: int) -> Attachment:
        """Raises KeyError for an unknown id."""
        row = self.db.execute("SELECT * FROM attachments WHERE id = ?",
                              (attachment_id,)).fetchone()
        if row is None:
            raise KeyError(f"no attachment {attachment_id}")
        return _attachment(row)

    def message_attachments(self, message_id: int) -> list[Attachment]:
        rows = self.db.execute("SELECT * FROM attachments WHERE message_id = ? ORDER BY id",
                               (message_id,)).fetchall()
        return [_attachment(r) for r in rows]

    def pending_attachments(self, conversation_id: int) -> list[Attachment]:
        """Attached to the conversation but not sent with a message yet."""
        rows = self.db.execute("SELECT * FROM attachments WHERE conversation_id = ? AND"
                               " message_id IS NULL ORDER BY id",
                               (conversation_id,)).fetchall()
        return [_attachment(r) for r in rows]

    def path_attachments(self, conversation_id: int) -> list[Attachment]:
        """Those of the messages on the branch on show, in message order, then by id."""
        ids = [m.id for m in self.messages(conversation_id)]
        rows = self.db.execute(
            "SELECT a.* FROM attachments a JOIN json_each(?) p ON a.message_id = p.value"
            " ORDER BY p.key, a.id", (json.dumps(ids),)).fetchall()
        return [_attachment(r) for r in rows]

    def delete_attachment(self, attachment_id: int) -> None:
        """Delete an attachment and its chunks (the trigger); unknown ids are ignored."""
        self.db.execute("DELETE FROM attachments WHERE id = ?", (attachment_id,))

    def search_passages(self, conversation_id: int, query: str, limit: int = 6,
                        attachment_ids: list[int] | None = None) -> list[Passage]:
        """The chunks that best match ``query`` (BM25, best first), among
        ``attachment_ids`` or else all the conversation's attachments. A query with no
        usable word gives the first chunks in document order. Never fails on user text."""
        if limit <= 0:
            return []
        where = "attachment_chunks.conversation_id = ?"
        args: list[object] = [conversation_id]
        if attachment_ids is not None:
            where += " AND attachment_chunks.attachment_id IN (SELECT value FROM json_each(?))"
            args.append(json.dumps([int(i) for i in attachment_ids]))
        # bm25() is lower for a better match: its negation is the score. A chunk's rowid
        # orders it after its attachment's earlier chunks: document order.
        score, order = "0.0", "attachment_chunks.rowid"
        expression = match_expression(query)
        if expression is not None:
            where = f"attachment_chunks MATCH ? AND {where}"
            args.insert(0, expression)
            score, order = "-bm25(attachment_chunks)", f"bm25(attachment_chunks), {order}"
        rows = self.db.execute(
            "SELECT attachment_chunks.attachment_id, a.name, page, start,"
            f" attachment_chunks.text, {score} FROM attachment_chunks JOIN attachments a"
            f" ON a.id = attachment_chunks.attachment_id WHERE {where} ORDER BY {order}"
            " LIMIT ?", (*args, limit)).fetchall()
        return [Passage(r[0], r[1], r[2], r[3], r[4], float(r[5])) for r in rows]


def _attachment(row: sqlite3.Row) -> Attachment:
    return Attachment(row["id"], row["conversation_id"], row["message_id"], row["name"],
                      row["kind"], row["text"], tuple(json.loads(row["pages"] or "[]")))
