"""Public EAGLE-3 heads (a Hugging Face folder: config.json and safetensors, as the EAGLE,
SpecForge and RedHat speculators releases ship them) written as the ``eagle3`` GGUF llama.cpp
runs, for a target GGUF. llama.cpp's own converter wants the target's HF folder; a user of a
GGUF has only the GGUF, which holds all it needs: the tokenizer, the layer count and width.

The names and conventions follow the vendored converter (``conversion/llama.py``):
``midlayer.*`` (or ``layers.0.*``) is the one decoder layer, ``hidden_norm`` the fused
features' norm, q and k are permuted from Hugging Face's rotate-half order to ggml's
adjacent pairs, ``d2t`` holds offsets (target id - draft id) and ``t2d`` is not used.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.gguf.eagle3 import Eagle3Shape, shape_for_target, write_eagle3_head

# Hugging Face name (after the layer prefix) -> the GGUF tensor Tandem's writer takes.
_LAYER_NAMES = {
    "input_layernorm.weight": "blk.0.attn_norm.weight",
    "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
_TOP_NAMES = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
# Present in some releases, not used by llama.cpp's graph (the head borrows the target's
# token embedding; t2d is d2t's inverse).
_UNUSED = ("embed_tokens.weight", "model.embed_tokens.weight", "t2d")
# Variants llama.cpp's graph supports but Tandem's writer does not write yet.
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc")


def rotate_half_to_pairs(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of q or k in Hugging Face's rotate-half order -> ggml's adjacent pairs (the
    permutation llama.cpp's converter applies to llama-family attention)."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def read_checkpoint(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """config.json and every safetensors tensor of ``folder``. Raises ValueError naming
    what is missing."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json: not a Hugging Face EAGLE-3 head")
    config = json.loads(config_path.read_text())
    config = {**config, **config.get("transformer_layer_config", {})}  # speculators' nesting
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        binary = sorted(folder.glob("*.bin"))
        raise ValueError(f"{folder} has no safetensors weights" + (
            f" ({binary[0].name} is a pickle, which Tandem does not load)" if binary else ""))
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return config, tensors


def head_weights(config: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GGUF-named weights of an EAGLE-3 checkpoint's tensors; raises ValueError for a
    tensor it does not know or a variant Tandem cannot write."""
    flags = [f for f in _UNSUPPORTED_FLAGS if config.get(f)]
    if flags:
        raise ValueError(f"this head uses {', '.join(flags)}, which Tandem's writer does not "
                         "support yet")
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads", n_heads))
    out: dict[str, np.ndarray] = {}
    unknown = []
    for name, array in tensors.items():
        layer = name.removeprefix("midlayer.").removeprefix("layers.0.") \
            .removeprefix("model.layers.0.")
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = array.astype(np.float32)
        elif name == "d2t":  # offsets -> the target ids llama.cpp reads
            offsets = array.astype(np.int64).reshape(-1)
            out["d2t"] = offsets + np.arange(offsets.size, dtype=np.int64)
        elif layer != name and layer in _LAYER_NAMES:
            data = array.astype(np.float32)
            if layer == "self_attn.q_proj.weight":
                data = rotate_half_to_pairs(data, n_heads)
            elif layer == "self_attn.k_proj.weight":
                data = rotate_half_to_pairs(data, n_kv)
            out[_LAYER_NAMES[layer]] = data
        elif name not in _UNUSED:
            unknown.append(name)
    if unknown:
        raise ValueError(f"tensors an EAGLE-3 head does not have: {sorted(unknown)[:5]}")
    return out


def head_shape(config: dict, target: Path) -> Eagle3Shape:
    """The head's sizes from its config, the target layers it names (or llama.cpp's
    default for the target's depth) and the target's width from its GGUF."""
    from dataclasses import replace

    layers = config.get("eagle_aux_hidden_state_layer_ids")
    # llama.cpp's default layers for the target's depth, unless the config names them.
    base = shape_for_target(target, tuple(int(i) for i in layers) if layers else None)  # type: ignore[arg-type]
    hidden = int(config["hidden_size"])
    draft_vocab = int(config.get("draft_vocab_size") or 0)
    vocab = int(config.get("vocab_size") or 0)
    return replace(
        base, hidden=hidden, n_heads=int(config["num_attention_heads"]),
        n_kv_heads=int(config.get("num_key_value_heads", config["num_attention_heads"])),
        ffn=int(config["intermediate_size"]),
        target_hidden=int(config.get("target_hidden_size") or base.target_hidden),
        rope_theta=float(config.get("rope_theta", base.rope_theta)),
        rms_eps=float(config.get("rms_norm_eps", base.rms_eps)),
        draft_vocab=draft_vocab if draft_vocab and draft_vocab != vocab else 0)


def import_eagle3_head(folder: Path, target: Path, out: Path, matrices: str = "q8_0") -> Path:
    """Write ``out``: the EAGLE-3 head in ``folder`` as an ``eagle3`` GGUF for the target
    GGUF ``target`` (its tokenizer copied). Raises ValueError with the reason when the
    folder is not such a head or its shapes do not fit the target."""
    config, tensors = read_checkpoint(folder)
    if "draft_vocab_size" not in config or int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{folder} is not an EAGLE-3 head (its config has no draft_vocab_size "
                         "or more than one layer)")
    from dataclasses import replace

    from engine.gguf.header import read_file_facts

    shape = head_shape(config, Path(target))
    facts = read_file_facts(Path(target))
    if shape.target_hidden != facts.hidden_size:
        raise ValueError(f"{folder} reads a target of width {shape.target_hidden}; "
                         f"{Path(target).name}'s is {facts.hidden_size}")
    vocab = config.get("vocab_size")
    if vocab and facts.vocab_size and int(vocab) != facts.vocab_size:
        raise ValueError(f"{folder} was made for a vocabulary of {vocab} tokens; "
                         f"{Path(target).name} has {facts.vocab_size}")
    weights = head_weights(config, tensors)
    if "output.weight" not in weights:  # a head without its own LM head borrows the target's
        shape = replace(shape, draft_vocab=0)
        weights.pop("d2t", None)
    missing = sorted(set(shape.tensors()) - set(weights))
    if missing:
        raise ValueError(f"{folder} lacks tensors an EAGLE-3 head needs: {missing[:5]}")
    return write_eagle3_head(out, Path(target), shape, weights, matrices=matrices)
