"""Tandem's context rules (engine.runtime.native_policy) apart from the wrapper that takes
them (engine.runtime.native_context.LlamaContext makes what it is given)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.errors import ContextFullError, NativeError
from engine.runtime.native import (
    ContextParams,
    LlamaContext,
    NativeContext,
    NativeModel,
    context_params,
)


def _params(latent: bool, **asked: object) -> ContextParams:
    model = SimpleNamespace(latent_attention=latent)
    return context_params(model, n_ctx=256, n_batch=32, n_seq_max=1,  # type: ignore[arg-type]
                          n_threads=1, features=False, **asked)  # type: ignore[arg-type]


def test_tandems_cache_is_q8_0_k_f16_v_with_flash_attention():
    params = _params(False)
    assert (params.type_k, params.type_v, params.flash_attn, params.shift) == \
        ("q8_0", "f16", True, True)
    assert _params(False, flash_attn=False).flash_attn is False  # float V: as asked


def test_a_quantized_v_turns_flash_attention_on():
    assert _params(False, type_v="q8_0", flash_attn=False).flash_attn is True


def test_latent_attention_takes_ks_type_for_v_and_shifts_only_a_float_k():
    params = _params(True)
    assert (params.type_k, params.type_v, params.flash_attn, params.shift) == \
        ("q8_0", "q8_0", True, False)
    floats = _params(True, type_k="f16", type_v="q8_0", flash_attn=False)
    assert (floats.type_v, floats.flash_attn, floats.shift) == ("f16", False, True)


def test_the_wrapper_makes_what_it_is_given(model_path: Path):
    with NativeModel(model_path) as model:
        given = ContextParams(n_ctx=256, n_batch=32, n_seq_max=1, n_threads=1,
                              type_k="f16", type_v="f16", flash_attn=False, shift=False)
        with LlamaContext(model, given) as ctx:
            assert ctx.params is given and ctx.flash_attn is False
            assert not ctx.can_shift  # the caller's rule, though llama.cpp could shift
        with NativeContext(model, n_ctx=256, n_batch=32, n_seq_max=1, n_threads=1,
                           features=False) as ctx:
            assert ctx.params == _params(False)
            assert ctx.can_shift
            ctx.check_decode(0)
            with pytest.raises(ContextFullError):
                ctx.check_decode(1, 8)
            with pytest.raises(NativeError, match="invalid input batch"):
                ctx.check_decode(-1)
            with pytest.raises(NativeError, match="llama_process"):
                ctx.check_decode(2, 1, "head batch", call="llama_process")


def test_a_cpu_target_runs_flash_attention_through_the_one_kernel(model_path) -> None:  # noqa: ANN001
    """The rule (``choose_flash_attn``): on the CPU, on with Tandem's batch-invariant
    attention kernel; without it (ggml's own paths) off with the exact mode's Q8_0 K and
    F16 V, on with a quantized V (llama.cpp needs it) or an F16 K (the fast mode), on a
    GPU or workers, and as asked."""
    from engine.runtime.llama_bindings import tiled_attention_on, use_tiled_attention
    from engine.runtime.native import NativeModel, choose_flash_attn

    model = NativeModel(model_path)
    assert tiled_attention_on(), "the build lacks packaging/llama-cpp/tiled-attention.patch"
    try:
        assert choose_flash_attn(None, model, "q8_0", "f16", on_cpu=True) is True
        use_tiled_attention(False)
        assert choose_flash_attn(None, model, "q8_0", "f16", on_cpu=True) is False
        assert choose_flash_attn(None, model, "q8_0", "q8_0", on_cpu=True) is True
        assert choose_flash_attn(None, model, "f16", "f16", on_cpu=True) is True  # fast mode
        assert choose_flash_attn(None, model, "q8_0", "f16", on_cpu=False) is True
        assert choose_flash_attn(True, model, "q8_0", "f16", on_cpu=True) is True
        assert choose_flash_attn(False, model, "q8_0", "q8_0", on_cpu=True) is True  # V
    finally:
        use_tiled_attention(True)
        model.close()
    from engine.runtime.native_policy import flash_attn_by_rule

    # A sliding window keeps it: the windowed layers skip the cells outside their window.
    assert flash_attn_by_rule("q8_0", "f16", True, False, sliding_window=True) is True


def test_the_flash_attention_flag_reaches_the_target(model_path: Path) -> None:
    """``--flash-attn on|off|auto`` (every command) sets EngineConfig.flash_attn, and the
    target runs as asked; auto is the rule (on: the one attention kernel on this CPU,
    a GPU offloads). A target with it verifies trees, one without chains only."""
    import argparse

    from app.cli.common import add_model_args, engine_config

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    parser.add_argument("--drafter", default="none")
    from engine.session import Engine

    for flag in ("on", "off", "auto"):
        config = engine_config(parser.parse_args(["--model", str(model_path), "--ctx", "512",
                                                  "--flash-attn", flag]))
        assert config.flash_attn is {"on": True, "off": False, "auto": None}[flag]
        with Engine(config) as engine:
            target = engine.target
            on = {"on": True, "off": False, "auto": True}[flag]
            # The tiled kernel sums by cell layout: a CPU target verifies chains.
            assert target.flash_attn is on and target.trees is False, flag
