"""A prediction's budget follows the placement in use (engine.planning.prediction_budget):
the decision as a table over (placement, probe verdicts), then on a real engine whose
cached verdict says its kernels are inexact, and what the API says of such an answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decoding.budget import MAX_MEMORY_DRAFT
from engine.decoding.generation import GenerationConfig
from engine.drafters.kinds import DrafterKind
from engine.planning.calibration import CalibrationCache
from engine.planning.kernels import KernelChoice, exactness_key
from engine.planning.prediction_budget import (
    INEXACT_WARNING,
    exactness_figures,
    prediction_budget,
    verifies_exactly,
)
from engine.runtime.exactness import ExactnessProbe
from engine.runtime.target import TargetConfig
from engine.session import Engine, EngineConfig

AUTO, NONE, LOOKUP = DrafterKind.AUTO, DrafterKind.NONE, DrafterKind.LOOKUP
ON_CPU, ON_GPU, SOME_ON_GPU = 0, -1, 12


@pytest.mark.parametrize(("cpu_exact", "gpu_layers", "gpu_exact", "expected"), [
    (True, ON_CPU, None, True),  # the CPU's verdict while every layer is there
    (True, ON_CPU, False, True),  # a GPU that failed its probe does not matter then
    (False, ON_CPU, True, False),
    (None, ON_CPU, None, False),  # never probed: not exact
    (True, ON_GPU, True, True),  # on a GPU: the GPU's verdict
    (True, ON_GPU, False, False),  # the reported case: CPU exact, GPU batch-variant
    (True, SOME_ON_GPU, False, False),  # one layer there runs on its kernels already
    (True, ON_GPU, None, False),  # on a GPU never probed
    (False, SOME_ON_GPU, True, True),
])
def test_the_verdict_is_the_one_for_where_the_target_runs(
        cpu_exact: bool | None, gpu_layers: int, gpu_exact: bool | None, expected: bool):
    assert verifies_exactly(cpu_exact, gpu_layers, gpu_exact) is expected


@pytest.mark.parametrize(("why_plain", "exact", "gpu_layers", "asked", "limit", "expected"), [
    (None, True, ON_CPU, AUTO, None, MAX_MEMORY_DRAFT),
    (None, True, ON_GPU, AUTO, None, MAX_MEMORY_DRAFT),  # a GPU that verifies exactly
    (None, True, ON_CPU, LOOKUP, 2, 2),  # as far as the target takes drafts back
    (None, False, ON_GPU, AUTO, None, 0),  # batch-variant GPU kernels: plain decoding
    (None, False, ON_GPU, LOOKUP, None, 0),  # whatever was asked
    (None, False, SOME_ON_GPU, NONE, None, 0),
    (None, False, ON_CPU, AUTO, None, 0),  # inexact CPU kernels: auto and none decode
    (None, False, ON_CPU, NONE, None, 0),  # plainly
    (None, False, ON_CPU, LOOKUP, None, MAX_MEMORY_DRAFT),  # a drafter asked by name runs
    ("a hybrid without snapshots", True, ON_CPU, LOOKUP, None, 0),
])
def test_the_prediction_budget_table(why_plain: str | None, exact: bool, gpu_layers: int,
                                     asked: DrafterKind, limit: int | None, expected: int):
    assert prediction_budget(why_plain, exact, gpu_layers, asked, limit) == expected


def test_an_answer_is_exact_unless_drafts_were_verified_on_inexact_kernels():
    assert exactness_figures("none", False) == {"exact": True}  # plain decoding itself
    assert exactness_figures("lookup+prediction", True) == {"exact": True}
    assert exactness_figures("lookup+prediction", False) == {"exact": False,
                                                             "warning": INEXACT_WARNING}


def _cached_verdict(model_path: Path, cache_dir: Path, differing: int) -> KernelChoice:
    """A cached verdict for the bundled model (no probe runs): batches differ at
    ``differing`` of 80 positions."""
    probe = ExactnessProbe(80, differing, 0.5 if differing else 0.0, min(differing, 1))
    verdict = KernelChoice(True, probe, {True: probe})
    key = exactness_key(model_path, TargetConfig(n_ctx=1024, n_threads=2), 2)
    CalibrationCache(cache_dir).put_entry(key, verdict.to_json())
    return verdict


def _engine(model_path: Path, tmp_path: Path, drafter: str) -> Engine:
    return Engine(EngineConfig(model_path=model_path, drafter=drafter, n_ctx=1024,
                               n_threads=2, cache_dir=tmp_path, memory_dir=tmp_path))


def test_a_named_drafter_on_inexact_kernels_drafts_the_prediction_and_says_so(
        model_path: Path, tmp_path: Path):
    verdict = _cached_verdict(model_path, tmp_path, differing=70)
    with _engine(model_path, tmp_path, "auto") as engine:
        assert engine.kernels == verdict and not engine.verifies_exactly
        assert engine.prediction_budget == 0  # auto decodes plainly there
    with _engine(model_path, tmp_path, "lookup") as engine:
        assert engine.kernels == verdict and not engine.verifies_exactly
        assert engine.prediction_budget == MAX_MEMORY_DRAFT
        prompt = engine.chat_prompt([{"role": "user", "content": "Count from one to ten."}])
        plain = engine.generate(prompt, GenerationConfig(16), plain=True)
        drafted = engine.generate(prompt, GenerationConfig(16, prediction=plain.text))
        assert drafted.stats.n_prediction_accepted > 0  # the prediction was drafted from
        assert exactness_figures(drafted.stats.drafter, engine.verifies_exactly) == {
            "exact": False, "warning": INEXACT_WARNING}
        assert exactness_figures(plain.stats.drafter, engine.verifies_exactly) == {
            "exact": True}


def test_the_gpu_verdict_counts_only_with_layers_on_a_gpu(model_path: Path, tmp_path: Path):
    _cached_verdict(model_path, tmp_path, differing=0)
    with _engine(model_path, tmp_path, "lookup") as engine:
        assert engine.target.n_gpu_layers == 0 and engine.verifies_exactly
        engine.plans.gpu_exact = False  # a GPU the plan maker found batch-variant
        assert engine.verifies_exactly  # the target is not there
        assert engine.prediction_budget == MAX_MEMORY_DRAFT
