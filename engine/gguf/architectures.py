"""Tiny GGUF files of the architectures people download, in each one's real tensor layout.

llama.cpp loads a file only when every tensor it asks for is there with its exact shape and
no other tensor is (``wrong number of tensors``), and every key has its exact type. These
layouts follow the vendored llama.cpp's loaders (``src/models/<arch>.cpp``): attention with
q/k norms (qwen3), mixtures of experts (qwen3moe, gpt-oss, glm4moe), sliding windows (gemma3,
gpt-oss), short convolutions (lfm2) and gated delta nets (qwen35) beside attention, fused
q/k/v and gate/up (phi3). Sizes are tiny (a few MB besides the vocabulary) so a test loads
and decodes one in well under a second; weights are random F32 that keep activations near
unit size, so llama.cpp's quantize can requantize them to any type.

The vocabulary is another GGUF's (the bundled model's): it decides nothing about layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.gguf.synthetic import copy_tokenizer

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "gpt-oss", "qwen35", "lfm2",
                 "phi3", "glm4moe", "deepseek2")
# Architectures whose GGUFs may carry next-token (MTP) blocks Tandem can write.
MTP_LAYOUTS = ("qwen35", "glm4moe", "deepseek2")
# Recurrent without state snapshots: loads and decodes, cannot take back a draft.
PLAIN_ONLY_ARCHITECTURES = ("mamba",)


@dataclass(frozen=True)
class TinyShape:
    """A layout's sizes; the defaults are tiny (head size 64 suits every backend's
    kernels). ``REAL_SHAPES`` holds shapes of real models, to measure speed on."""

    hidden: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 512
    n_experts: int = 4
    n_experts_used: int = 2
    expert_ffn: int = 128
    window: int = 32  # sliding window: short, so tests cross its edge quickly
    window_pattern: int = 2  # every n-th layer attends fully, the others are windowed
    context: int = 4096
    key_length: int = 0  # head size when not hidden / heads (gemma3, qwen3, qwen35)
    # Gated delta net (qwen35): state size, key and value heads, convolution; and which
    # layers attend (every n-th).
    ssm_state: int = 64
    ssm_k_heads: int = 2
    ssm_v_heads: int = 4
    ssm_conv: int = 4
    attention_interval: int = 2
    # lfm2's attention layers; empty: every other layer (the rest are convolutions).
    lfm2_attention: tuple[int, ...] = ()
    # Next-token (MTP) blocks after the trunk (one; qwen35, glm4moe), as their GGUFs carry.
    mtp_layers: int = 0
    # How much each layer adds to the residual stream (its output projections' scale). Near
    # 0 the next token is mostly the current one, which an MTP block built to guess that
    # (``mtp_echo``) then drafts right often: tests need drafts that are accepted.
    damp: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.n_heads


# Real models' shapes (config.json), random weights: what a decode of them costs. The
# qwen35 one is a Qwen3.5-like 2B shape, its delta-net sizes as in Qwen3-Next's config.
REAL_SHAPES: dict[str, tuple[str, TinyShape]] = {
    "gemma-3-1b": ("gemma3", TinyShape(hidden=1152, n_layers=26, n_heads=4, n_kv_heads=1,
                                       ffn=6912, key_length=256, window=512,
                                       window_pattern=6, context=32768)),
    "qwen3-1.7b": ("qwen3", TinyShape(hidden=2048, n_layers=28, n_heads=16, n_kv_heads=8,
                                      ffn=6144, key_length=128, context=40960)),
    "qwen3.5-like-2b": ("qwen35", TinyShape(hidden=2048, n_layers=24, n_heads=8,
                                            n_kv_heads=2, ffn=6144, key_length=256,
                                            ssm_state=128, ssm_k_heads=16, ssm_v_heads=16,
                                            attention_interval=4, context=32768)),
    "qwen2.5-1.5b": ("qwen2", TinyShape(hidden=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                                        ffn=8960, context=32768)),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 used; at full depth 17 GB in Q4_K, so a
    # bench here keeps the first layers (tandem synth --layers).
    "qwen3-30b-a3b": ("qwen3moe", TinyShape(hidden=2048, n_layers=48, n_heads=32,
                                            n_kv_heads=4, ffn=6144, key_length=128,
                                            n_experts=128, n_experts_used=8, expert_ffn=768,
                                            context=40960)),
    # gpt-oss-20b: 32 experts of 2880, 4 used, every other layer a 128-token window;
    # 12 GB at full depth in its MXFP4.
    "gpt-oss-20b": ("gpt-oss", TinyShape(hidden=2880, n_layers=24, n_heads=64, n_kv_heads=8,
                                         key_length=64, ffn=2880, n_experts=32,
                                         n_experts_used=4, expert_ffn=2880, window=128,
                                         window_pattern=2, context=131072)),
    # Phi-3-mini (3.8B): fused q/k/v and gate/up, 32 heads without grouping.
    "phi-3-mini": ("phi3", TinyShape(hidden=3072, n_layers=32, n_heads=32, n_kv_heads=32,
                                     ffn=8192, context=4096)),
    # LFM2-1.2B: 10 short-convolution layers, 6 attention ones (full_attn_idxs).
    "lfm2-1.2b": ("lfm2", TinyShape(hidden=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                    ffn=8192, context=128000,
                                    lfm2_attention=(2, 5, 8, 10, 12, 14))),
}


# A tensor: name, numpy shape (rows = outputs; the file's dims are reversed), how to fill.
Tensor = tuple[str, tuple[int, ...], str]


def _attention(b: str, s: TinyShape, q_norm: bool, q_rows: int | None = None) -> list[Tensor]:
    d, kv = s.head_dim, s.n_kv_heads * s.head_dim
    out = [(b + "attn_q.weight", (q_rows or s.n_heads * d, s.hidden), "matrix"),
           (b + "attn_k.weight", (kv, s.hidden), "matrix"),
           (b + "attn_v.weight", (kv, s.hidden), "matrix"),
           (b + "attn_output.weight", (s.hidden, s.n_heads * d), "matrix")]
    if q_norm:
        out += [(b + "attn_q_norm.weight", (d,), "ones"), (b + "attn_k_norm.weight", (d,), "ones")]
    return out


def _ffn(b: str, s: TinyShape) -> list[Tensor]:
    return [(b + "ffn_gate.weight", (s.ffn, s.hidden), "matrix"),
            (b + "ffn_up.weight", (s.ffn, s.hidden), "matrix"),
            (b + "ffn_down.weight", (s.hidden, s.ffn), "matrix")]


def _mtp_block(arch: str, i: int, s: TinyShape) -> list[Tensor]:
    """The next-token block ``blk.i``: eh_proj fuses the token's embedding with the
    trunk's last hidden state, then one layer like the trunk's (qwen35: gated attention
    and a dense FFN; glm4moe: attention with biases and experts); embedding, LM head and
    final norm are the trunk's (the optional ``nextn.*`` copies left out)."""
    b = f"blk.{i}."
    if arch == "qwen35":
        layer = ([_norm(b + "attn_norm.weight", s), _norm(b + "post_attention_norm.weight", s)]
                 + _attention(b, s, q_norm=True, q_rows=2 * s.n_heads * s.head_dim)
                 + _ffn(b, s))
    elif arch == "glm4moe":
        layer = _glm4moe_layer(i, s)
    else:
        layer = _deepseek2_layer(i, s)
    return layer + [(b + "nextn.eh_proj.weight", (s.hidden, 2 * s.hidden), "echo"),
                    _norm(b + "nextn.enorm.weight", s), _norm(b + "nextn.hnorm.weight", s)]


