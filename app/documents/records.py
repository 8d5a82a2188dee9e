"""What the conversation store keeps of a document: an Attachment, and the Passages of it
that search finds. Plain records (no SQL) so the context builder and the GUI share them.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.documents.reading import Document


@dataclass(frozen=True)
class Attachment:
    """A document attached to a conversation; ``message_id`` None while it waits for the
    message it goes with."""

    id: int
    conversation_id: int
    message_id: int | None
    name: str
    kind: str
    text: str
    pages: tuple[int, ...] = ()

    def document(self) -> Document:
        return Document(self.name, self.kind, self.text, self.pages)

    @property
    def n_chars(self) -> int:
        return len(self.text)


@dataclass(frozen=True)
class Passage:
    """A piece of an attachment given to the model; ``score`` higher is better."""

    attachment_id: int
    name: str
    page: int | None
    start: int  # offset in the attachment's text
    text: str
    score: float = 0.0

    def to_dict(self) -> dict:
        return {"attachment_id": self.attachment_id, "name": self.name, "page": self.page,
                "start": self.start, "text": self.text, "score": self.score}

    @classmethod
    def from_dict(cls, data: dict) -> Passage:
        """Raises ValueError when ``data`` is not what ``to_dict`` writes."""
        try:
            page = data.get("page")
            passage = cls(int(data["attachment_id"]), str(data["name"]),
                          None if page is None else int(page), int(data["start"]),
                          str(data["text"]), float(data.get("score", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a passage: {exc}") from None
        return passage
