"""``tandem check-cpu`` (engine.planning.cpu_check) on this build: the level ggml loaded is
named and checked in a process of its own, a failure anywhere fails the level, and the
exactness verdicts are keyed by the CPU library and the build."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from engine.planning import kernels
from engine.planning.cpu_check import LevelCheck, ModelCheck, check_level, levels_to_check, table
from engine.runtime.native import CPU_VARIANT_ENV, cpu_variants, loaded_cpu_variant
from engine.runtime.target import TargetConfig


def test_this_builds_library_is_checked_exact_with_drafts_accepted_and_rejected(
        model_path: Path) -> None:
    level = loaded_cpu_variant()
    assert level in levels_to_check()
    result = check_level(level, {"q4_0": model_path}, 2)
    assert result.status == "checked" and result.loaded == level, result.status
    assert all(k["status"] == "exact" or k["status"].startswith("not built")
               for k in result.kernels), result.kernels
    assert any(k["status"] == "exact" for k in result.kernels)
    (model,) = result.models
    assert model.exact and model.drafted_equals_plain, model
    assert model.accepted > 0 and model.rejected > 0, model
    assert not result.failed
    assert f"| {level} | " in table([result]) and "| Q4_0 |" in table([result])


def test_any_failure_fails_the_level_and_an_unrunnable_one_does_not() -> None:
    good = ModelCheck("q4_0", exact=True, drafted_equals_plain=True, accepted=5, rejected=2)
    exact_kernels = [{"kernel": "q4_0_8x8_q8_0", "status": "exact", "differing": {}}]
    assert not LevelCheck("haswell", loaded="haswell", kernels=exact_kernels,
                          models=[good]).failed
    # Each of these is a failure.
    differs = [{"kernel": "q4_0_8x8_q8_0", "status": "differs", "differing": {4: 3}}]
    assert LevelCheck("haswell", loaded="haswell", kernels=differs, models=[good]).failed
    assert LevelCheck("haswell", loaded="zen4", kernels=exact_kernels, models=[good]).failed
    assert LevelCheck("haswell", status="crashed (signal 11): ...").failed
    assert LevelCheck("haswell", loaded="haswell", kernels=exact_kernels).failed  # no models
    for bad in (ModelCheck("q6_k", exact=False, drafted_equals_plain=True, accepted=5,
                           rejected=2),
                ModelCheck("q6_k", exact=True, drafted_equals_plain=False, accepted=5,
                           rejected=2),
                ModelCheck("q6_k", exact=True, drafted_equals_plain=True, accepted=0,
                           rejected=2),
                ModelCheck("q6_k", error="the memory drafter failed")):
        assert LevelCheck("haswell", loaded="haswell", kernels=exact_kernels,
                          models=[good, bad]).failed, bad
    assert not LevelCheck("alderlake", status="not runnable on this CPU").failed
    # JSON round trip, as the parent reads the child's line.
    level = LevelCheck("haswell", loaded="haswell", kernels=exact_kernels, models=[good])
    assert LevelCheck.from_json(asdict(level)) == level


@pytest.mark.skipif(bool(cpu_variants()), reason="a portable build takes the variable")
def test_naming_a_level_in_a_build_that_links_its_backend_in_is_a_clear_error() -> None:
    env = {**os.environ, CPU_VARIANT_ENV: "haswell"}
    run = subprocess.run([sys.executable, "-c", "from engine.runtime.native import "
                          "ensure_backend; ensure_backend()"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "links one CPU backend in" in run.stderr


def test_an_exactness_verdict_is_keyed_by_the_cpu_library_and_the_build(
        model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = TargetConfig(n_ctx=256, n_threads=2)
    here = kernels.exactness_key(model_path, config, 2)
    monkeypatch.setattr(kernels, "cpu_build_identity", lambda: "haswell:0123456789abcdef")
    assert kernels.exactness_key(model_path, config, 2) != here


def test_the_plan_names_the_cpu_library_its_kernels_were_probed_on(model_path: Path) -> None:
    """Where a level keeps repacking off or short verifications, the plan's kernel line
    says so and on which library (KernelChoice.describe, `tandem plan`'s Output line)."""
    from engine.runtime.exactness import ExactnessProbe

    inexact = ExactnessProbe(80, 12, 0.5, 1)
    exact = ExactnessProbe(80, 0, 0.0, 0)
    choice = kernels.KernelChoice(False, exact, {True: inexact, False: exact},
                                  cpu_library="haswell")
    assert "haswell CPU library" in choice.describe() and "repack" in choice.describe()
    assert kernels.KernelChoice.from_json(choice.to_json()).cpu_library == "haswell"
    probed = kernels.choose_kernels(model_path, TargetConfig(n_ctx=256, n_threads=2), 2, None)
    assert probed.cpu_library == loaded_cpu_variant()
