"""An EAGLE-3 head in torch, computing what llama.cpp's ``eagle3`` graph computes
(vendored src/models/eagle3.cpp; docs/eagle3-notes.md), so weights trained here run there
unchanged (``engine.gguf.eagle3.write_eagle3_head``).

- fuse: g = fc · [three target layer inputs] (one vector per token);
- decode (token t, vector g) at position p: x = [RMSNorm(emb t) | RMSNorm(g)], attention
  over the head's own cache with Q, K, V from x (RoPE on adjacent pairs, ggml's "norm"
  mode), r = attention + g, h = r + SwiGLU(RMSNorm(r)); h is the vector the next level
  drafts from, logits = output · RMSNorm(h) over the draft vocabulary (``d2t``).
Shapes: B batch, T positions, E hidden, V draft vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.gguf.eagle3 import Eagle3Shape
from models.draft_head import RMSNorm


def rope_pairs(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [B, H, T, hd] by position, pairs (0,1), (2,3), ... as ggml's NORM mode."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    ang = positions.to(torch.float32)[..., None] * inv  # [T, hd/2] or [B, T, hd/2]
    if ang.dim() == 3:
        ang = ang[:, None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


class Eagle3Head(nn.Module):
    """The trainable head. ``embed`` [V_tgt, E] is the target's frozen token embedding;
    ``d2t`` [V] the target ids of the draft vocabulary; ``output`` [V, E] starts as the
    target's LM head rows for them."""

    def __init__(self, shape: Eagle3Shape, embed: torch.Tensor, lm_head: torch.Tensor,
                 d2t: torch.Tensor) -> None:
        super().__init__()
        e, hd = shape.hidden, shape.head_dim
        self.shape = shape
        self.fc = nn.Linear(3 * shape.target_hidden, e, bias=False)
        self.emb_norm = RMSNorm(e, shape.rms_eps)
        self.g_norm = RMSNorm(e, shape.rms_eps)
        self.q = nn.Linear(2 * e, shape.n_heads * hd, bias=False)
        self.k = nn.Linear(2 * e, shape.n_kv_heads * hd, bias=False)
        self.v = nn.Linear(2 * e, shape.n_kv_heads * hd, bias=False)
        self.o = nn.Linear(shape.n_heads * hd, e, bias=False)
        self.ffn_norm = RMSNorm(e, shape.rms_eps)
        self.gate = nn.Linear(e, shape.ffn, bias=False)
        self.up = nn.Linear(e, shape.ffn, bias=False)
        self.down = nn.Linear(shape.ffn, e, bias=False)
        self.out_norm = RMSNorm(e, shape.rms_eps)
        self.output = nn.Linear(e, len(d2t), bias=False)
        with torch.no_grad():
            self.output.weight.copy_(lm_head[d2t])
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("d2t", d2t.long())

    def fuse(self, layer_inputs: torch.Tensor) -> torch.Tensor:
        return self.fc(layer_inputs)

    def decode(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
               past: tuple[torch.Tensor, torch.Tensor] | None = None,
               mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """h [B, T, E] and the keys and values [B, n_kv, P+T, hd], ``past`` first. Without
        ``mask``: causal over the new positions, the whole past visible."""
        s = self.shape
        b, t, _ = g.shape
        x = torch.cat([self.emb_norm(F.embedding(tokens, self.embed)), self.g_norm(g)], -1)
        q = self.q(x).view(b, t, s.n_heads, s.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, s.n_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, s.n_kv_heads, s.head_dim).transpose(1, 2)
        q, k = rope_pairs(q, positions, s.rope_theta), rope_pairs(k, positions, s.rope_theta)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        if mask is None and t > 1:
            n_past = k.shape[2] - t
            mask = torch.ones(t, n_past + t, dtype=torch.bool, device=g.device).tril(n_past)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=s.n_heads != s.n_kv_heads)
        r = self.o(att.transpose(1, 2).reshape(b, t, -1)) + g
        n = self.ffn_norm(r)
        return r + self.down(F.silu(self.gate(n)) * self.up(n)), (k, v)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Scores [.., V] over the draft vocabulary."""
        return self.output(self.out_norm(h))

    def gguf_weights(self) -> dict[str, object]:
        """The tensors ``write_eagle3_head`` writes, in torch order, as float32 numpy."""
        names = {"fc.weight": self.fc.weight, "output_norm.weight": self.out_norm.weight,
                 "blk.0.attn_norm.weight": self.emb_norm.weight,
                 "blk.0.attn_norm_2.weight": self.g_norm.weight,
                 "blk.0.attn_q.weight": self.q.weight, "blk.0.attn_k.weight": self.k.weight,
                 "blk.0.attn_v.weight": self.v.weight,
                 "blk.0.attn_output.weight": self.o.weight,
                 "blk.0.ffn_norm.weight": self.ffn_norm.weight,
                 "blk.0.ffn_gate.weight": self.gate.weight,
                 "blk.0.ffn_up.weight": self.up.weight,
                 "blk.0.ffn_down.weight": self.down.weight,
                 "output.weight": self.output.weight, "d2t": self.d2t}
        out: dict[str, object] = {}
        for name, tensor in names.items():
            array = tensor.detach().cpu().numpy()
            out[name] = array if name == "d2t" else array.astype("float32")
        return out
