"""The engine's shape as issue 64 left it: small classes, sequence 0 with one owner."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQUENCE_OWNER = REPO / "engine" / "runtime" / "sequence.py"


def _classes() -> list[tuple[str, str, int]]:
    rows = []
    for path in sorted((REPO / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                rows.append((str(path.relative_to(REPO)), node.name,
                             node.end_lineno - node.lineno + 1))
    return rows


def test_no_engine_class_is_over_400_lines() -> None:
    big = [row for row in _classes() if row[2] > 400]
    assert not big, f"classes over 400 lines: {big}"


def test_the_target_and_the_prompt_reader_stay_small() -> None:
    sizes = {name: n for _, name, n in _classes() if name in ("Target", "PromptReader")}
    assert sizes.keys() == {"Target", "PromptReader"}
    assert all(n < 350 for n in sizes.values()), sizes


def test_only_the_sequence_writes_sequence_zeros_books() -> None:
    """Sequence 0's tokens, parked cells, checkpoints, pending move and window gap are
    written in engine/runtime/sequence.py alone: nowhere else does code write them on a
    target, a sequence or a prompt reader."""
    books = r"(tokens|_tokens|n_parked|_n_parked|_checkpoints|_pending|_window_gap|window_gap)"
    owners = r"\b(target|t|seq|sequence|prompts|reader)"
    write = re.compile(owners + r"\." + books + r"\s*(=[^=]|\+=|\.append\(|\.extend\()"
                       r"|del (?!self\.)\w+(\.\w+)*\.(tokens|_tokens)\[")
    offenders = []
    for folder in ("engine", "app", "training"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == SEQUENCE_OWNER:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if write.search(code):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
