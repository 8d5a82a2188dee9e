"""Markdown to a QTextDocument, with code set apart (monospace on a tinted background).

The text is the model's (or a tool's, or a document's it quotes): Markdown, never HTML.
Raw HTML is shown as the characters it is (a model that writes a web page without a
fence shows the page's source, not a rendering of it that hides most of the answer), and
an image reference loads nothing (``![x](/dev/zero)`` would read for ever).
"""

from __future__ import annotations

from PySide6.QtCore import QUrl
from PySide6.QtGui import (
    QFont,
    QImage,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)

from app.gui import theme

MARKDOWN_FEATURES = QTextDocument.MarkdownFeature(
    QTextDocument.MarkdownFeature.MarkdownDialectGitHub.value
    | QTextDocument.MarkdownFeature.MarkdownNoHTML.value)


def _load_no_images(doc: QTextDocument) -> None:
    """Every image the text names gets an empty picture before the document is laid
    out, so it never loads one (no file, no device, no network)."""
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            if fmt.isImageFormat():
                doc.addResource(QTextDocument.ResourceType.ImageResource.value,
                                QUrl(fmt.toImageFormat().name()), QImage())
            it += 1
        block = block.next()


def _is_code_block(fmt: QTextBlockFormat, char_fmt: QTextCharFormat) -> bool:
    # Fenced blocks carry the fence property; indented ones only a monospace family.
    return (fmt.hasProperty(QTextFormat.Property.BlockCodeFence)
            or "monospace" in (char_fmt.fontFamilies() or []))


def render_markdown(doc: QTextDocument, text: str, base_font: QFont | None = None) -> None:
    """Replace ``doc``'s content with ``text`` read as Markdown (an unclosed fence while
    streaming simply renders as code up to the end)."""
    if base_font is not None:
        doc.setDefaultFont(base_font)
    doc.setMarkdown(text, MARKDOWN_FEATURES)
    _load_no_images(doc)
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
