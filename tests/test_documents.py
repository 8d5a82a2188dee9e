"""Documents in a conversation (issue 65): real files read into text, bad ones refused with
a sentence naming the file, chunks, search over the store's FTS5 index, and the turn the
model reads. No model, no Qt."""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import pytest

from app.conversation_store import Attachment, ConversationStore, Passage
from app.documents import reading
from app.documents.chunks import split_into_chunks
from app.documents.context import compose_turn, tokens_wanted
from app.documents.fts_query import match_expression
from app.documents.reading import Document, DocumentError, document_from_text, read_document
from tests.pdf_files import make_pdf

TOPICS = ("The river Danube flows through Vienna.",
          "Photosynthesis turns sunlight into sugar in leaves.",
          "The compiler rejects unreachable code after a return.")


def _pdf(path: Path, pages: list[str]) -> Path:
    return make_pdf(path, pages, font_size=12, line_height=8)


def _three_page_pdf(tmp_path: Path) -> Path:
    return _pdf(tmp_path / "report.pdf",
                [f"Page {i + 1}. {topic} " + "Filler words about nothing much. " * 40
                 for i, topic in enumerate(TOPICS)])


def _count(text: str) -> int:
    return len(text) // 4


@pytest.fixture()
def store(tmp_path: Path):
    with ConversationStore(tmp_path / "chat.sqlite3") as s:
        yield s


# --- reading good files -------------------------------------------------------------
def test_a_pdf_keeps_its_pages(tmp_path: Path) -> None:
    doc = read_document(_three_page_pdf(tmp_path))
    assert (doc.name, doc.kind, len(doc.pages)) == ("report.pdf", "pdf", 3)
    assert doc.pages[0] == 0 and doc.n_chars == len(doc.text)
    for number, topic in enumerate(TOPICS, start=1):
        word = topic.split()[1]
        assert doc.page_at(doc.text.index(word)) == number
        assert doc.text[doc.pages[number - 1]:].startswith(f"Page {number}.")
    assert "\r" not in doc.text and "\x00" not in doc.text


def test_a_docx_gives_paragraphs_and_tables_in_order(tmp_path: Path) -> None:
    import docx

    d = docx.Document()
    d.add_heading("Quarterly figures", 1)
    d.add_paragraph("Sales rose in the north.")
    table = d.add_table(rows=2, cols=2)
    for (r, c), text in {(0, 0): "Region", (0, 1): "Sales", (1, 0): "North",
                         (1, 1): "120"}.items():
        table.cell(r, c).text = text
    d.add_paragraph("The end.")
    d.save(str(tmp_path / "q.docx"))
    doc = read_document(tmp_path / "q.docx")
    assert doc.kind == "docx" and doc.pages == () and doc.page_at(5) is None
    assert doc.text == ("Quarterly figures\n\nSales rose in the north.\n\n"
                        "Region | Sales\nNorth | 120\n\nThe end.")


def test_html_drops_scripts_styles_and_navigation(tmp_path: Path) -> None:
    (tmp_path / "page.html").write_text(
        "<html><head><title>Trip</title><style>p {color: red}</style></head><body>"
        "<nav>Home | About</nav><h1>Alps</h1><p>We walked <b>far</b> today.</p>"
        "<script>alert('x')</script><ul><li>boots</li><li>map</li></ul></body></html>",
        encoding="utf-8")
    doc = read_document(tmp_path / "page.html")
    assert doc.kind == "html"
    assert "alert" not in doc.text and "color" not in doc.text and "About" not in doc.text
    assert doc.text == "Trip\n\nAlps\n\nWe walked far today.\n\nboots\n\nmap"


@pytest.mark.parametrize(("name", "kind"), [
    ("notes.md", "markdown"), ("tool.py", "code"), ("Makefile", "code"),
    ("data.csv", "text"), ("what.unknownext", "text")])
