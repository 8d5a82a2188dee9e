"""EAGLE-style draft head with Dynamic Gating Fusion (Dovetail, method-notes section 1).

The head reads the target's post-norm feature f_t of token t and the embedding of token
t+1, fuses them, runs ``n_layers`` LLaMA decoder blocks and predicts f_{t+1}; the target's
frozen LM head (restricted to the draft vocabulary) turns that into draft logits.
Shapes: B batch, T new positions, P cached positions, d hidden, V draft vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.head_config import HeadConfig
from models.int8_linear import Int8Linear, quantize_linears


class KVBuffer:
    """One block's keys and values, preallocated for inference: ``append`` writes the new
    entries in place and returns views of all of them, so a drafting level does not copy
    the whole past (as ``torch.cat`` would). ``truncate`` drops entries from the end
    (draft-time ones, or the rejected part of a conversation)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [B, n_kv, capacity, hd]
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if self.k is None or self.v is None or end > self.k.shape[2]:
            capacity = max(256, 2 * end)
            grown_k = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
            grown_v = v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3])
            if self.k is not None and self.v is not None and self.length:
                grown_k[:, :, :self.length] = self.k[:, :, :self.length]
                grown_v[:, :, :self.length] = self.v[:, :, :self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def truncate(self, length: int) -> None:
        self.length = max(0, min(self.length, length))


# Per block: k, v [B, n_kv, P, hd] (training: new tensors each call, so autograd sees
# them), or a KVBuffer (inference: written in place).
KVCache = list[tuple[torch.Tensor, torch.Tensor]] | list[KVBuffer]


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the input (bf16 training): one fused op.
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class DynamicGatingFusion(nn.Module):
    """u = z*a + (1-z)*b, a = f W1, b = SiLU(RMSNorm(e) W2), z = sigmoid([a; b] Wz)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.emb_norm = RMSNorm(d, eps)
        self.w1 = nn.Linear(d, d, bias=False)
        self.w2 = nn.Linear(d, d, bias=False)
        self.wz = nn.Linear(2 * d, d, bias=False)

    def forward(self, feat: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        a = self.w1(feat)
        b = F.silu(self.w2(self.emb_norm(emb)))
        z = torch.sigmoid(self.wz(torch.cat([a, b], dim=-1)))
        return z * a + (1 - z) * b


class FcFusion(nn.Module):
    """EAGLE-1: fc([emb; feat]) (the embedding first, as in EAGLE's cnets1.py)."""

    def __init__(self, d: int, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * d, d, bias=bias)

    def forward(self, feat: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([emb, feat], dim=-1))


_ROPE_TABLES: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def _inverse_frequencies(hd: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))


def rope_angles(hd: int, theta: float, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, hd/2] of the positions' rotary angles. On a CPU they come
    from a table (the same float32 values) grown as positions do: computing them costs a
    drafting level more than its attention."""
    if positions.device.type != "cpu":
        ang = positions.to(torch.float32)[:, None, :, None] * _inverse_frequencies(
            hd, theta, positions.device)
        return ang.cos(), ang.sin()
    key = (hd, theta)
    table = _ROPE_TABLES.get(key)
    needed = int(positions.max()) + 1 if positions.numel() else 0
    if table is None or table[0].shape[0] < needed:
        n = max(1024, 2 * needed)
        ang = torch.arange(n, dtype=torch.float32)[:, None] * _inverse_frequencies(
            hd, theta, positions.device)
        table = _ROPE_TABLES[key] = (ang.cos(), ang.sin())
    return table[0][positions][:, None], table[1][positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, hd] (LLaMA's half-split layout) by angles from ``rope_angles``."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [B, H, T, hd] at positions [B, T]."""
    return apply_rope(x, *rope_angles(x.shape[-1], theta, positions))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: HeadConfig, input_norm: bool) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(d, cfg.rms_eps) if input_norm else nn.Identity()
        self.q = nn.Linear(d, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_eps)
        self.gate = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | KVBuffer | None,
                mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | KVBuffer]:
        cfg = self.cfg
        b, t, _ = x.shape
        h = self.input_norm(x)
        q = self.q(h).view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_angles(cfg.head_dim, cfg.rope_theta, positions)  # once for q and k
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        present: tuple[torch.Tensor, torch.Tensor] | KVBuffer
        if isinstance(past, KVBuffer):
            k, v = past.append(k, v)  # views of every entry, the new ones included
            present = past
        else:
            if past is not None:
                k = torch.cat([past[0], k], dim=2)  # [B, n_kv, P+T, hd]
                v = torch.cat([past[1], v], dim=2)
            present = (k, v)
        if mask is None and t > 1:  # causal over the new positions, full view of the past
            n_past = k.shape[2] - t
            mask = torch.ones(t, n_past + t, dtype=torch.bool, device=x.device).tril(n_past)
        # One new position sees everything: no mask. GQA without copying K/V per head.
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        h = self.post_norm(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x, present


class DraftHead(nn.Module):
    """The trainable head. ``embed`` [V_tgt, d] and ``lm_head`` [V_tgt, d] are the
    target's frozen matrices; ``d2t`` maps draft-vocabulary ids to target ids."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fusion = (DynamicGatingFusion(d, cfg.rms_eps) if cfg.fusion == "dgf"
                       else FcFusion(d, cfg.fc_bias))
        self.blocks = nn.ModuleList(DecoderBlock(cfg, input_norm=i > 0)
                                    for i in range(cfg.n_layers))
        if d2t is None:
            d2t = torch.arange(lm_head.shape[0])
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("d2t", d2t.long(), persistent=True)
        self.register_buffer("lm_head", lm_head[d2t].contiguous(), persistent=False)
        self.lm_head_int8: Int8Linear | None = None

    def to_int8(self, lm_head: bool = True) -> DraftHead:
        """Int8 weights for inference on a CPU (``models.int8_linear``): the fusion's and
        blocks' linears and, with ``lm_head``, the LM head's rows. Not trainable after."""
        quantize_linears(self.fusion)
        quantize_linears(self.blocks)
        if lm_head:
            self.lm_head_int8 = Int8Linear(self.lm_head)
        return self

    @property
    def is_int8(self) -> bool:
        return self.lm_head_int8 is not None or any(
            isinstance(m, Int8Linear) for m in self.modules())

    def new_cache(self) -> list[KVBuffer]:
        """An empty preallocated cache (one buffer per block) for inference."""
        return [KVBuffer() for _ in self.blocks]

    def forward(self, feats: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, KVCache]:
        """Predicted features [B, T, d] and the extended cache."""
        x = self.fusion(feats, F.embedding(next_tokens, self.embed))
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, positions, cache[i] if cache else None, mask)
            new_cache.append(kv)
        return x, new_cache  # type: ignore[return-value]  # one kind, as passed in

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Draft logits [.., V_draft] from predicted (post-norm) features."""
        if self.lm_head_int8 is not None:
            return self.lm_head_int8(predicted)
        return predicted @ self.lm_head.T
