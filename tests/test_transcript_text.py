"""The transcript shows the model's and tools' text as text (app.gui.markdown): HTML
outside code blocks literally, Markdown formatted, images loading nothing."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

from PySide6.QtCore import QUrl  # noqa: E402
from PySide6.QtGui import QImage, QTextDocument  # noqa: E402

from app.gui.markdown import render_markdown  # noqa: E402

PAGE = ("Here is your page:\n\n<!DOCTYPE html>\n<html>\n<head><style>body{display:none}"
        "</style></head>\n<body>\n<h1>Harbour</h1>\n<p>Ferries leave at nine.</p>\n"
        "<script>alert(1)</script>\n</body>\n</html>\n\nSave it as index.html.")


def test_html_in_an_answer_is_shown_as_its_source(qapp) -> None:  # noqa: ANN001
    doc = QTextDocument()
    render_markdown(doc, PAGE)
    shown = doc.toPlainText()
    for line in ("<!DOCTYPE html>", "<h1>Harbour</h1>", "<script>alert(1)</script>",
                 "Save it as index.html."):
        assert line in shown, shown
    inline = QTextDocument()
    render_markdown(inline, "Use <b>bold</b> and <span hidden>secret</span> **here**.")
    assert inline.toPlainText() == "Use <b>bold</b> and <span hidden>secret</span> here."


def test_markdown_still_formats(qapp) -> None:  # noqa: ANN001
    doc = QTextDocument()
    render_markdown(doc, "# Title\n\n- one\n- two\n\n```html\n<p>x</p>\n```\n")
    assert doc.toPlainText().splitlines()[0] == "Title"
    assert "<p>x</p>" in doc.toPlainText()
    assert "<h1" in doc.toHtml()  # the heading is a heading


def test_an_image_reference_loads_nothing(qapp, tmp_path: Path) -> None:  # noqa: ANN001
    picture = tmp_path / "p.png"
    image = QImage(8, 8, QImage.Format.Format_RGB32)
    image.fill(0xFF0000)
    assert image.save(str(picture))
    doc = QTextDocument()
    render_markdown(doc, f"See ![x]({picture.as_uri()}) and ![y]({picture})")
    doc.setTextWidth(400)
    doc.size()  # lays it out: a document loads its images here
    for url in (QUrl(picture.as_uri()), QUrl(str(picture))):
        loaded = doc.resource(QTextDocument.ResourceType.ImageResource.value, url)
        assert loaded is None or (isinstance(loaded, QImage) and loaded.isNull())
