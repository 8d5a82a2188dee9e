"""Lossless on the weight types people download: the exactness probe, the kernels it
chooses, and speculation on K-quants and i-quants equal to plain decoding.

The bundled model's width (576) is not a multiple of 256, so llama.cpp's quantizer keeps
most of its tensors in legacy types and only ``ffn_down`` in the K-quant or i-quant; that
one tensor is enough for a verified batch to differ (the control below), and the text is
real, so drafts are accepted."""

from __future__ import annotations

import json
import platform
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig
from engine.errors import NativeError
from engine.gguf.architectures import write_architecture_gguf
from engine.gguf.header import read_tensor_infos
from engine.gguf.model_shapes import ModelShape
from engine.gguf.synthetic import write_synthetic_gguf
from engine.hub.convert import quantize_as
from engine.planning.calibration import CalibrationCache
from engine.planning.kernels import (
    ROUNDED,
    SHORT_CHAINS,
    KernelChoice,
    choose_kernels,
    exactness_key,
)
from engine.runtime.draft_tree import DraftTree
from engine.runtime.exactness import PROBE_CHAINS, PROBE_TEXT, ExactnessProbe, probe_exactness
from engine.runtime.native import ftype_named, quantize
from engine.runtime.target import Target, TargetConfig
from engine.session import Engine, EngineConfig

# Fast to make without an importance matrix; every family of CPU kernel: legacy, K-quants
# of several widths, an i-quant with a non-linear grid, and floats (the 256-aligned model
# below covers more K-quants and i-quants whole).
WEIGHT_TYPES = ("q4_0", "q8_0", "q2_k", "q4_k_m", "q6_k", "iq4_nl", "f16")


CONFIG = TargetConfig(n_ctx=512, n_threads=2)


# x86 builds carry packaging/llama-cpp/batch-invariant-repack.patch: every repacked kernel
# there multiplies a batch as one token, so no type gives up repacking or long batches.
PATCHED_REPACK = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.parametrize("name", WEIGHT_TYPES)
def test_the_chosen_kernels_make_every_weight_type_exact(quantized, name):
    choice = choose_kernels(quantized(name), CONFIG, 2, cache=None)
    assert choice.exact, f"{name}: {choice.describe()}"
    if choice.max_batch is None:
        assert choice.probe.positions >= 80 and max(choice.probe.chains) >= 33
    else:  # repacked, verifying short batches only: probed with exactly those
        assert choice.repack and max(choice.probe.chains) == choice.max_batch == 3
        assert choice.probe is choice.short and choice.probe.positions >= 30
    # Repacking is only given up where no repacked setting is exact.
    assert choice.repack == (choice.tried[True].exact or choice.max_batch is not None)
    if PATCHED_REPACK:  # llama.cpp's fast default, probed exact for every batch size
        assert choice.repack and choice.max_batch is None and choice.tried[True].exact, name


def test_repacked_batches_of_up_to_three_tokens_are_exact(quantized):
    """Repacked weights multiply up to 3 rows with the one-row kernel: on Q4_K_M such
    batches give one-token decoding's logits bit for bit, after a short and a long
    context."""
    with Target(quantized("q4_k_m"), TargetConfig(n_ctx=1024, n_threads=2, repack=True,
                                                  f16_prefill=False)) as target:
        for context in (0, 600):
            probe = probe_exactness(target, chains=SHORT_CHAINS, context=context)
            assert probe.exact and probe.positions == sum(SHORT_CHAINS), probe.describe()


def test_short_verifications_keep_repacked_k_quants_lossless(quantized, tmp_path):
    """The verdict "repacked, at most 3 tokens a verification": the engine's target and
    budget never verify more, memory drafts are accepted, and every answer is plain
    decoding's."""
    path = quantized("q4_k_m")
    config = TargetConfig(n_ctx=1024, n_threads=2)
    with Target(path, replace(config, repack=True, f16_prefill=False)) as target:
        short = probe_exactness(target, chains=SHORT_CHAINS)
    verdict = KernelChoice(True, short, {True: ExactnessProbe(80, 70, 0.5, 1)}, 3, short,
                           {"with repacking, at most 3 tokens": 50.0})
    CalibrationCache(tmp_path).put_entry(exactness_key(path, config, 2), verdict.to_json())
    with Engine(EngineConfig(model_path=path, drafter="memory", n_ctx=1024, n_threads=2,
                             cache_dir=tmp_path, memory_dir=tmp_path)) as engine:
        assert engine.kernels == verdict and engine.target.model.repack
        assert engine.target.max_draft == 2 and engine.max_draft == 2
        assert "at most 3 tokens a verification" in engine.guarantee
        engine.cost = VerifyCostModel(slope=0.0, learn=False)
        accepted = 0
        for text in ("List three facts about the moon.", "List three facts about the moon."):
            prompt = engine.chat_prompt([{"role": "user", "content": text}])
            plain = engine.generate(prompt, GenerationConfig(40), plain=True).tokens
            out = engine.generate(prompt, GenerationConfig(40))
            assert out.tokens == plain, text
            assert all(s.n_proposed <= 2 for s in out.stats.steps)
            accepted += sum(s.n_accepted for s in out.stats.steps)
        assert accepted >= 16  # the repeated question drafted from the earlier answer


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
                     context_length=4096)


