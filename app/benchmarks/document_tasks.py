"""The work people bring, as bench prompts: questions, extractions and summaries over
documents of 1-8k tokens, and edits of 200-600-line source files sent with the file as
OpenAI's ``prediction``.

Every document is a file each machine has or this repository holds: the Python standard
library's sources and licence, and the project's docs. Documents reach the model as the
window gives an attached file (``app.documents.context.compose_turn``, whole), so the bench
times the prompts users send. The set is fixed by the files: nothing is chosen per run.
"""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.documents.context import compose_turn
from app.documents.records import Attachment
from training.spec_bench import BenchPrompt

_REPO = Path(__file__).resolve().parents[2]
_STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Documents cut to about these many tokens (at a paragraph's end), so sizes span 1-8k.
DOCUMENT_TOKENS = (1000, 3000, 7000)


@dataclass(frozen=True)
class Source:
    name: str
    path: Path
    kind: str  # "markdown", "text" or "code"


def document_sources() -> list[Source]:
    """The documents asked about, those present on this machine."""
    found = [Source("engine.md", _REPO / "docs" / "engine.md", "markdown"),
             Source("LICENSE.txt", _STDLIB / "LICENSE.txt", "text"),
             Source("packaging.md", _REPO / "docs" / "packaging.md", "markdown")]
    return [s for s in found if s.path.is_file()]


def code_sources() -> list[Source]:
    """Source files of 200-600 lines to edit (the standard library's)."""
    found = [Source("textwrap.py", _STDLIB / "textwrap.py", "code"),
             Source("shlex.py", _STDLIB / "shlex.py", "code"),
             Source("glob.py", _STDLIB / "glob.py", "code")]
    return [s for s in found if s.path.is_file()]


def cut_to_tokens(text: str, n_tokens: int, count: Callable[[str], int]) -> str:
    """The longest start of ``text`` ending at a paragraph break within ``n_tokens``."""
    paragraphs = text.split("\n\n")
    out: list[str] = []
    for paragraph in paragraphs:
        trial = "\n\n".join([*out, paragraph])
        if out and count(trial) > n_tokens:
            break
        out.append(paragraph)
    return "\n\n".join(out)


def _headings(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{1,4} (.+)$", text, re.MULTILINE)]


def _functions(code: str) -> list[str]:
    return re.findall(r"^\s*def (\w+)\(", code, re.MULTILINE)


def _questions(source: Source, text: str) -> list[tuple[str, str]]:
    """(category, question) for a document: one of each task."""
    heads = _headings(text)
    topic = heads[len(heads) // 2] if heads else "the licence's conditions"
    return [
        ("doc-qa", f"According to the document, what does it say about {topic}? Answer "
                   "in two or three sentences, quoting it where you can."),
        ("doc-extract", "List every section heading of the document, exactly as written, "
                        "one per line." if heads else
                        "Quote, word for word, the paragraph of the document that "
                        "disclaims warranties."),
        ("doc-summary", "Summarize the document in five bullet points."),
    ]


def _turn(name: str, kind: str, text: str, question: str) -> str:
    """The user message as the window composes an attached document and a question."""
    attachment = Attachment(0, 0, None, name, kind, text)
    composed = compose_turn(question, [attachment], 1 << 30, len, lambda _q, _n: [])
    return composed.text


def document_prompts(count: Callable[[str], int],
                     sizes: tuple[int, ...] = DOCUMENT_TOKENS) -> list[BenchPrompt]:
    """Each task over each document cut to each size, then the code edits; ``count``
    gives a text's tokens (the target's tokenizer)."""
    prompts: list[BenchPrompt] = []
    for source in document_sources():
        full = source.path.read_text(encoding="utf-8", errors="replace")
        for size in sizes:
            text = cut_to_tokens(full, size, count)
            if count(text) < size * 0.6:
                continue  # the document is shorter than this size: no duplicate
            for category, question in _questions(source, text):
                prompts.append(BenchPrompt(f"{category}/{source.name}@{size}", category,
                                           [_turn(source.name, source.kind, text, question)]))
    prompts += code_edit_prompts()
    return prompts


def code_edit_prompts() -> list[BenchPrompt]:
    """A request to rename one function throughout a file, the file as the prediction."""
    out = []
    for source in code_sources():
        code = source.path.read_text(encoding="utf-8")
        names = [n for n in _functions(code) if not n.startswith("__")]
        if not names:
            continue
        old = max(names, key=lambda n: (code.count(n + "("), n))  # the most called
        request = (f"Rename the function `{old}` to `{old}_renamed` everywhere in this file "
                   "(its definition and every call). Reply with the whole updated file in "
                   "one code block.")
        out.append(BenchPrompt(f"code-edit/{source.name}", "code-edit",
                               [_turn(source.name, "code", code, request)],
                               prediction=code))
    return out