# glm4moe (GLM-4.5): the first layer dense, the rest experts with one shared expert.
GLM4MOE_DENSE_LEAD = 1


def _glm4moe_layer(i: int, s: TinyShape) -> list[Tensor]:
    """GLM-4.5's layer: attention with q/k/v biases, a post-attention norm, then a dense
    FFN (the leading layers) or sigmoid-routed experts with their score bias and a shared
    expert (src/models/glm4-moe.cpp)."""
    b = f"blk.{i}."
    kv = s.n_kv_heads * s.head_dim
    out = [_norm(b + "attn_norm.weight", s)] + _attention(b, s, q_norm=False)
    out += [(b + "attn_q.bias", (s.n_heads * s.head_dim,), "zeros"),
            (b + "attn_k.bias", (kv,), "zeros"), (b + "attn_v.bias", (kv,), "zeros"),
            _norm(b + "post_attention_norm.weight", s)]
    if i < GLM4MOE_DENSE_LEAD:
        return out + _ffn(b, s)
    return out + _experts(b, s, biases=False) + _shared_expert(b, s)


def _experts(b: str, s: TinyShape, biases: bool) -> list[Tensor]:
    x, e, f = s.n_experts, s.hidden, s.expert_ffn
    out = [(b + "ffn_gate_inp.weight", (x, e), "matrix"),
           (b + "ffn_gate_exps.weight", (x, f, e), "matrix"),
           (b + "ffn_up_exps.weight", (x, f, e), "matrix"),
           (b + "ffn_down_exps.weight", (x, e, f), "matrix")]
    if biases:
        out += [(b + "ffn_gate_inp.bias", (x,), "zeros"),
                (b + "ffn_gate_exps.bias", (x, f), "zeros"),
                (b + "ffn_up_exps.bias", (x, f), "zeros"),
                (b + "ffn_down_exps.bias", (x, e), "zeros")]
    return out


