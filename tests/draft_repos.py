"""Fake-Hub repositories for the draft-model pairing tests: a SmolLM2-vocabulary target,
the catalog's SmolLM2 draft under its real repository name, a repository whose header
(not its name) says SmolLM2, and a draft of another vocabulary. Every file is a real
GGUF carrying the bundled model's tokenizer (or an edited copy)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.hub_server import FakeRepo
from tests.vocab_gguf import other_vocab, write_vocab_gguf

MiB = 1 << 20
TARGET = "someone/SmolLM2-Big-GGUF"  # matches the catalog's "*smollm2*" pattern
TARGET_Q8 = "SmolLM2-Big-Q8_0.gguf"  # ~14 MiB: a 3 MiB draft is under a quarter of it
TARGET_Q4 = "SmolLM2-Big-Q4_K_M.gguf"  # ~8 MiB: the 3 MiB draft is not
BY_HEADER = "someone/my-finetune-GGUF"  # no family in its name; its header says SmolLM2
CATALOG_DRAFT = "HuggingFaceTB/SmolLM2-360M-Instruct-GGUF"  # the built-in catalog's
CATALOG_DRAFT_FILE = "smollm2-360m-instruct-q8_0.gguf"
OTHER_DRAFT = "tandem/other-vocab-GGUF"  # paired by the user's catalog file
OTHER_DRAFT_FILE = "other-vocab-Q8_0.gguf"


def draft_repos(tmp: Path, tokenizer_from: Path) -> list[FakeRepo]:
    def gguf(file: str, extra: int, **kw) -> bytes:
        return write_vocab_gguf(tmp / file, tokenizer_from, n_extra_bytes=extra,
                                **kw).read_bytes()

    return [
        FakeRepo(TARGET, {TARGET_Q8: gguf("t8.gguf", 12 * MiB, name="SmolLM2 Big"),
                          TARGET_Q4: gguf("t4.gguf", 6 * MiB, name="SmolLM2 Big")},
                 downloads=50),
        FakeRepo(BY_HEADER, {"finetune-Q8_0.gguf": gguf("ft.gguf", 12 * MiB,
                                                        name="SmolLM2 1.7B Instruct")}),
        FakeRepo(CATALOG_DRAFT, {CATALOG_DRAFT_FILE: gguf("d.gguf", int(1.3 * MiB),
                                                          name="SmolLM2 360M Instruct"),
                                 "README.md": b"# draft\n"}),
        FakeRepo(OTHER_DRAFT, {OTHER_DRAFT_FILE: gguf("o.gguf", 0, name="Other",
                                                      edit=other_vocab)}),
    ]


def write_user_catalog(data_dir: Path) -> Path:
    """``<data dir>/draft_catalog.json`` pairing SmolLM2 targets with OTHER_DRAFT."""
    path = data_dir / "draft_catalog.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"family": "mine", "target_pattern": "*smollm2-big*",
                                 "draft_repo": OTHER_DRAFT, "quants": ["Q8_0"]}]))
    return path
