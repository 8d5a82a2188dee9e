"""Markdown to a QTextDocument, with code set apart (monospace on a tinted background)."""

from __future__ import annotations

from PySide6.QtGui import (
    QFont,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)

from app.gui import theme


def _is_code_block(fmt: QTextBlockFormat, char_fmt: QTextCharFormat) -> bool:
    # Fenced blocks carry the fence property; indented ones only a monospace family.
    return (fmt.hasProperty(QTextFormat.Property.BlockCodeFence)
            or "monospace" in (char_fmt.fontFamilies() or []))


def render_markdown(doc: QTextDocument, text: str, base_font: QFont | None = None) -> None:
    """Replace ``doc``'s content with ``text`` read as Markdown (an unclosed fence while
    streaming simply renders as code up to the end)."""
    if base_font is not None:
        doc.setDefaultFont(base_font)
    doc.setMarkdown(text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    mono = QFont("monospace")
    mono.setStyleHint(QFont.StyleHint.Monospace)
    cursor = QTextCursor(doc)
    block = doc.begin()
    while block.isValid():
        if _is_code_block(block.blockFormat(), block.charFormat()):
            fmt = block.blockFormat()
            fmt.setBackground(theme.color("code_background"))
            fmt.setLeftMargin(6)
            fmt.setRightMargin(6)
            cursor.setPosition(block.position())
            cursor.setBlockFormat(fmt)
            cursor.movePosition(QTextCursor.MoveOperation.EndOfBlock,
                                QTextCursor.MoveMode.KeepAnchor)
            char = QTextCharFormat()
            char.setFontFamilies([mono.family(), "monospace"])
            char.setFontFixedPitch(True)
            cursor.mergeCharFormat(char)
        else:
            _tint_inline_code(block, cursor)
        block = block.next()


def _tint_inline_code(block: object, cursor: QTextCursor) -> None:
    it = block.begin()  # type: ignore[attr-defined]
    while not it.atEnd():
        frag = it.fragment()
        fmt = frag.charFormat()
        if frag.isValid() and (fmt.fontFixedPitch() or "monospace" in (fmt.fontFamilies()
                                                                       or [])):
            cursor.setPosition(frag.position())
            cursor.setPosition(frag.position() + frag.length(),
                               QTextCursor.MoveMode.KeepAnchor)
            char = QTextCharFormat()
            char.setBackground(theme.color("inline_code_background"))
            cursor.mergeCharFormat(char)
        it += 1