def _norm(name: str, s: TinyShape) -> Tensor:
    return (name, (s.hidden,), "ones")


# deepseek2 (DeepSeek-V3, GLM-4.7-Flash): multi-head latent attention, the form llama.cpp's
# converter writes now (k_b / v_b split, one KV head of latent + rotary values): ranks of
# the compressed query and key-value, each head's rotary and other key dimensions, its
# value size. The first layer is dense, the rest sigmoid-routed experts with a shared one.
DS_Q_LORA, DS_KV_LORA, DS_ROPE, DS_NOPE, DS_V = 128, 128, 32, 32, 64
DEEPSEEK2_DENSE_LEAD = 1


def _deepseek2_layer(i: int, s: TinyShape) -> list[Tensor]:
    b = f"blk.{i}."
    h, k_mla = s.n_heads, DS_NOPE + DS_ROPE
    out = [_norm(b + "attn_norm.weight", s),
           (b + "attn_q_a_norm.weight", (DS_Q_LORA,), "ones"),
           (b + "attn_kv_a_norm.weight", (DS_KV_LORA,), "ones"),
           (b + "attn_q_a.weight", (DS_Q_LORA, s.hidden), "matrix"),
           (b + "attn_q_b.weight", (h * k_mla, DS_Q_LORA), "matrix"),
           (b + "attn_kv_a_mqa.weight", (DS_KV_LORA + DS_ROPE, s.hidden), "matrix"),
           (b + "attn_k_b.weight", (h, DS_KV_LORA, DS_NOPE), "matrix"),
           (b + "attn_v_b.weight", (h, DS_V, DS_KV_LORA), "matrix"),
           (b + "attn_output.weight", (s.hidden, h * DS_V), "matrix"),
           _norm(b + "ffn_norm.weight", s)]
    if i < DEEPSEEK2_DENSE_LEAD:
        return out + _ffn(b, s)
    return out + _experts(b, s, biases=False) + _shared_expert(b, s)


def _shared_expert(b: str, s: TinyShape) -> list[Tensor]:
    f = s.expert_ffn
    return [(b + "exp_probs_b.bias", (s.n_experts,), "zeros"),
            (b + "ffn_gate_shexp.weight", (f, s.hidden), "matrix"),
            (b + "ffn_up_shexp.weight", (f, s.hidden), "matrix"),
            (b + "ffn_down_shexp.weight", (s.hidden, f), "matrix")]


