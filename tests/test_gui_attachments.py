"""Documents in a conversation, through the window: attaching (button, drop, paste), the
chips, sending a question with them on the real bundled model, the sources of its answer,
and what a restart finds. Offscreen; answers kept to a few tokens (2-core machines)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QGuiApplication  # noqa: E402
from PySide6.QtWidgets import QFileDialog  # noqa: E402

from app.conversation_store import ConversationStore  # noqa: E402
from app.documents.reading import DocumentError, read_document  # noqa: E402
from app.gui import document_turn  # noqa: E402
from app.gui.message_delegate import attachment_names  # noqa: E402
from app.gui.sources import SourcesDialog  # noqa: E402
from app.gui.transcript_model import SOURCES_ROLE  # noqa: E402
from tests.gui_helpers import (  # noqa: E402
    ANSWER_TIMEOUT_MS,
    open_window,
    select_row,
    send_and_wait,
)
from tests.pdf_files import make_pdf  # noqa: E402

NOTES = """# Harbour notes

The harbour of Port Ellery opens at six in the morning.
The ferry to the island leaves twice a day, at nine and at four.
The secret word of the harbour master is PELICAN.
"""


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    return tmp_path / "chat.sqlite3"


def ledger_pages() -> list[str]:
    """Six pages of filler; page 4 alone names the lighthouse keeper."""
    pages = [f"Section {i}. " + " ".join(
        f"The harbour ledger of section {i} counts barrels, ropes and nets, line {k}."
        for k in range(24)) for i in range(1, 7)]
    pages[3] += " The lighthouse keeper of Port Ellery is named Orlando Vance."
    return pages


def attach_with_button(qtbot, w, monkeypatch, path: Path) -> None:  # noqa: ANN001
    """The paper-clip button, its file dialog answered with ``path``."""
    monkeypatch.setattr(QFileDialog, "getOpenFileNames",
                        lambda *a, **k: ([str(path)], "Documents"))
    n = w.chat.attachments.n_documents
    w.chat.attach_button.click()
    qtbot.waitUntil(lambda: w.chat.attachments.n_documents == n + 1, timeout=30_000)


def drop_files(w, paths: list[Path]) -> None:  # noqa: ANN001
    """Files dragged from a file manager onto the chat (the handlers Qt calls: a synthetic
    drop event is not delivered without a drag in progress)."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    enter = QDragEnterEvent(QPoint(20, 20), Qt.DropAction.CopyAction, mime,
                            Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    w.chat.dragEnterEvent(enter)
    assert enter.isAccepted()
    drop = QDropEvent(QPointF(20, 20), Qt.DropAction.CopyAction, mime,
                      Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    w.chat.dropEvent(drop)


def test_a_markdown_file_goes_whole_and_stays_after_a_restart(qtbot, db: Path,
                                                            model_path: Path, tmp_path: Path,
                                                            monkeypatch) -> None:
    notes = tmp_path / "harbour.md"
    notes.write_text(NOTES)
    w = open_window(qtbot, db, model_path, max_tokens=8)
    attach_with_button(qtbot, w, monkeypatch, notes)
    chip = w.chat.attachments.chips[0]
    assert "harbour.md" in chip.label.text() and "Markdown" in chip.label.text()
    assert w.chat.attachments.isVisibleTo(w)

    outcome = send_and_wait(qtbot, w, "What is the secret word of the harbour master?")
    assert outcome.text and outcome.finish_reason in ("eos", "stop", "length")
    assert w.chat.attachments.n_documents == 0 and not w.controller.pending
    user, answer = w.store.messages(w.controller.current_id)
    assert user.content == "What is the secret word of the harbour master?"
    assert "The secret word of the harbour master is PELICAN." in user.info["model_text"]
    assert user.info["model_text"].endswith(user.content)
    assert user.info["whole"] is True
    assert attachment_names(w.transcript.messages[0]) == ["harbour.md"]
    sources = w.transcript.index(1).data(SOURCES_ROLE)
    assert sources.line() == "Sources: harbour.md (whole)"
    w.chat.transcript.viewport().grab()  # the chips and the sources line paint
    conv_id, user_id = w.controller.current_id, user.id

    # Edit and resend: the new version takes the document along, composed anew.
    select_row(w, 0)
    w.chat.edit_button.click()
    assert "Its document goes along." in w.chat.edit_banner.text()
    w.chat.composer.clear()
    send_and_wait(qtbot, w, "When does the ferry leave?")
    edited = w.store.messages(conv_id)[0]
    assert edited.id != user_id and edited.n_siblings == 2
    assert [a.name for a in w.store.message_attachments(edited.id)] == ["harbour.md"]
    assert "ferry to the island" in edited.info["model_text"]
    assert edited.info["model_text"].endswith("When does the ferry leave?")
    w.close()

    # A new store on the same file: both versions keep their documents.
    store = ConversationStore(db)
    try:
        for msg_id in (user_id, edited.id):
            [kept] = store.message_attachments(msg_id)
            assert kept.name == "harbour.md" and kept.text == NOTES
        assert store.message(user_id).info["model_text"] == user.info["model_text"]
    finally:
        store.close()


def test_a_long_pdf_gives_passages_and_the_dialog_shows_their_pages(
        qtbot, db: Path, model_path: Path, tmp_path: Path, monkeypatch) -> None:
    # A small budget: the six pages cannot go whole, and the prompt stays short to read.
    monkeypatch.setattr(document_turn, "TURN_SHARE", 0.25)
    pdf = make_pdf(tmp_path / "ledger.pdf", ledger_pages())
    w = open_window(qtbot, db, model_path, max_tokens=8)
    reading: list[list[str]] = []
    w.controller.reading_changed.connect(reading.append)
    drop_files(w, [pdf])
    qtbot.waitUntil(lambda: w.chat.attachments.n_documents == 1, timeout=30_000)
    assert reading[0] == ["ledger.pdf"] and reading[-1] == []  # the busy chip came and went
    assert "6 pages" in w.chat.attachments.chips[0].label.text()

    send_and_wait(qtbot, w, "What is the name of the lighthouse keeper?")
    user = w.store.messages(w.controller.current_id)[0]
    assert user.info["whole"] is False
    pages = [p["page"] for p in user.info["passages"]]
    assert 4 in pages
    assert "Orlando Vance" in user.info["model_text"]
    assert 'page="4"' in user.info["model_text"]
    sources = w.transcript.index(1).data(SOURCES_ROLE)
    assert "ledger.pdf" in sources.line() and "p.4" in sources.line()

    # A click on the answer's "Sources" line opens the passages.
    view = w.chat.transcript
    index = w.transcript.index(1)
    view.scrollTo(index)
    rect = view.message_delegate.sources_rect(view.visualRect(index),
                                              w.transcript.messages[1], sources, view.font())
    assert rect is not None
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton,
                     pos=rect.center().toPoint())
    dialogs = w.chat.findChildren(SourcesDialog)
    assert len(dialogs) == 1
    text = dialogs[0].browser.toPlainText()
    assert "ledger.pdf, page 4" in text and "Orlando Vance" in text

    # A follow-up without documents searches the PDF again for what it asks.
    send_and_wait(qtbot, w, "Which section mentions line 7 of the harbour ledger?")
    follow_up = w.store.messages(w.controller.current_id)[2]
    assert "attachments" not in follow_up.info and follow_up.info["passages"]
    assert "<passage document=\"ledger.pdf\"" in follow_up.info["model_text"]
    assert "ledger.pdf" in w.transcript.index(3).data(SOURCES_ROLE).line()


