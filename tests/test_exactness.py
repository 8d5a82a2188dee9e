"""Lossless on the weight types people download: the exactness probe, the kernels it
chooses, and speculation on K-quants and i-quants equal to plain decoding.

The bundled model's width (576) is not a multiple of 256, so llama.cpp's quantizer keeps
most of its tensors in legacy types and only ``ffn_down`` in the K-quant or i-quant; that
one tensor is enough for a verified batch to differ (the control below), and the text is
real, so drafts are accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig
from engine.gguf.model_shapes import ModelShape
from engine.gguf.synthetic import write_synthetic_gguf
from engine.planning.calibration import CalibrationCache
from engine.planning.kernels import ROUNDED, KernelChoice, choose_kernels, exactness_key
from engine.runtime.exactness import ExactnessProbe, probe_exactness
from engine.runtime.native import ftype_named, quantize
from engine.runtime.target import Target, TargetConfig
from engine.session import Engine, EngineConfig

# Fast to make without an importance matrix; every family of CPU kernel: legacy, K-quants
# of several widths, an i-quant with a non-linear grid, and floats (the 256-aligned model
# below covers more K-quants and i-quants whole).
WEIGHT_TYPES = ("q4_0", "q5_1", "q8_0", "q2_k", "q4_k_m", "q5_k_s", "q6_k", "iq4_nl", "f16",
                "bf16")


@pytest.fixture(scope="module")
def quantized(f32_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """name -> the bundled weights requantized to that type (made on first use)."""
    folder = tmp_path_factory.mktemp("quants")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            path = folder / f"SmolLM2-135M-Instruct.{name.upper()}.gguf"
            quantize(f32_model_path, path, ftype_named(name), 2)
            made[name] = path
        return made[name]

    return get


CONFIG = TargetConfig(n_ctx=512, n_threads=2)


@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_the_chosen_kernels_make_every_weight_type_exact(quantized, name):
    choice = choose_kernels(quantized(name), CONFIG, 2, cache=None)
    assert choice.exact, f"{name}: {choice.describe()}"
    assert choice.probe.positions >= 80 and max(choice.probe.chains) >= 33
    # Repacking is only given up where it breaks exactness.
    assert choice.repack == choice.tried[True].exact


def test_the_probe_sees_repacked_k_quant_batches_differ(quantized):
    """The control: with llama.cpp's repacked weights a Q4_K_M batch of 4+ rows sums in
    another order than one row, and the probe must say so."""
    with Target(quantized("q4_k_m"), TargetConfig(n_ctx=512, n_threads=2, repack=True,
                                                  f16_prefill=False)) as target:
        probe = probe_exactness(target)
    assert not probe.exact and probe.differing > probe.positions // 2 and probe.max_abs_diff > 0
    assert "differed" in probe.describe()
    choice = choose_kernels(quantized("q4_k_m"), CONFIG, 2, cache=None)
    assert not choice.repack and choice.tried[True].differing > 0


def test_the_verdict_is_cached_with_the_calibration(quantized, tmp_path):
    cache = CalibrationCache(tmp_path)
    first = choose_kernels(quantized("q6_k"), CONFIG, 2, cache)
    entries = json.loads((tmp_path / "calibration.json").read_text())
    assert list(entries) == [exactness_key(quantized("q6_k"), CONFIG, 2)]
    said = []
    again = choose_kernels(quantized("q6_k"), CONFIG, 2, cache, progress=said.append)
    assert again == first and not said  # no probe the second time


@pytest.mark.parametrize("name", ["q4_k_m", "iq4_nl"])
def test_speculation_on_k_and_i_quants_equals_plain_decoding(quantized, tmp_path, name):
    """Drafts from memory on a K-quant (and an i-quant): the second time a question is
    asked, the memory drafts the whole earlier answer; every answer is plain decoding's."""
    config = EngineConfig(model_path=quantized(name), drafter="memory", n_ctx=1024,
                          n_threads=2, cache_dir=tmp_path, memory_dir=tmp_path)
    with Engine(config) as engine:
        assert engine.kernels is not None and engine.kernels.exact
        assert engine.target.model.repack == engine.kernels.repack
        assert "identical to plain decoding" in engine.guarantee
        # Verification priced by a fixed curve: learnt from a busy machine's decodes, the
        # budget declined the memory's drafts (3 accepted in a clean clone's CI run).
        engine.cost = VerifyCostModel(slope=0.35, learn=False)
        accepted = 0
        for text in ("List three facts about the moon.", "Write two lines about rain.",
                     "List three facts about the moon."):
            prompt = engine.chat_prompt([{"role": "user", "content": text}])
            plain = engine.generate(prompt, GenerationConfig(48), plain=True).tokens
            out = engine.generate(prompt, GenerationConfig(48))
            assert out.tokens == plain, text
            accepted += sum(s.n_accepted for s in out.stats.steps)
        assert accepted >= 24  # the repeated question drafted from the earlier answer


def test_auto_does_not_speculate_where_batches_are_not_exact(model_path, tmp_path):
    """A recorded verdict of a type that stayed inexact: auto decodes plainly and says why;
    a drafter asked for by name still runs, with the guarantee in words."""
    config = TargetConfig(n_ctx=4096, n_threads=2)
    rounded = ExactnessProbe(80, 12, 0.8, 1)
    verdict = KernelChoice(False, rounded, {True: ExactnessProbe(80, 70, 1.5, 2),
                                             False: rounded})
    CalibrationCache(tmp_path).put_entry(exactness_key(model_path, config, 2),
                                         verdict.to_json())
    base = EngineConfig(model_path=model_path, n_threads=2, cache_dir=tmp_path,
                        memory_dir=tmp_path)
    with Engine(base) as engine:
        assert engine.drafter_name == "none" and engine.kernels == verdict
        assert any("auto does not speculate" in n and "12 of 80" in n for n in engine.notes)
        assert engine.guarantee.startswith(ROUNDED)
    with Engine(EngineConfig(model_path=model_path, drafter="memory", n_threads=2,
                             cache_dir=tmp_path, memory_dir=tmp_path)) as engine:
        assert engine.drafter_name == "memory" and not engine.target.model.repack


# Every matrix 256-aligned, so each type covers every tensor (the bundled model's 576-wide
# ones fall back to legacy types).
ALIGNED = ModelShape("aligned-tiny", "llama", 256, 2, 4, 2, 768, 49152, True,
                     context_length=2048)


@pytest.fixture(scope="module")
def aligned_f32(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("aligned") / "aligned-tiny.F32.gguf"
    return write_synthetic_gguf(ALIGNED, path, model_path, weights="F32")


@pytest.mark.parametrize("name", ["q4_k_m", "q6_k", "q3_k_s", "q5_k_m", "iq4_xs"])
def test_types_that_cover_every_tensor_are_exact_with_the_chosen_kernels(aligned_f32, name):
    path = aligned_f32.with_name(f"aligned-tiny.{name.upper()}.gguf")
    quantize(aligned_f32, path, ftype_named(name), 2)
    types = {t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) == 2}
    assert not types & {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "F32"}, types  # no fallbacks
    choice = choose_kernels(path, CONFIG, 2, cache=None)
    assert choice.exact, f"{name}: {choice.describe()}"
