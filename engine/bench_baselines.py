"""llama-cpp-python's own high-level decoding, run beside Tandem's engine in the bench.

``lcp`` is ``Llama.generate`` greedy; ``lcp-lookup`` adds its ``LlamaPromptLookupDecoding``
draft (the documented settings: num_pred_tokens=10). Both load the same GGUF with the
same threads and context as the engine's target.
"""

from __future__ import annotations

import time
from typing import Any

from engine.bench import Runner
from engine.target import Target

BASELINE_NAMES = ("lcp", "lcp-lookup")


def baseline_runner(name: str, target: Target) -> Runner:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if name not in BASELINE_NAMES:
        raise ValueError(f"unknown baseline {name!r}")
    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if name == "lcp-lookup" else None
    llm = Llama(model_path=str(target.path), n_ctx=target.n_ctx, n_threads=target.n_threads,
                n_threads_batch=target.n_threads, n_batch=target.config.n_batch,
                draft_model=draft, verbose=False)
    eog = target.model.eog_ids

    def run(prompt: list[int], max_tokens: int) -> dict[str, Any]:
        llm.reset()
        tokens: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0, reset=True):
            if not tokens and not ttft:
                ttft = time.perf_counter() - t0
            if tok in eog:
                break
            tokens.append(tok)
            if len(tokens) >= max_tokens:
                break
        total = time.perf_counter() - t0
        return {"new_tokens": len(tokens), "seconds": total, "ttft_s": ttft,
                "decode_seconds": total - ttft, "mean_accepted": 0.0,
                "text": target.detokenize(tokens), "tokens": tokens}

    return run