def test_pasting_a_long_text_attaches_it_and_a_chip_can_be_removed(qtbot, db: Path,
                                                                   model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=8)
    composer = w.chat.composer
    qtbot.keyClicks(composer, "Summarise this: ")
    clipboard = QGuiApplication.clipboard()
    clipboard.setText("\n".join(f"Log line {i}: all systems nominal." for i in range(40)))
    composer.paste()
    assert composer.toPlainText() == "Summarise this: "  # the paste is not in the box
    assert [d.name for d in w.controller.pending] == ["Pasted text, 40 lines"]
    assert "Log line 39" in w.controller.pending[0].text
    clipboard.setText("a short paste")
    composer.paste()
    assert composer.toPlainText() == "Summarise this: a short paste"
    assert len(w.controller.pending) == 1

    chip = w.chat.attachments.chips[0]
    assert chip.remove_button is not None
    chip.remove_button.click()
    assert w.controller.pending == [] and w.chat.attachments.n_documents == 0
    assert not w.chat.attachments.isVisibleTo(w)


def test_a_damaged_pdf_is_refused_with_its_reason_and_nothing_is_lost(
        qtbot, db: Path, model_path: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.7\n1 0 obj << /Type /Catalog /Pages 9 0 R >>\n"
                       b"\x00\xff garbage, no xref, no trailer")
    with pytest.raises(DocumentError) as expected:
        read_document(broken)
    good = tmp_path / "notes.txt"
    good.write_text("A note that reads fine.")
    w = open_window(qtbot, db, model_path, max_tokens=8)
    qtbot.keyClicks(w.chat.composer, "Compare these two files")
    with qtbot.waitSignal(w.controller.problem, timeout=30_000) as problem:
        drop_files(w, [good, broken])
    assert problem.args == [str(expected.value)]
    assert "broken.pdf" in problem.args[0]
    assert w.statusBar().currentMessage() == str(expected.value)
    assert w.chat.composer.toPlainText() == "Compare these two files"
    assert [d.name for d in w.controller.pending] == ["notes.txt"]  # the good one stays
    assert w.chat.send_button.isEnabled()


