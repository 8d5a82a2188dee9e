"""The GPU check's verdict: a drafter whose answers differ from plain decoding fails the
run (a non-zero exit), one this process cannot build does not."""

from __future__ import annotations

from tests.gpu_check import lossless_failures


def test_a_difference_fails_the_gpu_check_and_a_missing_drafter_does_not() -> None:
    ok = {"lossless": {"prompts": 13, "lookup-tree": {"identical": True, "accepted": 40},
                       "head-chain-cuda": {"error": "ModuleNotFoundError: torch"}}}
    assert lossless_failures(ok) == []
    assert lossless_failures({}) == []  # the step was not asked for
    bad = {"lossless": {"prompts": 13,
                        "head-tree-cuda": {"identical": False, "where": "question 81"}}}
    assert lossless_failures(bad) == ["head-tree-cuda: drafted answers differ from plain "
                                      "decoding (question 81)"]
    crashed = {"lossless": {"error": "RuntimeError: CUDA error", "trace": "..."}}
    assert lossless_failures(crashed) == ["the lossless step failed: RuntimeError: CUDA error"]
