"""What Tandem's KV cache costs in memory, from a model's header: one estimate for the
planner, the wizard's fit labels and the engine."""

from __future__ import annotations

from engine.gguf.header import GGUFFacts

# Bytes per cached value by llama.cpp cache type (Q8_0: 34 bytes per block of 32).
KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32}
# Tandem's cache: K in Q8_0, V in F16 (engine.runtime.native.NativeContext says why).
TYPE_K = "q8_0"
TYPE_V = "f16"
# The two cache settings a user can choose, and what each costs.
KV_MODES = {
    "exact": (TYPE_K, TYPE_V),
    "fast": ("f16", "f16"),
}
KV_TRADE_OFF = {
    "exact": ("K cache in Q8_0: every batch size runs one attention kernel, so speculative "
              "output is identical to plain decoding; on the CPU attention runs without "
              "flash attention (faster over long contexts; drafts verified as chains) and "
              "long prompts are read in this cache with llama.cpp's prompt kernels (make "
              "install's patch), 1.7-4.8x llama-server's speed at 2-16k tokens; with flash "
              "attention (a GPU, a sliding-window model, --flash-attn on) they are read in "
              "an F16 context and moved in"),
    "fast": ("K and V in F16, as llama-server: the first token of a long prompt as fast as "
             "llama-server's, but past 512 cached tokens llama.cpp computes single-token "
             "steps on another kernel than batches (logits differ by up to ~0.7), so an "
             "answer may differ from plain decoding where two tokens nearly tie"),
}
# Without header numbers: bytes per token ~ sqrt(weight count), a fit to the caches of
# grouped-query models (SmolLM2-135M, Qwen2.5-7B, Llama-3-8B). Models without GQA are
# underestimated ~3x; their headers carry the real numbers, which are used when read.
_BYTES_PER_TOKEN_PER_SQRT_PARAM = 1.0


def kv_bytes_per_token(facts: GGUFFacts | None, weights_bytes: int,
                       type_k: str = TYPE_K, type_v: str = TYPE_V) -> float:
    """KV-cache bytes one token takes across all layers."""
    if facts is not None and facts.has_kv_shape:
        per_layer = facts.n_kv_heads * (facts.head_dim_k * KV_TYPE_BYTES[type_k]  # type: ignore[operator]
                                        + facts.head_dim_v * KV_TYPE_BYTES[type_v])  # type: ignore[operator]
        return facts.n_layers * per_layer  # type: ignore[operator]
    n_params = weights_bytes * 8 / 4.5  # ~4.5 bits per weight
    return _BYTES_PER_TOKEN_PER_SQRT_PARAM * n_params ** 0.5


def kv_cache_bytes(facts: GGUFFacts | None, n_ctx: int, weights_bytes: int,
                   type_k: str = TYPE_K, type_v: str = TYPE_V) -> int:
    """KV-cache bytes for ``n_ctx`` tokens of Tandem's cache."""
    return int(kv_bytes_per_token(facts, weights_bytes, type_k, type_v) * n_ctx)