def test_send_waits_for_a_file_being_read(qtbot, db: Path, model_path: Path,
                                          tmp_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=8)
    w.controller.documents.read([make_pdf(tmp_path / "ledger.pdf", ledger_pages())])
    assert not w.chat.send_button.isEnabled()  # until the file is in
    assert any("reading" in c.label.text() for c in w.chat.attachments.chips)
    qtbot.waitUntil(lambda: w.chat.send_button.isEnabled(), timeout=ANSWER_TIMEOUT_MS)
    assert [d.name for d in w.controller.pending] == ["ledger.pdf"]


def test_the_reading_chips_x_stops_the_read_and_send_goes_on(qtbot, db: Path,
                                                             model_path: Path,
                                                             tmp_path: Path) -> None:
    slow = tmp_path / "deep.html"
    slow.write_text("<div>" * 200_000 + "deep")  # seconds of parsing
    w = open_window(qtbot, db, model_path, max_tokens=8)
    w.controller.attach_files([slow])
    [read] = w.controller.documents._jobs.values()
    assert read.process.started.wait(30)  # its child is parsing
    [chip] = w.chat.attachments.chips
    assert chip.remove_button is not None and "Stop reading" in chip.remove_button.toolTip()
    with qtbot.waitSignal(w.controller.problem) as said:
        chip.remove_button.click()
    assert said.args == ["Stopped reading deep.html: it is not attached."]
    assert w.controller.documents.reading == [] and w.chat.send_button.isEnabled()
    send_and_wait(qtbot, w, "Hello?")
    qtbot.waitUntil(lambda: read.process.process.returncode is not None, timeout=30_000)
    assert w.controller.pending == [] and w.chat.attachments.chips == []
    assert "attachments" not in w.store.messages(w.controller.current_id)[0].info


def test_documents_that_fit_a_larger_context_reload_the_model_with_it(
        qtbot, db: Path, model_path: Path, tmp_path: Path, monkeypatch) -> None:
    # A tenth of the context per turn: ~2,300 characters outgrow 4,096 tokens' budget but
    # fit 8,192's, the bundled model's trained length (a short prompt to read, 2 cores).
    monkeypatch.setattr(document_turn, "TURN_SHARE", 0.1)
    notes = tmp_path / "ferry.txt"
    notes.write_text(" ".join(f"Ferry timetable entry {i}: the boat calls at pier {i % 7}."
                              for i in range(44)) + " The captain is called Ada Marsh.")
    w = open_window(qtbot, db, model_path, max_tokens=8)
    assert (w.engine_info.n_ctx, w.engine_info.max_ctx) == (4096, 8192)
    raised: list[tuple[int, str]] = []
    w.controller.context_request.connect(lambda n, why: raised.append((n, why)))
    w.controller.attach_files([notes])
    qtbot.waitUntil(lambda: w.chat.attachments.n_documents == 1, timeout=30_000)
    send_and_wait(qtbot, w, "Who is the captain?")
    [(n_ctx, why)] = raised
    assert 4096 < n_ctx <= 8192
    assert why == f"Context raised to {n_ctx:,} tokens for the attached documents."
    assert w.engine_info.n_ctx == n_ctx
    user = w.store.messages(w.controller.current_id)[0]
    assert user.info["whole"] is True and "Ada Marsh" in user.info["model_text"]


def test_an_attached_source_file_is_sent_as_the_prediction(qtbot, db: Path, model_path: Path,
                                                          tmp_path: Path, monkeypatch) -> None:
    """Asking for an edit of an attached source file sends the file as the answer's
    prediction (the engine drafts the unchanged lines from it); a chat without one, or a
    question that asks for no edit, sends none."""
    code = tmp_path / "area.py"
    code.write_text("def area(width, height):\n    return width * height\n\n\n"
                    "def perimeter(width, height):\n    return 2 * (width + height)\n")
    w = open_window(qtbot, db, model_path, max_tokens=8)
    sent = []
    w.controller.generate_request.connect(lambda request: sent.append(request))
    send_and_wait(qtbot, w, "Say hello.")
    attach_with_button(qtbot, w, monkeypatch, code)
    outcome = send_and_wait(qtbot, w, "Rename area to surface in this file.")
    assert outcome.text
    assert sent[0].prediction == "" and sent[1].prediction == code.read_text()
    send_and_wait(qtbot, w, "What does this file compute?")
    assert sent[2].prediction == ""  # the file is still on the path, but no edit is asked
    w.close()
