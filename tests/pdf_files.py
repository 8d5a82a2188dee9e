"""Real PDF files for the tests, made with fpdf2: one page per text."""

from __future__ import annotations

from pathlib import Path


def make_pdf(path: Path, pages: list[str], font_size: int = 11, line_height: int = 6) -> Path:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=font_size)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, line_height, text)
    pdf.output(str(path))
    return path
