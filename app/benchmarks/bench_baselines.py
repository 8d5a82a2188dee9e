"""llama-cpp-python's own high-level decoding, run beside Tandem's engine in the bench.

``lcp`` is ``Llama.generate`` greedy; ``lcp-lookup`` adds its ``LlamaPromptLookupDecoding``
draft (the documented settings: num_pred_tokens=10). Both load the same GGUF with the
same threads and context as the engine's target.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from app.benchmarks.bench import Runner
from engine.runtime.native import TILED_MM_SET_BY_USER
from engine.runtime.target import Target

BASELINE_NAMES = ("lcp", "lcp-lookup")
# The longest a llama-server answer may take before the bench calls it hung.
ANSWER_TIMEOUT_S = 3600


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

    def run(prompt: list[int], max_tokens: int, remember: bool = True,
            warm: list[int] | None = None, grammar: str | None = None) -> dict[str, Any]:
        if grammar is not None:
            return {"skipped": f"{name}: no grammar in this baseline"}
        try:
            return generate_once(prompt, max_tokens, warm)
        except Exception as exc:  # a baseline's crash is a result, not the bench's end
            return {"skipped": f"{name} failed: {type(exc).__name__}: {exc}"}

    def generate_once(prompt: list[int], max_tokens: int, warm: list[int] | None
                      ) -> dict[str, Any]:
        llm.reset()
        if warm:  # a follow-up turn: generate(reset=True) reuses the longest cached prefix
            llm.eval(warm)
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


SERVER_NAMES = ("server", "server-ngram", "server-f16")


class LlamaServer:
    """A ``llama-server`` process of llama.cpp's own, on a free loopback port."""

    def __init__(self, binary: str, model: str, n_ctx: int, n_threads: int,
                 extra: list[str], type_k: str = "f16", type_v: str = "f16",
                 n_parallel: int = 1) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [binary, "-m", model, "-c", str(n_ctx), "-t", str(n_threads), "-tb",
               str(n_threads), "-np", str(n_parallel), "--host", "127.0.0.1",
               "--port", str(self.port),
               "--no-webui", "--cache-type-k", type_k, "--cache-type-v", type_v, *extra]
        # The peer runs as its users run it: not with the kernel switch Tandem sets for
        # itself (engine.runtime.native), unless the user set it.
        env = dict(os.environ)
        if not TILED_MM_SET_BY_USER:
            env.pop("GGML_CPU_TILED_MM", None)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        raise RuntimeError("llama-server did not become ready")

    def complete(self, prompt: list[int], max_tokens: int, cache_prompt: bool = False,
                 grammar: str | None = None) -> dict[str, Any]:
        import json
        import urllib.request

        fields = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                  "top_k": 1, "cache_prompt": cache_prompt, "return_tokens": True,
                  "samplers": ["top_k"]}
        if grammar is not None:  # the same GBNF as Tandem's
            fields["grammar"] = grammar
        body = json.dumps(fields).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        # A 16k-token prompt with flash attention over a Q8_0 K took llama-server over
        # 10 minutes on 2 cores (the 1.7B shape); an hour is a hung server.
        with urllib.request.urlopen(req, timeout=ANSWER_TIMEOUT_S) as resp:
            return json.loads(resp.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # still reading a prompt: it ignores SIGTERM
                self.proc.kill()
                self.proc.wait()


def server_runner(name: str, target: Target, binary: str) -> Runner:
    """llama.cpp's ``llama-server``: plain, or with ``--spec-type ngram-mod``, or plain
    with its default F16/F16 cache (``server-f16``: the first token users get from it).

    ``server`` and ``server-ngram`` get the target's KV-cache types (``--kv-cache``): the
    cache's numbers decide greedy near-ties, so with other types it writes another answer
    (with llama-server's default F16 K, most dev answers differed from Tandem's exact
    mode; docs/benchmarks.md: figures behind the code's rules, "The bench"), and a speed
    comparison on different texts mostly measures which text loops.
    Times are the server's own (``timings``): prompt processing is the TTFT, generation
    time the decode time; no HTTP overhead is charged to it.
    """
    if name not in SERVER_NAMES:
        raise ValueError(f"unknown server baseline {name!r}")
    extra = ["--spec-type", "ngram-mod"] if name == "server-ngram" else []
    types = (("f16", "f16") if name == "server-f16"
             else (target.config.type_k, target.config.type_v))
    server = LlamaServer(binary, str(target.path), target.n_ctx, target.n_threads, extra,
                         *types)
    import atexit

    atexit.register(server.close)

    def run(prompt: list[int], max_tokens: int, remember: bool = True,
            warm: list[int] | None = None, grammar: str | None = None) -> dict[str, Any]:
        # llama-server cannot forget: its n-gram pool keeps every request (never repeat it)
        if warm:  # a follow-up turn: the slot holds the conversation, as its users get
            server.complete(warm, 0, cache_prompt=True)
        out = server.complete(prompt, max_tokens, cache_prompt=bool(warm), grammar=grammar)
        timing = out["timings"]
        tokens = list(out.get("tokens", []))
        ttft = timing["prompt_ms"] / 1000
        decode = timing["predicted_ms"] / 1000
        drafted = timing.get("draft_n", 0)
        accepted = timing.get("draft_n_accepted", 0)
        return {"new_tokens": timing["predicted_n"], "seconds": ttft + decode,
                "ttft_s": ttft, "decode_seconds": decode,
                "mean_accepted": 0.0, "draft_n": drafted, "draft_accepted": accepted,
                "reused": timing.get("cache_n", 0),
                "text": out.get("content", ""), "tokens": tokens}

    run.pid = server.proc.pid  # type: ignore[attr-defined]  # its memory, read by benches
    return run
