"""JSON extraction prompts with schemas, for ``tandem bench`` on structured output: the
dev prompts' extraction questions and rag passages, each asked for as JSON matching a
schema (the rows' ``json_schema``). Strings have no maximum length: llama-cpp-python's
converter spells one out as that many nested optionals, slow for the grammar sampler.

    python -m app.benchmarks.json_prompts --out json.jsonl \\
        [--dev training/data/spec_bench_dev.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.spec_bench import DEV_PROMPTS

EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "maxItems": 6, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1},
                       "value": {"type": "string", "minLength": 1}},
        "required": ["name", "value"]}}},
    "required": ["items"]}
RAG_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 1},
                   "evidence": {"type": "array", "maxItems": 3,
                                "items": {"type": "string", "minLength": 1}},
                   "confidence": {"enum": ["low", "medium", "high"]}},
    "required": ["answer", "evidence", "confidence"]}

def json_prompts(dev: Path, n_extraction: int = 5, n_rag: int = 15) -> list[dict]:
    """The first ``n_extraction`` extraction and ``n_rag`` rag prompts of ``dev``, asked
    for as JSON."""
    rows = [json.loads(line) for line in dev.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    out = []
    for category, count, schema, ask in (
            ("extraction", n_extraction, EXTRACTION_SCHEMA,
             "Answer in JSON: a list of items, each a name and its value."),
            ("rag", n_rag, RAG_SCHEMA,
             "Answer in JSON: the answer, up to three quotes from the text as evidence, "
             "and your confidence (low, medium or high).")):
        for row in [r for r in rows if r["category"] == category][:count]:
            out.append({"question_id": f"json-{row['question_id']}",
                        "category": f"json-{category}",
                        "turns": [f"{row['turns'][0]}\n\n{ask}"], "json_schema": schema})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dev", type=Path, default=DEV_PROMPTS)
    args = p.parse_args()
    rows = json_prompts(args.dev)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