@pytest.fixture(scope="module")
def aligned_f32(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("aligned") / "aligned-tiny.F32.gguf"
    return write_synthetic_gguf(ALIGNED, path, model_path, weights="F32")


# File types of the ggml types llama.cpp's CPU backend runs that the bundled model cannot
# cover whole (the S/M/L variants mix the same kernels; IQ1_M and IQ2_S, slow to make,
# were probed for the notes only), with the ggml type that must then hold the layers'
# matrices. IQ1/IQ2/IQ3_XXS are made with a flat importance
# matrix (engine.gguf.importance): their kernels are the users' files'. The vocabulary
# matrix is Q8_0 (covered above) so the i-quants quantize in seconds. Every file type
# of llama.cpp's list was probed the same way for the notes (docs/engine.md).
ALIGNED_TYPES = {
    "q2_k": "Q2_K", "q3_k_m": "Q3_K", "q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K",
    "iq1_s": "IQ1_S", "iq2_xxs": "IQ2_XXS", "iq2_s": "IQ2_XS", "iq3_xxs": "IQ3_XXS",
    "iq3_s": "IQ3_S", "iq4_nl": "IQ4_NL",
    "iq4_xs": "IQ4_XS", "tq1_0": "TQ1_0", "tq2_0": "TQ2_0",
}


def _layer_types(path: Path) -> set[str]:
    table = read_tensor_infos(path)
    assert table is not None
    return {t.type_name for t in table[1] if len(t.dims) >= 2 and t.name.startswith("blk.")}


@pytest.mark.parametrize("name", ALIGNED_TYPES)
def test_types_that_cover_every_tensor_are_exact_with_the_chosen_kernels(aligned_f32, name):
    path = aligned_f32.with_name(f"aligned-tiny.{name.upper()}.gguf")
    quantize_as(aligned_f32, path, name, 2, vocab_type="q8_0")
    types = _layer_types(path)
    assert ALIGNED_TYPES[name] in types, types
    assert not types & {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "F32"}, types  # no fallbacks
    choice = choose_kernels(path, CONFIG, 2, cache=None)
    assert choice.exact, f"{name}: {choice.describe()}"
    path.unlink()


def test_the_importance_types_are_refused_without_a_matrix(aligned_f32, tmp_path):
    """The control for the flat importance matrix: llama.cpp will not make IQ2_XXS
    without one, and says why."""
    with pytest.raises(NativeError, match="imatrix"):
        quantize(aligned_f32, tmp_path / "no-imatrix.gguf", ftype_named("iq2_xxs"), 2)
    assert not (tmp_path / "no-imatrix.gguf").exists()


def test_mxfp4_experts_are_exact_with_the_chosen_kernels(model_path, tmp_path):
    """MXFP4 is for experts only (gpt-oss ships it): the tiny gpt-oss layout's expert
    tensors in MXFP4, the rest Q8_0."""
    moe = write_architecture_gguf("gpt-oss", tmp_path / "gpt-oss.gguf", model_path)
    path = quantize_as(moe, tmp_path / "gpt-oss.MXFP4_MOE.gguf", "mxfp4_moe", 2)
    table = read_tensor_infos(path)
    assert table is not None
    experts = {t.type_name for t in table[1] if "_exps" in t.name and len(t.dims) == 3}
    assert experts == {"MXFP4"}, experts
    choice = choose_kernels(path, CONFIG, 2, cache=None)
    assert choice.exact, choice.describe()


LONG_CONTEXT = 4096 - sum(PROBE_CHAINS) - 2  # the probe's answer fills the rest


@pytest.fixture(scope="module")
def aligned_q4_k_m(aligned_f32: Path) -> Path:
    return quantize_as(aligned_f32, aligned_f32.with_name("aligned-tiny.Q4_K_M.gguf"),
                       "q4_k_m", 2, vocab_type="q8_0")


def test_verification_stays_exact_over_a_4k_context(aligned_q4_k_m):
    """Verified batches attend over a cache of ~4k tokens: with the Q8_0 K cache every
    query row takes the same flash-attention kernel at every cache length, so the
    chosen kernels stay exact there (the control below is the F16 cache). The kernel
    choice does not depend on the model's size: a tiny Q4_K_M of 64-wide heads."""
    config = TargetConfig(n_ctx=4096, n_threads=2, repack=False)
    with Target(aligned_q4_k_m, config) as target:
        probe = probe_exactness(target, context=LONG_CONTEXT)
    assert probe.context >= LONG_CONTEXT - 1 and probe.exact, probe.describe()


def test_an_f16_cache_is_exact_only_through_the_one_attention_kernel(aligned_q4_k_m):
    """The control: with flash attention and F16 keys, ggml's own kernels attend a single
    query over 512+ cells in chunks per thread (flash decoding), a batch row over all
    cells at once; the probe sees it. Tandem's kernel (packaging/llama-cpp/
    tiled-attention.patch) takes every batch size the same way: exact."""
    from engine.runtime.llama_bindings import use_tiled_attention

    config = TargetConfig(n_ctx=4096, n_threads=2, repack=False, type_k="f16",
                          type_v="f16", flash_attn=True)
    with Target(aligned_q4_k_m, config) as target:
        probe = probe_exactness(target, context=LONG_CONTEXT)
        assert probe.exact, probe.describe()
        use_tiled_attention(False)
        try:
            stock = probe_exactness(target, context=LONG_CONTEXT)
        finally:
            use_tiled_attention(True)
    assert not stock.exact and "after" in stock.describe()


def test_a_cpu_target_keeps_its_batches_on_the_cpu(target, model_path):
    """llama.cpp sends a CPU-resident model's batches of 32+ tokens to a GPU where the
    build has one (op offload): on an H200 the probe's 33-token chain then differed at
    every position. A target wholly on the CPU turns that off; one with layers on the
    GPU keeps it (its batches run there anyway)."""
    assert target.ctx.op_offload is False
    with Target(model_path, TargetConfig(n_ctx=256, n_threads=2, n_gpu_layers=1,
                                         f16_prefill=False)) as placed:
        assert placed.ctx.op_offload is True


def test_a_gpu_placement_has_its_own_verdict(model_path):
    config = TargetConfig(n_ctx=256)
    cpu = exactness_key(model_path, config, 2)
    assert exactness_key(model_path, config, 2, n_gpu_layers=-1) != cpu
    assert exactness_key(model_path, config, 2, n_gpu_layers=0) == cpu


def test_auto_plans_within_short_verifications(quantized, tmp_path):
    """auto on a K-quant whose verdict is "repacked, at most 3 tokens": calibration
    measures only the sizes it will verify, and the plan drafts 2 tokens a step at most."""
    path = quantized("q4_k_m")
    config = TargetConfig(n_ctx=1024, n_threads=2)
    with Target(path, replace(config, repack=True, f16_prefill=False)) as target:
        short = probe_exactness(target, chains=SHORT_CHAINS)
    verdict = KernelChoice(True, short, {True: ExactnessProbe(80, 70, 0.5, 1)}, 3, short)
    CalibrationCache(tmp_path).put_entry(exactness_key(path, config, 2), verdict.to_json())
    with Engine(EngineConfig(model_path=path, n_ctx=1024, n_threads=2, cache_dir=tmp_path,
                             memory_dir=tmp_path)) as engine:
        assert engine.costs is not None and set(engine.costs.verify_s["cpu"]) <= {1, 2, 3}
        assert engine.plan is not None and engine.plan.budget.max_draft <= 2
        assert engine.max_draft <= 2 and engine.target.max_draft == 2
        assert engine.plan.drafter in ("memory", "head")  # memory drafts are always on offer
        # Whether a step drafts then follows a fixed curve, not this machine's load (a
        # governor that paused drafting would leave the check below nothing to verify).
        engine.pin_drafting()
        accepted = 0
        for _ in range(2):  # the second time, the memory drafts the first answer
            prompt = engine.chat_prompt([{"role": "user", "content": "Name three rivers."}])
            plain = engine.generate(prompt, GenerationConfig(24), plain=True).tokens
            out = engine.generate(prompt, GenerationConfig(24))
            assert out.tokens == plain
            assert all(s.n_proposed <= 2 for s in out.stats.steps)
            accepted += sum(s.n_accepted for s in out.stats.steps)
        assert accepted >= 8


def test_features_on_short_verification_kernels_leave_the_prompt_as_plain_decoding(quantized):
    """With kernels exact only in short batches, asking for the prompt's features (all of
    them, past one chunk) changes neither the first token's logits nor the cells: the
    features come from evaluating the tail again beside them."""
    config = TargetConfig(n_ctx=512, n_threads=2, n_batch=32, repack=True, max_batch=3,
                          f16_prefill=False)
    with Target(quantized("q4_k_m"), config) as target:
        prompt = target.tokenize(PROBE_TEXT + " " + PROBE_TEXT, special=False)
        assert len(prompt) > 32
        plain = np.array(target.prefill(prompt).logits, copy=True)  # views of llama's rows
        after_plain = np.array(target.verify(int(plain.argmax()), DraftTree.chain([]))
                               .logits[0], copy=True)
        target.reset(cold=True)
        target.set_features(True)
        try:
            pre = target.prefill(prompt)
            assert pre.features is not None and len(pre.features) == len(prompt)
            assert np.isfinite(pre.features).all()
            assert target.n_past == len(prompt)
            first = np.array(pre.logits, copy=True)
            after = target.verify(int(first.argmax()), DraftTree.chain([]))
        finally:
            target.set_features(False)
        assert np.array_equal(first, plain)
        assert np.array_equal(after.logits[0], after_plain)