def test_text_files_by_name(tmp_path: Path, name: str, kind: str) -> None:
    nul = "" if kind == "text" and name.endswith("ext") else "\x00"  # unknown: no NUL
    (tmp_path / name).write_bytes(f"# Title\r\nline two\r\n\r\ncafé{nul}\n".encode())
    doc = read_document(tmp_path / name)
    assert (doc.kind, doc.text) == (kind, "# Title\nline two\n\ncafé\n")


def test_bom_and_windows_1252_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"\xff\xfe" + "héllo".encode("utf-16-le"))
    assert read_document(tmp_path / "a.txt").text == "héllo"
    (tmp_path / "b.txt").write_bytes("naïve café".encode("cp1252"))
    assert read_document(tmp_path / "b.txt").text == "naïve café"
    (tmp_path / "c.weird").write_bytes("some text".encode("utf-8-sig"))
    assert read_document(tmp_path / "c.weird").text == "some text"


def test_pasted_text_is_a_document() -> None:
    doc = document_from_text("Pasted text", "a\r\nb\x00")
    assert (doc.kind, doc.text, doc.pages) == ("text", "a\nb", ())
    with pytest.raises(DocumentError, match="Pasted text"):
        document_from_text("Pasted text", " \n ")


# --- refusing bad files -------------------------------------------------------------
def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    from fpdf import FPDF
    from pypdf import PdfWriter

    good = _three_page_pdf(tmp_path).read_bytes()
    out: dict[str, tuple[Path, str]] = {}

    def add(key: str, name: str, data: bytes | None, says: str) -> None:
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
        out[key] = (path, says)

    add("corrupt pdf", "cut.pdf", good[:len(good) // 3], "damaged")
    writer = PdfWriter(clone_from=str(tmp_path / "report.pdf"))
    writer.encrypt("secret", algorithm="RC4-128")
    writer.write(str(tmp_path / "locked.pdf"))
    out["encrypted pdf"] = (tmp_path / "locked.pdf", "encrypted")
    scan = FPDF()
    scan.add_page()
    scan.rect(20, 20, 100, 60, style="F")
    scan.output(str(tmp_path / "scan.pdf"))
    out["no text layer"] = (tmp_path / "scan.pdf", "OCR")
    add("empty", "empty.txt", b"", "empty")
    add("blank", "blank.md", b"  \n\n\t\n", "no text")
    add("binary as text", "photo.txt", bytes(range(256)) * 8, "binary")
    add("binary unknown", "blob.bin", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 20, "binary")
    add("text as pdf", "fake.pdf", b"just some words, not a PDF at all\n", "not a PDF")
    add("text as docx", "fake.docx", b"plain text pretending\n", "not a Word document")
    add("old doc", "old.docx", b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\x00" * 200, ".docx")
    broken = tmp_path / "broken.docx"
    with zipfile.ZipFile(broken, "w") as z:
        z.writestr("hello.txt", "a zip, but not a Word document")
    out["zip not docx"] = (broken, "damaged")
    add("missing", "gone.txt", None, "not found")
    (tmp_path / "folder.txt").mkdir()
    out["folder"] = (tmp_path / "folder.txt", "folder")
    return out


def test_bad_files_are_refused_with_a_sentence_naming_them(tmp_path: Path) -> None:
    for key, (path, says) in _bad_files(tmp_path).items():
        with pytest.raises(DocumentError) as err:
            read_document(path)
        message = str(err.value)
        assert message.startswith(path.name), (key, message)
        assert says in message, (key, message)
        assert ":" in message and "\n" not in message and "Traceback" not in message


def test_a_pdf_locked_only_for_printing_opens_with_the_empty_password(tmp_path: Path) -> None:
    from pypdf import PdfWriter

    writer = PdfWriter(clone_from=str(_three_page_pdf(tmp_path)))
    writer.encrypt("", owner_password="owner", algorithm="RC4-128")
    writer.write(str(tmp_path / "restricted.pdf"))
    doc = read_document(tmp_path / "restricted.pdf")
    assert len(doc.pages) == 3 and "Danube" in doc.text


def test_too_large_says_the_size_and_the_limit(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "big.log").write_text("x" * 3000)
    monkeypatch.setattr(reading, "MAX_FILE_BYTES", 2048)
    with pytest.raises(DocumentError, match=r"^big\.log is 3 KB, more than the 2 KB"):
        read_document(tmp_path / "big.log")
    monkeypatch.setattr(reading, "MAX_FILE_BYTES", 1 << 20)
    monkeypatch.setattr(reading, "MAX_CHARS", 1000)
    with pytest.raises(DocumentError, match=r"3,000 characters .* the 1,000"):
        read_document(tmp_path / "big.log")


# --- chunks -------------------------------------------------------------------------
def test_chunks_cover_the_text_in_order_and_know_their_page(tmp_path: Path) -> None:
    doc = read_document(_three_page_pdf(tmp_path))
    chunks = split_into_chunks(doc, target_chars=300)
    assert len(chunks) > 3
    end = 0
    for i, chunk in enumerate(chunks):
        assert chunk.index == i and chunk.text and chunk.text == chunk.text.strip()
        assert len(chunk.text) <= 300 and chunk.start >= end
        assert doc.text[chunk.start:chunk.start + len(chunk.text)] == chunk.text
        assert not doc.text[end:chunk.start].strip()  # nothing but blanks skipped
        assert chunk.page == doc.page_at(chunk.start)
        end = chunk.start + len(chunk.text)
    assert not doc.text[end:].strip()
    assert {c.page for c in chunks} == {1, 2, 3}
    for chunk in chunks:  # none runs over a page's end
        assert chunk.start + len(chunk.text) <= ([*doc.pages, doc.n_chars])[chunk.page]
    whole = split_into_chunks(doc, target_chars=100_000)
    assert [c.page for c in whole] == [1, 2, 3]


def test_chunks_cut_at_paragraphs_first_and_anywhere_last() -> None:
    text = "First para line.\nSecond line.\n\nSecond para. Two sentences.\n\n" + "y" * 50
    got = [c.text for c in split_into_chunks(Document("t", "text", text), target_chars=30)]
    assert got == ["First para line.\nSecond line.", "Second para. Two sentences.",
                   "y" * 30, "y" * 20]
    rng = random.Random(7)
    pieces = ["word", "end.", "\n", "\n\n", " ", "é", "z" * 40]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 120)))
        target = rng.choice([1, 7, 50, 1200])
        chunks = split_into_chunks(Document("r", "text", text), target)
        assert all(c.text and len(c.text) <= target for c in chunks)
        assert "".join("".join(c.text.split()) for c in chunks) == "".join(text.split())


