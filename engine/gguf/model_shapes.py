"""The shapes of models people run, as their config.json files give them.

What verifying n tokens of a 7-8B model costs on a laptop decides whether any draft pays,
and no file that size can be shipped or downloaded here. These shapes let
``engine.gguf.synthetic`` write a GGUF with exactly their matrices (random weights) so
the cost can be measured on the machine at hand."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str  # what users call it
    architecture: str  # llama.cpp's architecture ("llama", "qwen2")
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_size: int
    vocab_size: int  # the real model's; a synthetic file may use another tokenizer
    tied_embeddings: bool  # the LM head reuses the token embedding
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    rope_theta: float = 10000.0
    context_length: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def matrix_params(self, vocab_size: int | None = None) -> int:
        """Weights in the matrices (what a decode reads), embedding and LM head included."""
        d, kv = self.hidden_size, self.n_kv_heads * self.head_dim
        per_layer = d * d * 2 + d * kv * 2 + 3 * d * self.ffn_size
        vocab = vocab_size or self.vocab_size
        return self.n_layers * per_layer + vocab * d * (1 if self.tied_embeddings else 2)


# Numbers from each model's config.json on the Hugging Face Hub.
SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-3.1-8b", "llama", 4096, 32, 32, 8, 14336, 128256, False,
               rope_theta=500000.0, context_length=131072),
    ModelShape("llama-3.2-1b", "llama", 2048, 16, 32, 8, 8192, 128256, True,
               rope_theta=500000.0, context_length=131072),
    ModelShape("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 18944, 152064, False,
               qkv_bias=True, rope_theta=1000000.0, context_length=32768),
    ModelShape("qwen2.5-0.5b", "qwen2", 896, 24, 14, 2, 4864, 151936, True,
               qkv_bias=True, rope_theta=1000000.0, context_length=32768),
    ModelShape("smollm2-1.7b", "llama", 2048, 24, 32, 32, 8192, 49152, True,
               rope_theta=130000.0),
    ModelShape("smollm2-360m", "llama", 960, 32, 15, 5, 2560, 49152, True,
               rope_theta=100000.0),
    ModelShape("smollm2-135m", "llama", 576, 30, 9, 3, 1536, 49152, True,
               rope_theta=100000.0),
)}


def shape_named(name: str) -> ModelShape:
    """The shape called ``name``. Raises ValueError listing the known ones."""
    try:
        return SHAPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}") from None
