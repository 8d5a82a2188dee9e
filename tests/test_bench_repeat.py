"""``tandem bench --repeat``: the first token and the decode are each the fastest of their
runs (the real target formats the prompt; the runner replays measured rows)."""

import pytest

from app.bench import BenchPrompt, run_bench


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
