"""Public EAGLE-3 heads (a Hugging Face folder: config.json and safetensors) written as the
``eagle3`` GGUF llama.cpp runs, from the target GGUF alone (engine.gguf.eagle3_import):
the same weights written directly and imported from the Hugging Face layout give the same
bytes, the imported head drafts losslessly, and a head for another target is refused with
the reason (issue 35, item 1)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.eagle3 import Eagle3Drafter, draft_vocabulary_ids
from engine.drafters.native_head import HeadChainConfig
from engine.gguf.eagle3 import shape_for_target, write_eagle3_head
from engine.gguf.eagle3_import import import_eagle3_head
from engine.gguf.header import read_tensor_infos

DRAFT_VOCAB = 512


def _hf_checkpoint(folder: Path, weights: dict[str, np.ndarray], shape, **extra) -> Path:  # noqa: ANN001, ANN003
    """The layout EAGLE's releases use: midlayer.*, rotate-half q/k, d2t as offsets."""
    def to_rotate_half(w: np.ndarray, n_heads: int) -> np.ndarray:
        return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    names = {"blk.0.attn_norm.weight": "midlayer.input_layernorm.weight",
             "blk.0.attn_norm_2.weight": "midlayer.hidden_norm.weight",
             "blk.0.attn_v.weight": "midlayer.self_attn.v_proj.weight",
             "blk.0.attn_output.weight": "midlayer.self_attn.o_proj.weight",
             "blk.0.ffn_norm.weight": "midlayer.post_attention_layernorm.weight",
             "blk.0.ffn_gate.weight": "midlayer.mlp.gate_proj.weight",
             "blk.0.ffn_up.weight": "midlayer.mlp.up_proj.weight",
             "blk.0.ffn_down.weight": "midlayer.mlp.down_proj.weight",
             "fc.weight": "fc.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
    hf = {hf_name: weights[name] for name, hf_name in names.items()}
    hf["midlayer.self_attn.q_proj.weight"] = to_rotate_half(weights["blk.0.attn_q.weight"],
                                                            shape.n_heads)
    hf["midlayer.self_attn.k_proj.weight"] = to_rotate_half(weights["blk.0.attn_k.weight"],
                                                            shape.n_kv_heads)
    ids = weights["d2t"]
    hf["d2t"] = ids - np.arange(ids.size, dtype=np.int64)
    hf["t2d"] = np.zeros(49152, dtype=bool)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in hf.items()},
              str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": shape.hidden,
              "num_attention_heads": shape.n_heads, "num_key_value_heads": shape.n_kv_heads,
              "intermediate_size": shape.ffn, "num_hidden_layers": 1,
              "rms_norm_eps": shape.rms_eps, "rope_theta": shape.rope_theta,
              "vocab_size": 49152, "draft_vocab_size": DRAFT_VOCAB,
              "eagle_aux_hidden_state_layer_ids": list(shape.target_layers), **extra}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def weights_and_shape(model_path: Path):
    shape = replace(shape_for_target(model_path, (2, 15, 27)), draft_vocab=DRAFT_VOCAB)
    rng = np.random.default_rng(1)
    weights = {name: (rng.standard_normal(dims) / np.sqrt(dims[-1])).astype(np.float32)
               for name, dims in shape.tensors().items() if name != "d2t"}
    weights["d2t"] = np.sort(rng.choice(49152, DRAFT_VOCAB, replace=False)).astype(np.int64)
    return weights, shape


def test_an_imported_head_is_byte_for_byte_the_directly_written_one(
        model_path: Path, tmp_path: Path, weights_and_shape) -> None:
    weights, shape = weights_and_shape
    direct = write_eagle3_head(tmp_path / "direct.gguf", model_path, shape, weights,
                               matrices="f32")
    folder = _hf_checkpoint(tmp_path / "hf-head", weights, shape)
    imported = import_eagle3_head(folder, model_path, tmp_path / "imported.gguf", "f32")
    tables = [read_tensor_infos(p) for p in (direct, imported)]
    assert tables[0] is not None and tables[1] is not None
    (start_a, infos_a), (start_b, infos_b) = tables
    assert [(t.name, t.dims, t.ggml_type) for t in infos_a] == \
           [(t.name, t.dims, t.ggml_type) for t in infos_b]
    a, b = direct.read_bytes(), imported.read_bytes()
    for ta, tb in zip(infos_a, infos_b, strict=True):
        assert a[start_a + ta.offset:start_a + ta.offset + ta.n_bytes] == \
               b[start_b + tb.offset:start_b + tb.offset + tb.n_bytes], ta.name
    assert np.array_equal(draft_vocabulary_ids(imported), weights["d2t"])


def test_an_imported_head_drafts_losslessly(model_path: Path, tmp_path: Path, target,
                                           weights_and_shape) -> None:
    weights, shape = weights_and_shape
    folder = _hf_checkpoint(tmp_path / "hf-head", weights, shape)
    head = import_eagle3_head(folder, model_path, tmp_path / "head.gguf")  # Q8_0
    prompt = target.tokenize("The capital of France is Paris. The capital of Italy is")
    target.reset()
    target.set_features(False)
    plain = generate(target, prompt, None, GenerationConfig(16)).tokens
    # Random weights: every draft is a guess, proposed whatever its probability.
    drafter = Eagle3Drafter(head, target, HeadChainConfig(p_min=0.0, dynamic_depth=False))
    try:
        target.reset()
        out = generate(target, prompt, drafter, GenerationConfig(16),
                       cost=VerifyCostModel(slope=0.0, learn=False))
    finally:
        drafter.close()
    assert out.tokens == plain
    assert sum(s.n_proposed for s in out.stats.steps) > 0


def test_heads_that_do_not_fit_are_refused_with_the_reason(
        model_path: Path, tmp_path: Path, weights_and_shape) -> None:
    weights, shape = weights_and_shape
    wide = _hf_checkpoint(tmp_path / "wide", weights, shape, target_hidden_size=4096)
    with pytest.raises(ValueError, match="reads a target of width 4096"):
        import_eagle3_head(wide, model_path, tmp_path / "x.gguf")
    other = _hf_checkpoint(tmp_path / "other", weights, shape, vocab_size=128256)
    with pytest.raises(ValueError, match="vocabulary of 128256 tokens"):
        import_eagle3_head(other, model_path, tmp_path / "x.gguf")
    variant = _hf_checkpoint(tmp_path / "variant", weights, shape, norm_before_residual=True)
    with pytest.raises(ValueError, match="norm_before_residual"):
        import_eagle3_head(variant, model_path, tmp_path / "x.gguf")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickle"):
        import_eagle3_head(pickled, model_path, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_tandem_models_import_eagle3_and_drafters_finds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        weights_and_shape) -> None:
    from app.cli.models import main

    weights, shape = weights_and_shape
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    folder = _hf_checkpoint(tmp_path / "EAGLE3-SmolLM2", weights, shape)
    assert main(["import-eagle3", str(folder)]) == 0
    written = tmp_path / "home" / "heads" / "EAGLE3-SmolLM2.eagle3.gguf"
    assert written.is_file() and str(written) in capsys.readouterr().out
    assert main(["drafters"]) == 0
    eagle3 = next(line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("eagle3"))
    assert "yes" in eagle3 and "EAGLE3-SmolLM2.eagle3.gguf" in eagle3