# --- the store ----------------------------------------------------------------------
def test_search_finds_the_page_a_passage_is_on(store: ConversationStore,
                                               tmp_path: Path) -> None:
    conv = store.create_conversation()
    att = store.add_attachment(conv.id, read_document(_three_page_pdf(tmp_path)))
    assert isinstance(att, Attachment) and att.message_id is None and len(att.pages) == 3
    assert store.pending_attachments(conv.id) == [att]
    for number, topic in enumerate(TOPICS, start=1):
        best = store.search_passages(conv.id, f"What does it say about {topic.split()[1]}?")
        assert best and best[0].page == number and best[0].name == "report.pdf"
        assert best[0].score > 0 and topic.split()[1] in best[0].text
    # Diacritics and case fold as in the index.
    other = store.add_attachment(conv.id, Document("fr.txt", "text", "Le café est fermé."))
    assert store.search_passages(conv.id, "CAFE ferme")[0].attachment_id == other.id
    only = store.search_passages(conv.id, "Danube", attachment_ids=[other.id])
    assert only == []


@pytest.mark.parametrize("query", [
    '"', '""', "AND", "NOT", "OR", "NEAR(", "NEAR(a b", "*", "a*", "^start", "text:x",
    "(((", ")", "😀", "🎉 Danube 🎉", "-", "'; DROP TABLE attachments; --", "\x00", "",
    "the of a", "Danube AND NOT", "Dänube", "中文", "x" * 5000])
