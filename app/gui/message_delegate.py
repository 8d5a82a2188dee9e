"""Paints one message as a card: who, its status, its Markdown body, its speed line."""

from __future__ import annotations

from collections import OrderedDict

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QRect, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPalette, QTextDocument
from PySide6.QtWidgets import QStyle, QStyledItemDelegate, QStyleOptionViewItem, QWidget

from app.conversation_store import FAILED, INTERRUPTED, STOPPED, STREAMING, Message
from app.gui import theme
from app.gui.markdown import render_markdown
from app.gui.paper_clip import paper_clip_pixmap
from app.gui.sources import Sources
from app.gui.transcript_model import MESSAGE_ROLE, OUT_OF_CONTEXT_ROLE, SOURCES_ROLE
from app.tools.turns import calls_of, describe_call
from engine.runtime.reasoning import split_reasoning

_Index = QModelIndex | QPersistentModelIndex

MARGIN_X, MARGIN_Y, PAD = 10, 5, 10
CHIP_PAD = 6  # around a chip's text (a document under a user message)
USER_INDENT = 0.18  # user cards leave this share of the width free on their left
STATUS_TEXT = {
    STREAMING: ("generating…", QColor("#4a86e8")),
    INTERRUPTED: ("⚠ interrupted: Tandem closed before this answer finished",
                  QColor("#b26b00")),
    STOPPED: ("■ stopped", None),
    FAILED: ("✖ failed", QColor("#c62828")),
}


def status_line(msg: Message) -> tuple[str, QColor] | None:
    """The badge shown beside the author, or None for a finished message."""
    found = STATUS_TEXT.get(msg.status)
    if found is None:
        return None
    text, color = found
    color = color or theme.color("muted")
    if msg.status == FAILED and msg.info.get("error"):
        text = f"{text}: {msg.info['error']}"
    return text, color


def attachment_names(msg: Message) -> list[str]:
    """The documents a user message brought (shown as chips under it)."""
    if msg.role != "user":
        return []
    found = msg.info.get("attachments")
    return [str(a.get("name", "")) for a in found if isinstance(a, dict)] \
        if isinstance(found, list) else []


def _small(font: QFont) -> QFont:
    small = QFont(font)
    small.setPointSizeF(max(6.0, font.pointSizeF() * 0.9))
    return small


