"""The one memory-fit rule (engine.runtime.memory_fit): its arithmetic at the edge, and the
model wizard's label agreeing with the planner's placement for the same numbers. Pure."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.gguf.header import GGUFFacts
from engine.hub.fit import FITS_GPU, FITS_RAM, TOO_LARGE, MachineMemory, estimate_fit
from engine.planning.calibration import CostProfile
from engine.planning.planner import DraftModelFacts, _draft_placements, choose_plan
from engine.runtime.hardware import HardwareProfile, load_profile
from engine.runtime.kv_cache import kv_cache_bytes
from engine.runtime.memory_fit import (
    COMPUTE_OVERHEAD_BYTES,
    CPU_COMPUTE_BYTES,
    RAM_HEADROOM,
    WEIGHTS_MARGIN,
    draft_need,
    fits_gpu,
    fits_ram,
    layers_that_fit,
    target_need,
)
from engine.runtime.model_info import ModelFacts
from tests.conftest import PROFILES

GiB = 2**30
N_CTX = 4096
# A 7-8B-shaped header: 32 layers, 8 KV heads of 128 (~0.3 GiB of Tandem's cache at 4096).
FACTS = GGUFFacts(architecture="llama", n_layers=32, hidden_size=4096, n_heads=32,
                  n_kv_heads=8, head_dim_k=128, head_dim_v=128, context_length=8192,
                  vocab_size=32000)
DRAFT_FACTS = replace(FACTS, n_layers=16, hidden_size=1024, n_heads=16, n_kv_heads=4,
                      head_dim_k=64, head_dim_v=64)


def test_the_need_is_weights_with_the_margin_kv_and_compute() -> None:
    assert target_need(4 * GiB, GiB // 2) == (int(4 * GiB * WEIGHTS_MARGIN) + GiB // 2
                                              + COMPUTE_OVERHEAD_BYTES)


def test_a_need_just_under_the_free_vram_fits_and_just_over_does_not() -> None:
    need = target_need(7 * GiB, GiB // 4)
    assert fits_gpu(need, need) and fits_gpu(need, need + 1)
    assert not fits_gpu(need + 1, need)
    # A 7 GiB model on an 8 GiB GPU fits only with a small cache: 7.7 + 0.25 GiB + KV.
    assert fits_gpu(target_need(7 * GiB, 0), 8 * GiB)
    assert not fits_gpu(target_need(7 * GiB, GiB // 4), 8 * GiB)


def test_ram_keeps_its_headroom() -> None:
    available = 10 * GiB
    assert fits_ram(available * RAM_HEADROOM, available)
    assert not fits_ram(available * RAM_HEADROOM + 1, available)
    assert not fits_ram(available, available)  # the OS and programs keep a share


def test_layers_that_fit_agree_with_the_whole() -> None:
    weights, kv, n = 4 * GiB, GiB // 2, 32
    need = target_need(weights, kv)
    assert layers_that_fit(weights, kv, n, need) == n
    assert layers_that_fit(weights, kv, n, need - 1) == n - 1
    assert 0 < layers_that_fit(weights, kv, n, need // 2) < n
    assert layers_that_fit(weights, kv, n, COMPUTE_OVERHEAD_BYTES) == 0
    assert layers_that_fit(weights, kv, n, 0) == 0


def _hardware(free_vram: int) -> HardwareProfile:
    hw = load_profile(PROFILES / "synthetic_large_gpu.json")
    return replace(hw, gpus=tuple(replace(g, free_bytes=free_vram) for g in hw.gpus))


def _costs() -> CostProfile:
    data = json.loads((PROFILES / "synthetic_costs_large_gpu_1p7b.json").read_text())
    return CostProfile.from_json(data)


@pytest.mark.parametrize("delta", [-1, 0, 1, 64 << 20])
def test_the_wizards_gpu_label_and_the_planners_placement_agree(delta: int) -> None:
    """A model whose need is just under, exactly at or over the free VRAM: the wizard
    says "fits on GPU" exactly when the plan puts the whole target there."""
    weights = 6 * GiB
    kv = kv_cache_bytes(FACTS, N_CTX, weights)
    free = target_need(weights, kv) - delta
    memory = MachineMemory(ram_total=64 * GiB, ram_available=32 * GiB, vram_free=free)
    label = estimate_fit(weights, 0, N_CTX, FACTS, memory).label
    plan = choose_plan(_hardware(free), _costs(), ModelFacts(weights, 32, kv), None)
    assert (label == FITS_GPU) == (plan.target_gpu_layers == -1) == (delta <= 0)
    assert label in (FITS_GPU, FITS_RAM)


@pytest.mark.parametrize("delta", [-1, 0, 1, 64 << 20])
def test_with_a_draft_model_the_label_and_the_placement_agree(delta: int) -> None:
    """Target and draft model both on the GPU (the wizard's "fits on GPU") exactly when
    the planner's GPU placement of the draft leaves room for every target layer."""
    weights, draft_bytes = 6 * GiB, GiB // 2
    kv = kv_cache_bytes(FACTS, N_CTX, weights)
    draft_kv = kv_cache_bytes(DRAFT_FACTS, N_CTX, draft_bytes, "f16", "f16")
    free = target_need(weights, kv) + draft_need(draft_bytes, draft_kv) - delta
    memory = MachineMemory(ram_total=64 * GiB, ram_available=32 * GiB, vram_free=free)
    fit = estimate_fit(weights, 0, N_CTX, FACTS, memory, draft_bytes=draft_bytes,
                       draft_facts=DRAFT_FACTS)
    placements = _draft_placements(_hardware(free), ModelFacts(weights, 32, kv),
                                   DraftModelFacts("draft.gguf", draft_bytes, draft_kv))
    dovetail = [layers for layout, _, layers, _ in placements if layout == "dovetail"]
    assert dovetail and (fit.label == FITS_GPU) == (dovetail[0] == -1) == (delta <= 0)


def test_too_large_for_both() -> None:
    memory = MachineMemory(ram_total=16 * GiB, ram_available=8 * GiB, vram_free=4 * GiB)
    assert estimate_fit(8 * GiB, 0, N_CTX, FACTS, memory).label == TOO_LARGE


def _model_info(facts: GGUFFacts, size_bytes: int):  # noqa: ANN202
    from pathlib import Path

    from engine.runtime.model_info import ModelInfo

    return ModelInfo(Path("/models/seven-b.gguf"), size_bytes, facts, 32000, None,  # type: ignore[arg-type]
                     frozenset())


def test_a_context_counts_its_attention_scores_and_the_f16_context_by_the_targets_rules(
) -> None:
    """On the CPU with ggml's own kernels and a float V the target runs without flash
    attention: a batch's scores over the whole cache are counted (256 rows x n_ctx x 32
    heads of F32), no F16 context; with a quantized V (flash attention) the F16 context's
    cache instead, and so with Tandem's tiled kernel (flash attention on: no scores)."""
    from engine.planning.memory_plan import planned_memory
    from engine.runtime.llama_bindings import use_tiled_attention

    info = _model_info(FACTS, 4 * GiB)
    tiled = planned_memory(info, N_CTX, "q8_0", "f16")
    assert tiled.attention == 0
    assert tiled.prefill_kv == 2 * kv_cache_bytes(FACTS, N_CTX, 4 * GiB, "f16", "f16") + tiled.kv
    use_tiled_attention(False)
    try:
        _ggml_paths(info)
    finally:
        use_tiled_attention(True)


def _ggml_paths(info) -> None:  # noqa: ANN001
    from engine.planning.memory_plan import planned_memory

    cpu = planned_memory(info, N_CTX, "q8_0", "f16")
    assert cpu.attention == 256 * N_CTX * 32 * 4 and cpu.prefill_kv == 0
    assert cpu.kv == kv_cache_bytes(FACTS, N_CTX, 4 * GiB, "q8_0", "f16")
    quantized = planned_memory(info, N_CTX, "q8_0", "q8_0")
    assert quantized.attention == 0
    f16 = kv_cache_bytes(FACTS, N_CTX, 4 * GiB, "f16", "f16")
    # Its cache, and a move's two buffers: the F16 cells and the converted ones.
    assert quantized.prefill_kv == 2 * f16 + quantized.kv
    assert cpu.total == (int(4 * GiB * WEIGHTS_MARGIN) + cpu.kv + cpu.attention
                         + CPU_COMPUTE_BYTES)
    # A GPU's compute buffers keep the allowance (not measured here).
    assert planned_memory(info, N_CTX, "q8_0", "f16", on_cpu=False).compute == \
        COMPUTE_OVERHEAD_BYTES
    # Twice the context: the cache and the scores twice, the weights the same.
    double = planned_memory(info, 2 * N_CTX, "q8_0", "f16")
    assert double.total - cpu.total == cpu.kv + cpu.attention


def test_a_context_larger_than_memory_is_refused_with_the_one_that_fits() -> None:
    from engine.errors import ContextTooLargeError, ModelLoadError
    from engine.planning.memory_plan import check_context_fits, planned_memory

    info = _model_info(FACTS, 4 * GiB)
    need = planned_memory(info, 8192, "q8_0", "f16").total
    ram = int(need / RAM_HEADROOM) - 1  # one byte short of the 8192-token context
    with pytest.raises(ContextTooLargeError) as refused:
        check_context_fits(info, 8192, "q8_0", "f16", ram)
    fits = refused.value.n_ctx_fits
    assert 0 < fits < 8192 and fits % 256 == 0
    assert f"at most {fits} tokens" in str(refused.value)
    assert isinstance(refused.value, ModelLoadError)  # callers' fallbacks catch it
    assert check_context_fits(info, fits, "q8_0", "f16", ram).total <= ram * RAM_HEADROOM
    with pytest.raises(ContextTooLargeError):
        check_context_fits(info, fits + 256, "q8_0", "f16", ram)
    with pytest.raises(ContextTooLargeError, match="no context fits"):
        check_context_fits(info, 8192, "q8_0", "f16", GiB)


def test_parallel_lanes_take_a_cache_each_and_are_capped_to_the_memory_left() -> None:
    """``serve --parallel N``: the lanes' context holds a whole cache per lane (and a
    compute buffer); as many lanes as the RAM left after the model loaded holds."""
    from engine.planning.memory_plan import lanes_memory, lanes_that_fit

    info = _model_info(FACTS, 4 * GiB)
    kv = info.kv_bytes(N_CTX, "q8_0", "f16")
    assert lanes_memory(info, N_CTX, "q8_0", "f16", 4) == 4 * kv + CPU_COMPUTE_BYTES
    room_for_three = int(lanes_memory(info, N_CTX, "q8_0", "f16", 3) / RAM_HEADROOM) + 1
    assert lanes_that_fit(info, N_CTX, "q8_0", "f16", 8, room_for_three) == 3
    assert lanes_that_fit(info, N_CTX, "q8_0", "f16", 2, room_for_three) == 2
    assert lanes_that_fit(info, N_CTX, "q8_0", "f16", 8, CPU_COMPUTE_BYTES) == 0


def test_a_sliding_window_model_is_planned_with_flash_attention() -> None:
    """The rule keeps flash attention on for a sliding-window model (it skips the cells
    outside a window): no attention scores over the whole cache, and long prompts read in
    the F16 context, whose cache and move buffers are counted."""
    from engine.planning.memory_plan import planned_memory

    windowed = planned_memory(_model_info(replace(FACTS, sliding_window=512), 4 * GiB),
                              N_CTX, "q8_0", "f16")
    assert windowed.attention == 0 and windowed.prefill_kv > 0
