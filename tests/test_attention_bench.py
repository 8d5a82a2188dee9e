"""``tandem bench --attention``: each CPU attention path's verification and prompt cost at
a context, interleaved, saved after each context and resumed (app.benchmarks.attention_bench)."""

from __future__ import annotations

import json
from pathlib import Path

from app.benchmarks.attention_bench import PATHS, SIZES, format_attention_table, run_attention_bench
from app.benchmarks.long_context import long_text
from engine.runtime.llama_bindings import tiled_attention_on
from engine.runtime.native import NativeModel


def test_every_path_is_measured_at_every_context_and_a_rerun_resumes(model_path: Path,
                                                                      tmp_path: Path) -> None:
    model = NativeModel(model_path)
    try:
        tokens = model.tokenize(long_text(), add_special=False, parse_special=False)
    finally:
        model.close()
    out = tmp_path / "attention.json"
    rounds: list[str] = []
    payload = run_attention_bench(model_path, tokens, [96, 160], 2, 2, out, rounds.append)
    assert tiled_attention_on()  # left on after the ggml-fa rounds
    assert len(rounds) == 2 * 2 * len(PATHS)
    assert [c["context"] for c in payload["contexts"]] == [96, 160]
    for ctx in payload["contexts"]:
        assert set(ctx["paths"]) == set(PATHS)
        for p in ctx["paths"].values():
            assert set(p["verify_ms"]) == {str(n) for n in SIZES}
            ms = p["verify_ms"]["16"]
            assert 0 < ms["min"] <= ms["median"] <= ms["max"]
            assert p["price"]["1"] == 1.0 and p["price"]["16"] > 1.0
    assert json.loads(out.read_text()) == payload
    # A rerun measures only what is missing.
    rounds.clear()
    again = run_attention_bench(model_path, tokens, [96, 160, 224], 1, 2, out, rounds.append)
    assert len(rounds) == len(PATHS) and [c["context"] for c in again["contexts"]] == [96, 160, 224]
    table = format_attention_table(again)
    assert "tiled" in table and "vs ggml-fa" in table and "vs matmul" in table