def test_hostile_queries_never_raise(store: ConversationStore, query: str) -> None:
    conv = store.create_conversation()
    store.add_attachment(conv.id, Document("t.txt", "text", "\n\n".join(TOPICS * 5)))
    got = store.search_passages(conv.id, query, limit=3)
    assert isinstance(got, list) and len(got) <= 3
    assert all(isinstance(p, Passage) for p in got)
    if match_expression(query) is None:  # no usable word: the first chunks, in order
        assert got and got[0].start == 0
    assert store.db.execute("SELECT COUNT(*) FROM attachments").fetchone()[0] == 1


def test_attachments_follow_messages_and_the_branch_on_show(store: ConversationStore) -> None:
    conv = store.create_conversation()
    q1 = store.add_message(conv.id, "user", "read this")
    a = store.add_attachment(conv.id, Document("a.txt", "text", "alpha " * 400))
    b = store.add_attachment(conv.id, Document("b.txt", "text", "beta " * 400))
    store.attach_to_message([b.id, a.id], q1.id)
    store.add_message(conv.id, "assistant", "ok")
    q2 = store.add_message(conv.id, "user", "and this")
    c = store.add_attachment(conv.id, Document("c.md", "markdown", "gamma"), q2.id)
    assert [x.name for x in store.message_attachments(q1.id)] == ["a.txt", "b.txt"]
    assert [x.id for x in store.path_attachments(conv.id)] == [a.id, b.id, c.id]
    # An edited second question is a sibling: the branch on show loses c.txt.
    store.branch_at(conv.id, 2)
    q2b = store.add_message(conv.id, "user", "instead")
    assert [x.id for x in store.path_attachments(conv.id)] == [a.id, b.id]
    (copy,) = store.copy_attachments([c.id], q2b.id)
    assert copy.id != c.id and copy.text == "gamma"
    assert store.search_passages(conv.id, "gamma", attachment_ids=[copy.id])[0].text == "gamma"
    n_chunks = _chunks(store)
    # Deleting the first version of question 2 deletes its attachment and chunks only.
    store.delete_branch(q2.id)
    assert _chunks(store) == n_chunks - 1
    assert [x.id for x in store.path_attachments(conv.id)] == [a.id, b.id, copy.id]
    # A pending attachment stays until it is attached or deleted.
    pending = store.add_attachment(conv.id, Document("p.txt", "text", "pending words"))
    store.delete_branch(q1.id)
    assert store.pending_attachments(conv.id) == [pending] and _chunks(store) == 1
    store.delete_attachment(pending.id)
    assert _chunks(store) == 0 and store.pending_attachments(conv.id) == []
    with pytest.raises(KeyError):
        store.attachment(pending.id)


def test_deleting_a_conversation_deletes_its_attachments(store: ConversationStore) -> None:
    keep, drop = store.create_conversation("keep"), store.create_conversation("drop")
    for conv in (keep, drop):
        m = store.add_message(conv.id, "user", "hi")
        store.add_attachment(conv.id, Document("x.txt", "text", "\n\n".join(TOPICS)), m.id)
        store.add_attachment(conv.id, Document("y.txt", "text", "pending"))
    before = _chunks(store)
    store.delete_conversation(drop.id)
    assert _chunks(store) == before // 2
    assert store.db.execute("SELECT COUNT(*) FROM attachments").fetchone()[0] == 2
    assert store.search_passages(drop.id, "Danube") == []
    assert store.search_passages(keep.id, "Danube")[0].name == "x.txt"


def test_attachments_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    with ConversationStore(path) as store:
        conv = store.create_conversation()
        m = store.add_message(conv.id, "user", "see the report")
        att = store.add_attachment(conv.id, read_document(_three_page_pdf(tmp_path)), m.id)
    with ConversationStore(path) as store:
        assert store.path_attachments(conv.id) == [att]
        assert store.attachment(att.id).document() == read_document(tmp_path / "report.pdf")
        assert store.search_passages(conv.id, "photosynthesis")[0].page == 2


def _chunks(store: ConversationStore) -> int:
    return store.db.execute("SELECT COUNT(*) FROM attachment_chunks").fetchone()[0]


