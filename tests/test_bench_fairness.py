"""How ``tandem bench`` measures: ``--repeat`` keeps the median first token and the
median decode with every run's speed beside them, ``--warm-memory`` fills the memories
that the runners keep."""

import json
from pathlib import Path

import pytest

from app.benchmarks.bench import run_bench
from engine.drafters.suffix_index import open_memory
from tests.conftest import DEV_PROMPTS
from tests.test_cli import _tandem
from training.spec_bench import BenchPrompt


def test_first_token_and_decode_are_each_the_median_of_their_runs(target):
    # (ttft, decode) per run, interleaved with a second runner: a noisy machine's runs.
    runs = {"none": iter([(0.30, 0.50), (0.20, 0.70), (0.40, 0.45)]),
            "other": iter([(0.10, 0.30), (0.10, 0.90), (0.10, 0.35)])}
    order = []

    def replay_as(name: str):
        def replay(tokens: list[int], max_tokens: int, remember: bool = True) -> dict:
            if max_tokens < 16:  # the bench's warm-up call
                return {"new_tokens": 1, "seconds": 0.0, "ttft_s": 0.0, "decode_seconds": 0.0}
            order.append(name)
            ttft, decode = next(runs[name])
            return {"new_tokens": 101, "seconds": ttft + decode, "ttft_s": ttft,
                    "decode_seconds": decode, "mean_accepted": 1.0}
        return replay

    prompts = [BenchPrompt(1, "writing", ["Write two sentences about the sea."])]
    out = run_bench(target, prompts, {"none": replay_as("none"), "other": replay_as("other")},
                    128, repeat=3)
    assert order == ["none", "other"] * 3  # interleaved, never three of one in a row
    row, other = out["results"]
    assert row["ttft_s"] == 0.30 and row["all_ttft_s"] == [0.30, 0.20, 0.40]
    assert row["decode_seconds"] == 0.50 and row["tok_per_s"] == 100 / 0.50
    assert row["all_seconds"] == pytest.approx([0.80, 0.90, 0.85])
    assert row["all_tok_per_s"] == pytest.approx([200, 100 / 0.7, 100 / 0.45])
    assert other["decode_seconds"] == 0.35  # the median, not the lucky 0.30
    cell = out["summary"]["categories"]["writing"]["other"]
    assert cell["ratio"] == pytest.approx(0.50 / 0.35)
    # The spread: (fastest - slowest) / the kept run, here (1/0.30 - 1/0.90) / (1/0.35).
    assert cell["spread"] == pytest.approx((1 / 0.30 - 1 / 0.90) * 0.35)


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


def test_all_turns_continue_each_runners_conversation_with_the_turns_before_cached(
        target, model_path, tmp_path):
    """``--turns all``: a follow-up turn prompts with the runner's own first answer, finds
    the conversation so far in the cache, and stays plain decoding's answer."""
    from dataclasses import replace

    from app.benchmarks.bench import engine_runner
    from engine.session import Engine, EngineConfig

    prompts = [BenchPrompt(81, "writing", ["Write one sentence about rain.",
                                           "Now make it about snow."]),
               BenchPrompt(82, "qa", ["Name a planet."])]
    base = EngineConfig(model_path=model_path, n_threads=2, n_ctx=1024, cache_dir=tmp_path)
    out = tmp_path / "turns.json"
    with Engine(replace(base, drafter="none")) as plain, \
            Engine(replace(base, drafter="memory", memory_dir=tmp_path / "m")) as memory:
        payload = run_bench(target, prompts, {"none": engine_runner(plain),
                                              "memory": engine_runner(memory)}, 16,
                            out_path=out, all_turns=True)
    rows = {(r["question_id"], r["drafter"], r["turn"]): r for r in payload["results"]}
    assert set(rows) == {(81, d, t) for d in ("none", "memory") for t in (0, 1)} | {
        (82, "none", 0), (82, "memory", 0)}
    for d in ("none", "memory"):
        first, follow = rows[(81, d, 0)], rows[(81, d, 1)]
        assert first["reused"] == 0  # a first turn starts from an empty cache
        # The follow-up found the first turn's prompt and answer cached.
        assert follow["reused"] >= first["n_prompt"] and follow["n_prompt"] > follow["reused"]
    assert rows[(81, "memory", 1)]["text"] == rows[(81, "none", 1)]["text"]  # lossless
    assert payload["summary_follow_up"]["categories"].keys() == {"writing"}
    assert json.loads(out.read_text())["summary"]["categories"].keys() == {"writing", "qa"}
    # Resumed: nothing runs again, and the follow-up keeps its place.
    again = run_bench(target, prompts, {"none": _never, "memory": _never}, 16,
                      out_path=out, all_turns=True)
    assert len(again["results"]) == len(payload["results"])


def _never(tokens: list[int], max_tokens: int, remember: bool = True, warm=None) -> dict:
    if max_tokens < 16:  # the bench's warm-up call
        return {"new_tokens": 1, "seconds": 0.0, "ttft_s": 0.0, "decode_seconds": 0.0}
    raise AssertionError("a finished run ran again")
