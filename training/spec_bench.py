"""Benchmark prompts in Spec-Bench's JSONL layout, as the bench and the training tools read
them, and where the development set lives."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# Spec-Bench's development half (240 prompts, Apache-2.0; training/data/README.md), in the
# repository and in the wheel: every reader of the dev set takes its path from here.
DEV_PROMPTS = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int | str
    category: str
    turns: list[str]
    json_schema: dict | None = None  # answers constrained to it (structured output)
    prediction: str | None = None  # the text the answer should repeat (a file being edited)


def load_prompts(path: str | os.PathLike[str], per_category: int | None = None
                 ) -> list[BenchPrompt]:
    """Spec-Bench style JSONL (``question_id``, ``category``, ``turns``)."""
    taken: dict[str, int] = defaultdict(int)
    out = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = BenchPrompt(row["question_id"], row["category"], list(row["turns"]),
                                     row.get("json_schema"))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a benchmark prompt ({exc})") from exc
            if per_category is not None and taken[prompt.category] >= per_category:
                continue
            taken[prompt.category] += 1
            out.append(prompt)
    return out
