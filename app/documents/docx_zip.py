"""A .docx is a zip: check what it declares before anything is decompressed, and hand
python-docx a copy holding only the parts that carry text.

Why: python-docx loads every part into memory, pictures included, so a 1.5 MB file with
one picture part of zeros (deflate packs zeros about 1000:1) took a reader 3 GB. Text
lives in the XML parts; pictures, fonts and embedded files go to python-docx empty and
are never decompressed. ``zipfile`` stops decompressing a member at the size the zip's
directory declares for it, so checking the declared sizes bounds what the XML parts
take.
"""

from __future__ import annotations

import io
import zipfile

from app.documents.errors import DocumentError, size_text

# A Word file has tens of parts; one with hundreds of pictures has hundreds.
MAX_MEMBERS = 5_000
# The XML parts read, together, as declared. 4 million characters (reading.MAX_CHARS) in
# WordprocessingML take about 40-60 MB; python-docx's trees take several times the XML.
MAX_XML_BYTES = 128 * 1024 * 1024
# Word's XML packs 5-20:1. Past this ratio a part over RATIO_FLOOR is a decompression bomb.
MAX_RATIO = 100
RATIO_FLOOR = 1024 * 1024


def is_text_part(member: str) -> bool:
    """The parts python-docx parses: XML and relationships (the rest it keeps as bytes)."""
    return member.lower().endswith((".xml", ".rels"))


def text_parts_copy(data: bytes, name: str) -> io.BytesIO:
    """A zip with the same members as ``data``'s, the non-XML ones empty; raises
    DocumentError when the declared sizes say it would take too much to read."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as source:
            members = source.infolist()
            check_declared(members, name)
            out = io.BytesIO()
            with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as copy:
                for info in members:
                    if info.is_dir():
                        continue
                    blob = source.read(info) if is_text_part(info.filename) else b""
                    copy.writestr(info.filename, blob)
    except DocumentError:
        raise
    except Exception:  # zipfile, zlib: a broken archive
        raise DocumentError(
            f"{name} is damaged and could not be read as a Word document: open it in Word,"
            " save a new copy, and attach that", name) from None
    out.seek(0)
    return out


def check_declared(members: list[zipfile.ZipInfo], name: str) -> None:
    """Refuse an archive whose directory declares too many parts, too much XML, or an
    XML part packed tighter than Word packs it."""
    if len(members) > MAX_MEMBERS:
        raise DocumentError(
            f"{name} holds {len(members):,} parts, more than the {MAX_MEMBERS:,} Tandem"
            " opens in a Word document: save it again in Word, or save it as text", name)
    xml = [m for m in members if is_text_part(m.filename)]
    total = sum(m.file_size for m in xml)
    if total > MAX_XML_BYTES:
        raise DocumentError(
            f"{name} declares {size_text(total)} of text parts, more than the"
            f" {size_text(MAX_XML_BYTES)} Tandem reads: attach a part of it, or save it as"
            " text", name)
    for m in xml:
        if m.file_size > RATIO_FLOOR and m.file_size > MAX_RATIO * max(1, m.compress_size):
            raise DocumentError(
                f"{name} is packed {m.file_size // max(1, m.compress_size):,} to 1 in"
                f" {m.filename}, far tighter than Word packs text: it looks built to"
                " exhaust memory, so Tandem does not open it", name)
