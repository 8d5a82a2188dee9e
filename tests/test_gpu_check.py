"""The GPU check's verdicts, on this machine (no GPU): every real failure gives a non-zero
exit, what cannot run here is skipped and said so, and "nothing could run" has its own
exit code. The steps run for real where they can (the CPU placement, lookup drafts on the
bundled model); the GPU-only ones are skipped. ``--strict``: a GPU that llama.cpp cannot
offload to fails the run (decided by a pure function, tested for every case), and this
machine, which has no GPU, passes it (the script run as the runbook runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import pytest

import tests.gpu_check as gpu_check
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
from engine.runtime.hardware import load_profile
from engine.runtime.model_info import ModelFacts
from tests.conftest import PROFILES, plain_answers
from tests.gpu_check import (
    EXIT_FAILED,
    EXIT_NOTHING_RAN,
    EXIT_PASSED,
    Checks,
    Here,
    Skip,
    check_offload,
    exactness,
    gpu_offload,
    gpu_offload_verdict,
    lossless_row,
    plan_drafts_on_gpu,
    run_step,
    summarize,
)

REPEATING = {"question_id": 1, "category": "extraction", "turns": [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the "
    "mat."]}


def _raises() -> dict:
    raise RuntimeError("CUDA error: an illegal memory access")


def _skips() -> dict:
    raise Skip("no GPU")


def test_a_step_that_raises_fails_the_run_and_one_that_cannot_run_does_not() -> None:
    results: dict = {}
    crashed = run_step(None, results, "lossless", lambda c: _raises())
    assert crashed.failed and "RuntimeError: CUDA error" in results["lossless"]["status"]
    assert "trace" in results["lossless"]
    skipped = run_step(None, results, "verify", lambda c: _skips())
    assert results["verify"]["status"] == "skipped: no GPU"
    ran = run_step(None, results, "hardware", lambda c: {"probe": {}})
    assert results["hardware"]["status"] == "passed"
    assert summarize([ran, skipped])[0] == EXIT_PASSED
    code, summary = summarize([ran, skipped, crashed])
    assert code == EXIT_FAILED and list(summary["failed"]) == ["lossless"]
    # Nothing ran: not "passed".
    code, summary = summarize([skipped])
    assert code == EXIT_NOTHING_RAN and summary["verdict"] == "nothing could run here"
    assert summarize([])[0] == EXIT_NOTHING_RAN


def test_a_failed_check_fails_its_step_and_skips_inside_a_passing_one_are_listed() -> None:
    results: dict = {}

    def partly(checks: Checks) -> dict:
        checks.expect(True, "cpu exact", "")
        checks.skip("gpu placement", "no GPU")
        return {}

    def wrong(checks: Checks) -> dict:
        checks.expect(True, "cpu exact", "")
        checks.expect(False, "memory", "no draft accepted")
        return {}

    part = run_step(None, results, "exactness", partly)
    code, summary = summarize([part])
    assert code == EXIT_PASSED and summary["verdict"] == "passed (some checks skipped)"
    assert summary["skipped"] == {"exactness: gpu placement": "skipped: no GPU"}
    bad = run_step(None, results, "lossless", wrong)
    assert results["lossless"]["status"] == "failed: memory: no draft accepted"
    assert summarize([part, bad])[0] == EXIT_FAILED


def test_exactness_on_this_machine_runs_the_cpu_placement_and_skips_the_gpu(
        model_path: Path) -> None:
    here = Here()
    results: dict = {}
    step = run_step(None, results, "exactness", lambda c: exactness(
        model_path, here, c, [("gpu", 99, 8), ("cpu2", 0, 2)], contexts=(0,),
        chains=(2, 4, 9)))  # a row kernel, a repacked GEMM, the tiled matmul: seconds
    checks = results["exactness"]["checks"]
    assert checks["passed"] == ["cpu2 repack=True ctx=0: exact",
                                "cpu2 repack=False ctx=0: exact"]
    assert results["exactness"]["cpu2 repack=True ctx=0"]["differing"] == 0
    if here.gpu_target_skip:  # this machine: no GPU
        assert checks["skipped"] == {"gpu placement": here.gpu_target_skip}
        code, summary = summarize([step])
        assert code == EXIT_PASSED and "exactness: gpu placement" in summary["skipped"]


def test_no_weights_on_a_device_fails_the_offload_check(model_path: Path) -> None:
    """llama.cpp's own buffer lines are read: here every buffer is the CPU's, so a
    placement that asked for GPU layers and got none fails."""
    checks = Checks()
    figures = check_offload(model_path, 0, checks, "target")
    assert figures["buffers_mib"] and all(n.startswith("CPU") for n in figures["buffers_mib"])
    assert "target: layers offloaded" in checks.failed
    assert gpu_check.on_gpu_mib({"CPU_Mapped": 80.0, "CUDA_Host": 1.0, "CUDA0": 90.0}) == 90.0


def test_lossless_rows_fail_on_a_difference_and_on_no_draft_accepted(
        target, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(gpu_check, "MAX_TOKENS", 24)
    rows = [REPEATING]
    plain = plain_answers(target, rows, 24)
    checks = Checks()
    ok = lossless_row(target, lambda: PromptLookupDrafter(LookupConfig(max_branches=3)),
                      rows, plain, checks, "lookup-tree")
    assert ok["identical"] and ok["accepted"] > 0 and checks.passed == ["lookup-tree"]
    # A reference that is not the target's answer: the row fails.
    prompt, answer = plain[1]
    wrong = {1: (prompt, answer[:-1] + [answer[-1] + 1])}
    row = lossless_row(target, PromptLookupDrafter, rows, wrong, checks, "wrong reference")
    assert row["identical"] is False and "question 1" in checks.failed["wrong reference"]
    # A drafter that never drafts is lossless and proves nothing: the row fails.
    never = lossless_row(target, lambda: PromptLookupDrafter(
        LookupConfig(min_ngram=400, max_ngram=400)), rows, plain, checks, "never")
    assert never["identical"] and never["accepted"] == 0
    assert "no draft accepted" in checks.failed["never"]
    # A drafter that cannot be built fails its row, not the rest.
    lossless_row(target, _raises, rows, plain, checks, "broken")
    assert "RuntimeError" in checks.failed["broken"]


def test_the_planner_check_fails_a_plan_that_drafts_on_an_inexact_gpu() -> None:
    hw = load_profile(PROFILES / "synthetic_large_gpu.json")
    exact = ModelFacts(size_bytes=1_000_000_000, n_layers=24, kv_bytes=400_000_000)
    assert plan_drafts_on_gpu(hw, replace(exact, exact_on_gpu=False)) == []
    # The control: told the GPU is exact, the planner drafts there, which the check sees.
    assert plan_drafts_on_gpu(hw, exact)


def test_the_cli_exit_codes(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(REPEATING) + "\n")
    base = ["--out", str(tmp_path), "--prompts", str(prompts), "--shapes", ""]
    assert gpu_check.main([*base, "--steps", ""]) == EXIT_PASSED  # the hardware probe ran
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["hardware"]["status"] == "passed" and saved["summary"]["exit_code"] == 0
    assert gpu_check.main([*base, "--steps", "", "--no-hardware"]) == EXIT_NOTHING_RAN
    if Here().gpu_target_skip:  # lossless on a GPU-resident target cannot run here
        assert gpu_check.main([*base, "--steps", "lossless", "--no-hardware"]) \
            == EXIT_NOTHING_RAN
        saved = json.loads((tmp_path / "gpu_check.json").read_text())
        assert saved["lossless"]["status"].startswith("skipped: ")



@pytest.mark.parametrize(("gpu_seen", "offload", "strict", "status"), [
    (True, False, True, "failed"),  # the failed CUDA build: strict mode fails it
    (True, False, False, "skipped"),  # a CPU build beside a GPU, on purpose
    (True, True, True, "passed"),
    (True, True, False, "passed"),
    (False, False, True, "skipped"),  # a CPU machine passes in both modes
    (False, False, False, "skipped"),
    (False, True, True, "skipped"),
])
def test_the_offload_verdict(gpu_seen: bool, offload: bool, strict: bool,
                             status: str) -> None:
    got, why = gpu_offload_verdict(gpu_seen, offload, strict)
    assert got == status
    if gpu_seen and not offload:
        assert "cannot offload" in why and "-DGGML_CUDA=ON" in why


class GpuWithoutOffload(Here):
    """A machine with a GPU (a recorded profile's) and a llama.cpp that cannot use it: the
    hardware as the probe would report it there; llama.cpp itself is this machine's."""

    gpu_seen = True

    @cached_property
    def hardware(self):  # noqa: ANN201
        return replace(load_profile(PROFILES / "synthetic_large_gpu.json"),
                       llama_gpu_offload=False)


def test_strict_mode_fails_a_gpu_that_llama_cpp_cannot_offload_to() -> None:
    here = GpuWithoutOffload()
    results: dict = {}
    strict = run_step(None, results, "gpu offload", lambda c: gpu_offload(here, c, True))
    assert strict.failed and "cannot offload" in results["gpu offload"]["status"]
    code, summary = summarize([strict])
    assert code == EXIT_FAILED and "make install" in summary["failed"]["gpu offload"]
    # Without --strict it is reported, and the CPU checks that ran decide the exit code.
    lenient = run_step(None, results, "gpu offload", lambda c: gpu_offload(here, c, False))
    ran = run_step(None, results, "hardware", lambda c: {"probe": {}})
    code, summary = summarize([ran, lenient])
    assert code == EXIT_PASSED and "cannot offload" in summary["skipped"]["gpu offload"]


def test_strict_mode_passes_on_this_machine_without_a_gpu(tmp_path: Path) -> None:
    """The script as the runbook runs it, in a process of its own, llama.cpp as built."""
    here = Here()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(REPEATING) + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "tests.gpu_check", "--strict", "--out", str(tmp_path),
         "--prompts", str(prompts), "--shapes", "", "--steps", ""],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
        timeout=600, check=False)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    status, _ = gpu_offload_verdict(here.gpu_seen, here.hardware.llama_gpu_offload, True)
    assert saved["gpu offload"]["status"].startswith(status)
    assert run.returncode == (EXIT_FAILED if status == "failed" else EXIT_PASSED), \
        run.stdout[-2000:] + run.stderr[-2000:]
    if not here.gpu_seen:  # this machine
        assert saved["gpu offload"]["status"].startswith("skipped: llama.cpp on the GPU: no GPU")
        assert saved["summary"]["verdict"] == "passed (some checks skipped)"