def _layers(arch: str, s: TinyShape) -> list[Tensor]:
    out: list[Tensor] = []
    for i in range(s.n_layers):
        b = f"blk.{i}."
        if arch in ("glm4moe", "deepseek2"):
            out += _glm4moe_layer(i, s) if arch == "glm4moe" else _deepseek2_layer(i, s)
            continue
        out.append(_norm(b + "attn_norm.weight", s))
        if arch in ("llama", "qwen2", "qwen3"):
            out += _attention(b, s, q_norm=arch == "qwen3") + [_norm(b + "ffn_norm.weight", s)]
            out += _ffn(b, s)
        elif arch == "qwen3moe":
            out += _attention(b, s, q_norm=True) + [_norm(b + "ffn_norm.weight", s)]
            out += _experts(b, s, biases=False)
        elif arch == "gemma3":
            out += _attention(b, s, q_norm=True)
            out += [_norm(b + "post_attention_norm.weight", s), _norm(b + "ffn_norm.weight", s)]
            out += _ffn(b, s) + [_norm(b + "post_ffw_norm.weight", s)]
        elif arch == "gpt-oss":
            out += _attention(b, s, q_norm=False)
            out += [(b + "attn_output.bias", (s.hidden,), "zeros"),
                    (b + "attn_sinks.weight", (s.n_heads,), "zeros"),
                    _norm(b + "post_attention_norm.weight", s)]
            out += _experts(b, s, biases=True)
        elif arch == "phi3":
            kv = s.n_kv_heads * s.head_dim
            out += [(b + "attn_qkv.weight", (s.hidden + 2 * kv, s.hidden), "matrix"),
                    (b + "attn_output.weight", (s.hidden, s.hidden), "matrix"),
                    _norm(b + "ffn_norm.weight", s),
                    (b + "ffn_up.weight", (2 * s.ffn, s.hidden), "matrix"),  # gate and up
                    (b + "ffn_down.weight", (s.hidden, s.ffn), "matrix")]
        elif arch == "lfm2":
            out.append(_norm(b + "ffn_norm.weight", s))
            if _lfm2_attention(i, s):
                out += _attention(b, s, q_norm=True)
            else:
                out += [(b + "shortconv.conv.weight", (s.hidden, LFM2_CONV), "conv"),
                        (b + "shortconv.in_proj.weight", (3 * s.hidden, s.hidden), "matrix"),
                        (b + "shortconv.out_proj.weight", (s.hidden, s.hidden), "matrix")]
            out += _ffn(b, s)
        elif arch == "mamba":
            out += _selective_scan(b, s)
        elif arch == "qwen35":
            out.append(_norm(b + "post_attention_norm.weight", s))
            if _qwen35_attention(i, s):
                # Query and its output gate, interleaved per head.
                out += _attention(b, s, q_norm=True, q_rows=2 * s.n_heads * s.head_dim)
            else:
                out += _delta_net(b, s)
            out += _ffn(b, s)
        else:
            known = ", ".join(ARCHITECTURES + PLAIN_ONLY_ARCHITECTURES)
            raise ValueError(f"no tiny layout for {arch!r}; known: {known}")
    return out


# lfm2: short-convolution layers, every other one attention (its head_count_kv array says
# which: 0 for a convolution). qwen35: gated delta nets, every n-th layer attention.
LFM2_CONV = 3
QWEN35_ROPE = 64  # rotary dimensions (a quarter of a 256 head, as Qwen3-Next)


def _lfm2_attention(i: int, s: TinyShape) -> bool:
    return i in s.lfm2_attention if s.lfm2_attention else i % 2 == 1


def _qwen35_attention(i: int, s: TinyShape) -> bool:
    return (i + 1) % s.attention_interval == 0


def _delta_net(b: str, s: TinyShape) -> list[Tensor]:
    k_dim, v_dim = s.ssm_state * s.ssm_k_heads, s.ssm_state * s.ssm_v_heads
    conv = 2 * k_dim + v_dim
    return [(b + "attn_qkv.weight", (conv, s.hidden), "matrix"),
            (b + "attn_gate.weight", (v_dim, s.hidden), "matrix"),
            (b + "ssm_conv1d.weight", (conv, s.ssm_conv), "conv"),
            (b + "ssm_dt.bias", (s.ssm_v_heads,), "zeros"),
            (b + "ssm_a", (s.ssm_v_heads,), "decay"),
            (b + "ssm_beta.weight", (s.ssm_v_heads, s.hidden), "matrix"),
            (b + "ssm_alpha.weight", (s.ssm_v_heads, s.hidden), "matrix"),
            (b + "ssm_norm.weight", (s.ssm_state,), "ones"),
            (b + "ssm_out.weight", (s.hidden, v_dim), "matrix")]