# --- the turn the model reads -------------------------------------------------------
def test_passages_go_to_a_message_info_and_back() -> None:
    p = Passage(3, "r.pdf", 2, 140, "some text", 1.5)
    assert Passage.from_dict(p.to_dict()) == p
    assert Passage.from_dict({**p.to_dict(), "page": None}).page is None
    with pytest.raises(ValueError, match="not a passage"):
        Passage.from_dict({"name": "x"})


def test_no_attachments_leaves_the_question_alone() -> None:
    turn = compose_turn("hi?", [], 10, _count, lambda q, n: [])
    assert (turn.text, turn.passages, turn.whole) == ("hi?", (), True)
    assert tokens_wanted([], _count) == 0


def test_documents_that_fit_go_whole_with_page_marks(store: ConversationStore,
                                                     tmp_path: Path) -> None:
    conv = store.create_conversation()
    pdf = store.add_attachment(conv.id, read_document(_three_page_pdf(tmp_path)))
    note = store.add_attachment(conv.id, Document("note.md", "markdown", "# Note\nshort"))
    atts = [pdf, note]
    wanted = tokens_wanted(atts, _count)
    assert wanted >= (pdf.n_chars + note.n_chars) // 4

    def search(q: str, n: int) -> list[Passage]:
        return store.search_passages(conv.id, q, n)

    turn = compose_turn("Where is Vienna?", atts, wanted + 50, _count, search)
    assert turn.whole and turn.text.endswith("\n\nWhere is Vienna?")
    assert turn.text.startswith('<document name="report.pdf">\n[page 1]\nPage 1.')
    assert "\n\n[page 2]\nPage 2." in turn.text and "\n\n[page 3]\nPage 3." in turn.text
    assert '<document name="note.md">\n# Note\nshort\n</document>' in turn.text
    assert [(p.attachment_id, p.page, p.start) for p in turn.passages] == [
        (pdf.id, 1, 0), (note.id, None, 0)]
    assert turn.passages[0].text == pdf.text[:300]
    assert compose_turn("Where is Vienna?", atts, wanted + 50, _count, search) == turn


def test_documents_too_long_give_the_best_passages_in_document_order(
        store: ConversationStore, tmp_path: Path) -> None:
    conv = store.create_conversation()
    pdf = store.add_attachment(conv.id, read_document(_three_page_pdf(tmp_path)))
    note = store.add_attachment(conv.id, Document("note.txt", "text",
                                                  "Vienna has a river. " * 3))
    calls: list[tuple[str, int]] = []

    def search(q: str, n: int) -> list[Passage]:
        calls.append((q, n))
        return store.search_passages(conv.id, q, n)

    question = "Which river flows through Vienna, and what about sunlight?"
    budget = 400
    assert tokens_wanted([pdf, note], _count) > budget
    turn = compose_turn(question, [pdf, note], budget, _count, search)
    assert not turn.whole and calls[0][0] == question
    assert _count(turn.text) <= budget and turn.text.endswith("\n\n" + question)
    assert turn.passages, "something fits"
    found = search(question, 32)
    assert turn.passages[0] in found and found[0] in turn.passages  # the best is given
    order = [(0 if p.attachment_id == pdf.id else 1, p.start) for p in turn.passages]
    assert order == sorted(order)
    for p in turn.passages:
        header = (f'<passage document="{p.name}"'
                  + ("" if p.page is None else f' page="{p.page}"') + ">")
        assert f"{header}\n{p.text}\n</passage>" in turn.text
    assert compose_turn(question, [pdf, note], budget, _count, search) == turn
    # Nothing matches: the documents' start, rather than nothing.
    turn = compose_turn("zzzz qqqq", [pdf, note], budget, _count, search)
    assert turn.passages and turn.passages[0].start == 0 and not turn.whole
    # A budget too small for any passage leaves the question alone.
    turn = compose_turn(question, [pdf, note], _count(question) + 5, _count, search)
    assert (turn.passages, turn.text) == ((), question)
