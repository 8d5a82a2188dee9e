"""How ``tandem bench`` measures: ``--repeat`` keeps the fastest first token and the
fastest decode, ``--warm-memory`` fills the memories that the runners keep."""

import json
from pathlib import Path

import pytest

from app.bench import run_bench
from engine.drafters.suffix_index import open_memory
from tests.conftest import DEV_PROMPTS
from tests.test_cli import _tandem
from training.spec_bench import BenchPrompt


def test_first_token_and_decode_are_each_the_fastest_of_their_runs(target):
    # (ttft, decode) per run: the fastest decode came with the slowest first token.
    runs = iter([(0.30, 0.50), (0.20, 0.70), (0.40, 0.45)])

    def replay(tokens: list[int], max_tokens: int, remember: bool = True) -> dict:
        if max_tokens < 16:  # the bench's warm-up call
            return {"new_tokens": 1, "seconds": 0.0, "ttft_s": 0.0, "decode_seconds": 0.0}
        ttft, decode = next(runs)
        return {"new_tokens": 101, "seconds": ttft + decode, "ttft_s": ttft,
                "decode_seconds": decode, "mean_accepted": 1.0}

    prompts = [BenchPrompt(1, "writing", ["Write two sentences about the sea."])]
    row = run_bench(target, prompts, {"none": replay}, 128, repeat=3)["results"][0]
    assert row["ttft_s"] == 0.20 and row["all_ttft_s"] == [0.30, 0.20, 0.40]
    assert row["decode_seconds"] == 0.45 and row["tok_per_s"] == 100 / 0.45
    assert row["all_seconds"] == pytest.approx([0.80, 0.90, 0.85])


def test_warm_memory_fills_only_the_memories_of_runners_that_remember(tandem_home, model_path,
                                                                    tmp_path):
    prompts = tmp_path / "p.jsonl"
    row = next(json.loads(x) for x in DEV_PROMPTS.read_text().splitlines())
    prompts.write_text(json.dumps(row))
    out_json = tmp_path / "bench.json"
    out = _tandem("bench", "--prompts", str(prompts), "--per-category", "1", "--drafters",
                  "none,memory", "--max-tokens", "16", "--threads", "2", "--warm-memory", "2",
                  "--json", str(out_json), home=tandem_home)
    assert out.returncode == 0, out.stderr
    data = json.loads(out_json.read_text())
    assert data["meta"]["warm_memory"] == {"prompts": 2, "runners": ["memory"]}
    files = list(Path(f"{out_json}.memory").rglob("*.idx"))
    assert len(files) == 1 and "memory" in str(files[0].parent)  # none keeps no memory
    memory, note = open_memory(files[0])
    assert note == ""
    assert memory.n_sequences == 3  # the two ShareGPT answers, then the timed prompt's