MAMBA_CONV, MAMBA_STATE = 4, 16


def _selective_scan(b: str, s: TinyShape) -> list[Tensor]:
    inner, rank = 2 * s.hidden, s.hidden // 16  # llama.cpp takes an expansion of 2 only
    return [(b + "ssm_in.weight", (2 * inner, s.hidden), "matrix"),
            (b + "ssm_conv1d.weight", (inner, MAMBA_CONV), "conv"),
            (b + "ssm_conv1d.bias", (inner,), "zeros"),
            (b + "ssm_x.weight", (rank + 2 * MAMBA_STATE, inner), "matrix"),
            (b + "ssm_dt.weight", (inner, rank), "matrix"),
            (b + "ssm_dt.bias", (inner,), "zeros"),
            (b + "ssm_a", (inner, MAMBA_STATE), "decay"),
            (b + "ssm_d", (inner,), "ones"),
            (b + "ssm_out.weight", (s.hidden, inner), "matrix")]


def tensor_layout(arch: str, s: TinyShape, n_vocab: int) -> list[Tensor]:
    """Every tensor llama.cpp loads for ``arch`` at shape ``s``, no more."""
    layers = _layers(arch, s)
    final_norm = "token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight"
    out = [("token_embd.weight", (n_vocab, s.hidden), "matrix"), _norm(final_norm, s)]
    # Own LM heads (llama.cpp requires them), here the embeddings' values: a damped model
    # then repeats itself as tied ones do.
    if arch in ("gpt-oss", "glm4moe", "deepseek2"):
        out.append(("output.weight", (n_vocab, s.hidden), "tied"))
    if s.mtp_layers:
        if arch not in MTP_LAYOUTS or s.mtp_layers != 1:
            raise ValueError(f"next-token (MTP) blocks: one, on {', '.join(MTP_LAYOUTS)} only")
        layers += _mtp_block(arch, s.n_layers, s)
    return out + layers