class MessageDelegate(QStyledItemDelegate):
    """Renders ``MESSAGE_ROLE`` rows. The view tells it its width (``set_width``) since
    word-wrapped height depends on it; documents are cached per message and width."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.width = 600
        # A base model continues the user's text instead of answering it.
        self.model_author = "Tandem"
        self._docs: OrderedDict[int, tuple[str, int, QTextDocument]] = OrderedDict()
        self.expanded: set[int] = set()  # answers whose reasoning section is shown

    def toggle_reasoning(self, message_id: int) -> None:
        self.expanded ^= {message_id}
        self._docs.pop(message_id, None)

    def shown_text(self, msg: Message) -> str:
        """The Markdown a message shows: a thinking model's reasoning folds to one line
        (a click on it unfolds it); an answer's tool calls follow as cards."""
        text = self._answer_text(msg)
        calls = calls_of(msg.info) if msg.role == "assistant" else []
        if not calls:
            return text
        cards = "\n\n---\n\n".join(describe_call(c) for c in calls)
        return f"{text}\n\n{cards}" if text.strip() else cards

    def _answer_text(self, msg: Message) -> str:
        if msg.role != "assistant":
            return msg.content
        parts = split_reasoning(msg.content)
        if not parts.has_section:
            return msg.content
        words = len(parts.reasoning.split())
        if msg.id in self.expanded:
            quoted = "\n".join(f"> {line}" for line in parts.reasoning.splitlines())
            head = f"▾ *Reasoning ({words} words), click to fold*\n\n{quoted}"
        elif parts.open:
            head = f"▸ *Thinking… ({words} words so far, click to show)*"
        else:
            head = f"▸ *Reasoning ({words} words), click to show*"
        return f"{head}\n\n{parts.answer}" if parts.answer else head

    def reasoning_rect(self, rect: QRect, msg: Message, font: QFont) -> QRectF | None:
        """The fold line of a reasoning section (where a click folds or unfolds it)."""
        if msg.role != "assistant" or not split_reasoning(msg.content).has_section:
            return None
        card = self._card(rect, msg)
        fm = QFontMetrics(font)
        return QRectF(card.x() + PAD, card.y() + PAD + fm.height() + 4, card.width() - 2 * PAD,
                      fm.height() + 4)

    def set_width(self, width: int) -> None:
        self.width = max(200, width)

    def _card_width(self, msg: Message) -> int:
        full = self.width - 2 * MARGIN_X
        return int(full * (1 - USER_INDENT)) if msg.role == "user" else full

    def _doc(self, msg: Message, font: QFont) -> QTextDocument:
        text_width = self._card_width(msg) - 2 * PAD
        cached = self._docs.get(msg.id)
        shown = self.shown_text(msg)
        if cached and cached[0] == shown and cached[1] == text_width:
            self._docs.move_to_end(msg.id)
            return cached[2]
        doc = cached[2] if cached else QTextDocument()
        render_markdown(doc, shown or " ", font)
        doc.setDocumentMargin(0)
        doc.setTextWidth(text_width)
        self._docs[msg.id] = (shown, text_width, doc)
        self._docs.move_to_end(msg.id)
        while len(self._docs) > 300:
            self._docs.popitem(last=False)
        return doc

    @staticmethod
    def _footer_height(text: str, font: QFont, card_width: int) -> int:
        rect = QFontMetrics(_small(font)).boundingRect(
            QRect(0, 0, card_width - 2 * PAD, 10_000), Qt.TextFlag.TextWordWrap, text)
        return rect.height()

    @staticmethod
    def _footer(msg: Message) -> str:
        return str(msg.info.get("summary", "")) if msg.role == "assistant" else ""

    def sizeHint(self, option: QStyleOptionViewItem, index: _Index) -> QSize:
        msg: Message | None = index.data(MESSAGE_ROLE)
        if msg is None:
            return QSize(self.width, 20)
        fm = QFontMetrics(option.font)
        h = PAD + fm.height() + 4 + int(self._doc(msg, option.font).size().height()) + PAD
        h += self._extra_height(msg, index.data(SOURCES_ROLE), option.font)
        footer = self._footer(msg)
        if footer:
            h += self._footer_height(footer, option.font, self._card_width(msg)) + 4
        return QSize(self.width, h + 2 * MARGIN_Y)

    @staticmethod
    def _extra_height(msg: Message, sources: Sources | None, font: QFont) -> int:
        """The line under the text: a user message's document chips, an answer's
        sources."""
        if not attachment_names(msg) and sources is None:
            return 0
        return QFontMetrics(_small(font)).height() + CHIP_PAD + 4

    def _extra_top(self, rect: QRect, msg: Message, font: QFont) -> float:
        card = self._card(rect, msg)
        return (card.y() + PAD + QFontMetrics(font).height() + 4
                + self._doc(msg, font).size().height() + 4)

    def sources_rect(self, rect: QRect, msg: Message, sources: Sources | None,
                     font: QFont) -> QRectF | None:
        """Where an answer's "Sources: …" line sits (a click opens the passages)."""
        if sources is None:
            return None
        card = self._card(rect, msg)
        small = QFontMetrics(_small(font))
        width = min(small.horizontalAdvance(sources.line()) + 4, card.width() - 2 * PAD)
        return QRectF(card.x() + PAD, self._extra_top(rect, msg, font), width,
                      small.height() + CHIP_PAD)

    def _paint_chips(self, painter: QPainter, card: QRectF, y: float, names: list[str],
                     font: QFont) -> None:
        colors = theme.current()
        small = _small(font)
        fm = QFontMetrics(small)
        painter.setFont(small)
        x, right = card.x() + PAD, card.right() - PAD
        clip = paper_clip_pixmap(QColor(colors.muted), fm.height())
        for i, name in enumerate(names):
            text, icon = name, fm.height()
            w = icon + fm.horizontalAdvance(text) + 2 * CHIP_PAD
            if x + w > right:  # no room: the rest as "+N"
                text, icon = f"+{len(names) - i}", 0
                w = fm.horizontalAdvance(text) + 2 * CHIP_PAD
                if x + w > right:
                    break
            chip = QRectF(x, y, w, fm.height() + CHIP_PAD)
            painter.setPen(QColor(colors.border))
            painter.setBrush(QColor(colors.bot_card))
            painter.drawRoundedRect(chip, 6, 6)
            if icon:
                painter.drawPixmap(int(x + CHIP_PAD / 2), int(y + CHIP_PAD / 2), clip)
            painter.setPen(QColor(colors.muted))
            painter.drawText(chip.adjusted(icon, 0, 0, 0), Qt.AlignmentFlag.AlignCenter, text)
            x += w + 6
            if not icon:
                break

    def _card(self, rect: QRect, msg: Message) -> QRectF:
        w = self._card_width(msg)
        x = rect.x() + MARGIN_X + (self.width - 2 * MARGIN_X - w if msg.role == "user" else 0)
        return QRectF(x, rect.y() + MARGIN_Y, w, rect.height() - 2 * MARGIN_Y)

    def version_rects(self, rect: QRect, msg: Message, font: QFont
                      ) -> tuple[QRectF, QRectF, QRectF] | None:
        """Where "‹ 2/3 ›" sits in the card's header (previous, label, next), or None
        for a message with a single version."""
        if msg.n_siblings <= 1:
            return None
        fm = QFontMetrics(font)
        card = self._card(rect, msg)
        label = f"{msg.sibling_index + 1}/{msg.n_siblings}"
        arrow_w, label_w = fm.horizontalAdvance("‹") + 12, fm.horizontalAdvance(label) + 8
        y, h = card.y() + PAD, fm.height()
        right = card.right() - PAD
        nxt = QRectF(right - arrow_w, y, arrow_w, h)
        mid = QRectF(nxt.x() - label_w, y, label_w, h)
        prev = QRectF(mid.x() - arrow_w, y, arrow_w, h)
        return prev, mid, nxt

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: _Index) -> None:
        msg: Message | None = index.data(MESSAGE_ROLE)
        if msg is None:
            return
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        out_of_context = bool(index.data(OUT_OF_CONTEXT_ROLE))
        if out_of_context:  # still in the conversation, no longer in the model's context
            painter.setOpacity(0.45)
        r = option.rect
        w = self._card_width(msg)
        x = r.x() + MARGIN_X + (self.width - 2 * MARGIN_X - w if msg.role == "user" else 0)
        card = QRectF(x, r.y() + MARGIN_Y, w, r.height() - 2 * MARGIN_Y)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        colors = theme.current()
        painter.setPen(QColor(colors.accent if selected else colors.border))
        painter.setBrush(QColor(colors.user_card if msg.role == "user" else colors.bot_card))
        painter.drawRoundedRect(card, 8, 8)

        fm = QFontMetrics(option.font)
        bold = QFont(option.font)
        bold.setBold(True)
        text_color = option.palette.color(QPalette.ColorRole.Text)
        painter.setFont(bold)
        painter.setPen(text_color)
        y = card.y() + PAD
        author = "You" if msg.role == "user" else self.model_author
        painter.drawText(QRectF(card.x() + PAD, y, w - 2 * PAD, fm.height()),
                         Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, author)
        badge = status_line(msg)
        if badge is None and out_of_context:
            badge = ("left out of the context to fit it", QColor(colors.muted))
        if badge:
            painter.setFont(option.font)
            painter.setPen(badge[1])
            left = card.x() + PAD + QFontMetrics(bold).horizontalAdvance(author) + 10
            room = card.right() - PAD - left
            painter.drawText(QRectF(left, y, room, fm.height()),
                             Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                             fm.elidedText(badge[0], Qt.TextElideMode.ElideRight, int(room)))
        versions = self.version_rects(r, msg, option.font)
        if versions:
            prev, mid, nxt = versions
            painter.setFont(option.font)
            first, last = msg.sibling_index == 0, msg.sibling_index == msg.n_siblings - 1
            for rect, text, off in ((prev, "‹", first), (nxt, "›", last)):
                painter.setPen(QColor(colors.dimmed if off else colors.accent))
                painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, text)
            painter.setPen(QColor(colors.muted))
            painter.drawText(mid, Qt.AlignmentFlag.AlignCenter,
                             f"{msg.sibling_index + 1}/{msg.n_siblings}")
        y += fm.height() + 4

        doc = self._doc(msg, option.font)
        painter.translate(card.x() + PAD, y)
        doc.drawContents(painter)
        painter.translate(-(card.x() + PAD), -y)
        y += doc.size().height()

        names = attachment_names(msg)
        sources: Sources | None = index.data(SOURCES_ROLE)
        if names:
            self._paint_chips(painter, card, y + 4, names, option.font)
        elif sources is not None:
            small = _small(option.font)
            painter.setFont(small)
            painter.setPen(QColor(colors.accent))
            where = self.sources_rect(r, msg, sources, option.font)
            assert where is not None
            painter.drawText(where, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                             QFontMetrics(small).elidedText(sources.line(),
                                                            Qt.TextElideMode.ElideRight,
                                                            int(where.width())))
        y += self._extra_height(msg, sources, option.font)

        footer = self._footer(msg)
        if footer:
            small = _small(option.font)
            painter.setFont(small)
            painter.setPen(QColor(colors.muted))
            height = self._footer_height(footer, option.font, w)
            painter.drawText(QRectF(card.x() + PAD, y + 4, w - 2 * PAD, height),
                             Qt.AlignmentFlag.AlignLeft | Qt.TextFlag.TextWordWrap, footer)
        painter.restore()
