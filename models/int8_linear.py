"""Int8 weights for the draft head on a CPU.

A drafting level is a handful of matrix-vector products: on a CPU its time is the bytes
of weight it reads (38 MB in float32 for the bundled head with its LM head rows). Int8
weights, one scale per output row, read a quarter of that through fbgemm's dynamic
quantization (the activations are quantized per call). Measured on this project's
2-core CPU: a 576x8192 LM head 0.57 ms -> 0.08 ms, a decoder block and fusion
1.3 ms -> 0.5 ms; top-1 agreement with the float head about 0.9 (drafts only: the target
still verifies every token, so output is unchanged).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def int8_available() -> bool:
    """Whether this torch build has a CPU engine for dynamic int8 linears."""
    engines = torch.backends.quantized.supported_engines
    return any(e in engines for e in ("x86", "fbgemm"))


class Int8Linear(nn.Module):
    """``x @ weight.T + bias`` with the weight stored as int8 rows and float scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float().cpu()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch 2.13 warns that quantized tensors will go in a later release; the
            # pinned torch has them, and int8_available() is asked before this runs.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        b = None if bias is None else bias.detach().float().cpu()
        self.out_features, self.in_features = w.shape
        self._packed = torch.ops.quantized.linear_prepack(qweight, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: fbgemm's 7-bit activations, which its int16 accumulation needs.
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed, True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by an ``Int8Linear`` in place; how
    many were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child.weight, child.bias))
            replaced += 1
        else:
            replaced += quantize_linears(child)
    return replaced