def _write_keys(writer, arch: str, s: TinyShape) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.n_layers + s.mtp_layers)  # the MTP blocks count as blocks
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.n_heads)
    if arch == "lfm2":
        writer.add_head_count_kv([s.n_kv_heads if _lfm2_attention(i, s) else 0
                                  for i in range(s.n_layers)])
        writer.add_shortconv_l_cache(LFM2_CONV)
    else:
        writer.add_head_count_kv(1 if arch == "deepseek2" else s.n_kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch in ("qwen3moe", "gpt-oss", "glm4moe", "deepseek2"):
        writer.add_expert_count(s.n_experts)
        writer.add_expert_used_count(s.n_experts_used)
        writer.add_expert_feed_forward_length(s.expert_ffn)
    if arch in ("glm4moe", "deepseek2"):
        from gguf import ExpertGatingFuncType

        writer.add_expert_shared_count(1)
        writer.add_leading_dense_block_count(GLM4MOE_DENSE_LEAD if arch == "glm4moe"
                                             else DEEPSEEK2_DENSE_LEAD)
        writer.add_expert_weights_norm(True)
        writer.add_expert_weights_scale(1.0)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if arch == "glm4moe":
        writer.add_rope_dimension_count(s.head_dim // 2)  # GLM-4.5 rotates half a head
    if arch == "deepseek2":  # the cache holds one head: the latent and its rotary part
        writer.add_q_lora_rank(DS_Q_LORA)
        writer.add_kv_lora_rank(DS_KV_LORA)
        writer.add_key_length(DS_KV_LORA + DS_ROPE)
        writer.add_value_length(DS_KV_LORA)
        writer.add_key_length_mla(DS_NOPE + DS_ROPE)
        writer.add_value_length_mla(DS_V)
        writer.add_rope_dimension_count(DS_ROPE)
    if arch in ("gemma3", "gpt-oss"):
        writer.add_sliding_window(s.window)
        writer.add_sliding_window_pattern(s.window_pattern)
    if s.key_length and arch in ("gemma3", "qwen3", "qwen3moe", "gpt-oss"):
        writer.add_key_length(s.key_length)
        writer.add_value_length(s.key_length)
    if arch == "mamba":
        writer.add_ssm_conv_kernel(MAMBA_CONV)
        writer.add_ssm_inner_size(2 * s.hidden)
        writer.add_ssm_state_size(MAMBA_STATE)
        writer.add_ssm_time_step_rank(s.hidden // 16)
    if arch == "qwen35":
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
        writer.add_rope_dimension_count(QWEN35_ROPE)
        writer.add_rope_dimension_sections([11, 11, 10, 0])  # sum: half the rotary size
        writer.add_ssm_conv_kernel(s.ssm_conv)
        writer.add_ssm_state_size(s.ssm_state)
        writer.add_ssm_group_count(s.ssm_k_heads)
        writer.add_ssm_time_step_rank(s.ssm_v_heads)
        writer.add_ssm_inner_size(s.ssm_state * s.ssm_v_heads)
        writer.add_full_attention_interval(s.attention_interval)
    if s.mtp_layers:
        writer.add_nextn_predict_layers(s.mtp_layers)


# Projections back into the residual stream: ``damp`` scales them.
_OUTPUT_PROJECTIONS = ("attn_output.weight", "ffn_down.weight", "ssm_out.weight",
                       "shortconv.out_proj.weight", "ffn_down_exps.weight",
                       "ffn_down_shexp.weight")


def _fill(kind: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if kind == "matrix":  # outputs keep unit size: normal, scaled by 1/sqrt(inputs)
        return (rng.standard_normal(dims, np.float32) / np.sqrt(dims[-1])).astype(np.float32)
    if kind == "echo":  # eh_proj passing the token's embedding through: [I | 0]
        return np.eye(dims[0], dims[1], dtype=np.float32)
    if kind == "conv":
        return (rng.standard_normal(dims, np.float32) * 0.3).astype(np.float32)
    if kind == "decay":  # -exp(A_log): a state that forgets at a sane rate
        return -rng.uniform(0.5, 2.0, dims).astype(np.float32)
    return np.full(dims, 1.0 if kind == "ones" else 0.0, np.float32)


_Q4_K, _Q8_0, _MXFP4 = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0,
                        GGMLQuantizationType.MXFP4)


def direct_type(arch: str, name: str, dims: tuple[int, ...], kind: str
                ) -> GGMLQuantizationType | None:
    """The type ``tandem synth --direct`` writes a tensor in, as a Q4_K_M-like file has
    it: gpt-oss's experts in MXFP4 (as its files ship), other weight matrices Q4_K where
    their rows take 256-value blocks, else Q8_0 (gpt-oss's 2880-wide rows); None: F32."""
    if kind not in ("matrix", "tied"):  # (a tied head takes its embeddings' type)
        return None
    if arch == "gpt-oss" and "_exps." in name:
        return _MXFP4
    return _Q4_K if dims[-1] % 256 == 0 else _Q8_0 if dims[-1] % 32 == 0 else None


def random_blocks(kind: GGMLQuantizationType, dims: tuple[int, ...],
                  rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``kind`` for a matrix of ``dims`` (rows last-but-one) whose weights
    have the F32 fill's spread, 1/sqrt(inputs), centred. Bytes: ``dims[:-1] +
    (blocks * block bytes,)``.
    - Q4_K: every sub-block's scale and min 32 (ggml's 6-bit packing: bytes 0-7 hold
      160, 8-11 hold 0), dmin 7.5 d: a weight is 32 d (q - 7.5) for a random nibble q.
    - Q8_0: a random int8 times d.
    - MXFP4: a random 4-bit code of ggml's table (doubled values up to 12) times half
      of 2^(e - 127)."""
    values, nbytes = GGML_QUANT_SIZES[kind]
    n_blocks = int(np.prod(dims)) // values
    want = 1.0 / np.sqrt(dims[-1])
    blocks = np.empty((n_blocks, nbytes), dtype=np.uint8)
    if kind == _Q4_K:
        d = want / (32 * 4.61)  # 4.61: the std of a uniform nibble
        blocks[:, 0:4] = np.array([d, 7.5 * d], dtype=np.float16).view(np.uint8)
        blocks[:, 4:12] = 160
        blocks[:, 12:16] = 0
        head = 16
    elif kind == _Q8_0:
        blocks[:, 0:2] = np.array([want / 73.6], dtype=np.float16).view(np.uint8)
        head = 2  # 73.6: the std of a uniform int8
    else:  # 2.93 * 2^(e - 127): the std of the table's values, halved, times the scale
        blocks[:, 0] = np.uint8(127 + round(float(np.log2(want / 2.93))))
        head = 1
    blocks[:, head:] = rng.integers(0, 256, (n_blocks, nbytes - head), dtype=np.uint8)
    return blocks.reshape(*dims[:-1], dims[-1] // values * nbytes)


def write_architecture_gguf(arch: str, path: Path, tokenizer_from: Path,
                            shape: TinyShape | None = None, seed: int = 0,
                            chat_template: bool = True, name: str | None = None,
                            progress: Callable[[int, int], None] | None = None,
                            n_vocab: int | None = None, direct: bool = False) -> Path:
    """Write ``path``: a tiny ``arch`` model with random F32 weights and the tokenizer of
    ``tokenizer_from``; without ``chat_template`` the file carries none (as a base model's
    conversion often does). ``name`` is its general.name; ``n_vocab`` pads the
    vocabulary with unused tokens (Gemma 3's 262,144, say). ``direct``: the weight
    matrices are written as random quantized blocks directly (``direct_type``,
    ``random_blocks``), for shapes whose F32 file would not fit on this machine (an MoE
    of 20-30B); norms and biases stay F32."""
    from gguf import GGUFWriter

    s = shape or TinyShape()
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    # Not the architecture's name: llama.cpp sets token attributes by the model's name
    # ("phi3" wants a "</s>" token this vocabulary does not have).
    writer.add_name(name or "tiny synthetic model (random weights)")
    _write_keys(writer, arch, s)
    from gguf import LlamaFileType

    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_S if direct else LlamaFileType.ALL_F32)
    skip = () if chat_template else ("tokenizer.chat_template",)
    n_vocab = copy_tokenizer(writer, tokenizer_from, skip=skip, n_vocab=n_vocab)
    layout = tensor_layout(arch, s, n_vocab)

    types = {n: direct_type(arch, n, dims, kind) if direct else None
             for n, dims, kind in layout}
    for tensor_name, dims, _ in layout:
        quant = types[tensor_name]
        if quant is not None:
            values, nbytes = GGML_QUANT_SIZES[quant]
            row_bytes = dims[-1] // values * nbytes
            writer.add_tensor_info(tensor_name, (*dims[:-1], row_bytes), np.dtype(np.uint8),
                                   int(np.prod(dims[:-1])) * row_bytes, raw_dtype=quant)
        else:
            writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32),
                                   4 * int(np.prod(dims)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    embeddings = None
    for done, (tensor_name, dims, kind) in enumerate(layout, 1):
        # "tied": an LM head with the embeddings' values, so a damped model says its last
        # token again, as tied ones do (tests need drafts that are accepted).
        quant = types[tensor_name]
        data = (embeddings if kind == "tied" else random_blocks(quant, dims, rng)
                if quant is not None else _fill(kind, dims, rng))
        if tensor_name == "token_embd.weight":
            embeddings = data
        if s.damp != 1.0 and tensor_name.endswith(_OUTPUT_PROJECTIONS):
            if data.dtype != np.float32:
                raise ValueError("damp scales F32 weights only (not direct blocks)")
            data *= np.float32(s.damp)
        writer.write_tensor_data(data)
        if progress is not None:
            progress(done, len(layout))
    writer.close()
    return path
