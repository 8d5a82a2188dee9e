"""Long prompts as bench prompts: a question after 2k, 8k, 16k and 32k tokens of source
code and a licence, and the memory a process takes to answer them.

The text is files every machine has (the Python standard library's sources and licence),
joined in a fixed order and cut at a line's end, then sent as the window sends an
attached file (``app.documents.context.compose_turn``, whole). A size runs where the
model's trained context holds it with room for the answer; the largest such prompt comes
as close to the context as the answer allows. Peak memory is the process's high-water
mark (Linux's VmHWM, reset before a run): llama-server's own process, and for Tandem a
child process per runner that loads the engine and answers the largest prompt, so two
runners' models never share one count.
"""

from __future__ import annotations

import multiprocessing
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.documents.context import compose_turn
from app.documents.records import Attachment
from training.spec_bench import BenchPrompt

_STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Prompt sizes in tokens (2k, 8k, 16k, 32k), each where the model's context allows.
LONG_SIZES = (2048, 8192, 16384, 32768)
# Files joined in this order: plain text, then code of many kinds (over 32k tokens).
_FILES = ("LICENSE.txt", "argparse.py", "textwrap.py", "shlex.py", "glob.py",
          "dataclasses.py", "typing.py", "inspect.py", "pathlib/__init__.py", "pathlib.py",
          "subprocess.py", "tarfile.py")
QUESTION = ("Explain what the code above is for, naming its main classes and functions and "
            "what each does.")
# Tokens the chat template and the question add around the document, kept free.
_FRAME_TOKENS = 96


def size_label(size: int) -> str:
    return f"ctx-{size // 1024}k"


def long_text() -> str:
    """The standard library's licence and sources, joined (those present)."""
    parts = []
    for name in _FILES:
        path = _STDLIB / name
        if path.is_file():
            parts.append(f"# {name}\n" + path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(parts)


def cut_lines(text: str, n_tokens: int, count: Callable[[str], int]) -> str:
    """The longest start of ``text`` ending at a line's end within ``n_tokens``
    (a binary search over line ends: counting 32k tokens is not free)."""
    ends = [i for i, ch in enumerate(text) if ch == "\n"]
    lo, hi = 0, len(ends)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[:ends[mid - 1]]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text[:ends[lo - 1]] if lo else ""


def prompt_sizes(n_ctx_train: int, max_tokens: int,
                 sizes: tuple[int, ...] = LONG_SIZES) -> list[tuple[int, int]]:
    """(size, document tokens) for each size the model's context holds with the answer:
    the document fills the size, or what the context leaves (at least three quarters)."""
    room = n_ctx_train - max_tokens - _FRAME_TOKENS
    out = []
    for size in sizes:
        tokens = min(size - _FRAME_TOKENS, room)
        if tokens >= size * 3 // 4:
            out.append((size, tokens))
    return out


def long_prompts(count: Callable[[str], int], n_ctx_train: int, max_tokens: int,
                 sizes: tuple[int, ...] = LONG_SIZES) -> list[BenchPrompt]:
    """A question after a document of each size the model allows; ``count`` gives a
    text's tokens (the target's tokenizer)."""
    text = long_text()
    prompts = []
    for size, n_doc in prompt_sizes(n_ctx_train, max_tokens, sizes):
        document = cut_lines(text, n_doc, count)
        attachment = Attachment(0, 0, None, "stdlib-sources.py", "code", document)
        turn = compose_turn(QUESTION, [attachment], 1 << 30, len, lambda _q, _n: []).text
        prompts.append(BenchPrompt(f"{size_label(size)}/stdlib", size_label(size), [turn]))
    return prompts


def bench_context(n_ctx_train: int, max_tokens: int, sizes: tuple[int, ...]) -> int:
    """The context every runner gets: the largest prompt and its answer."""
    fitting = prompt_sizes(n_ctx_train, max_tokens, sizes)
    if not fitting:
        raise ValueError(f"the model's context ({n_ctx_train} tokens) holds none of the "
                         f"sizes {', '.join(map(str, sizes))}")
    return min(n_ctx_train, fitting[-1][0] + max_tokens + _FRAME_TOKENS)


# --- peak memory ------------------------------------------------------------------------

def reset_peak(pid: int) -> None:
    """Start ``pid``'s high-water mark of resident memory again from now (Linux)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_bytes(pid: int) -> int:
    """``pid``'s high-water mark of resident memory (VmHWM), 0 where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _answer_in_child(spec: str, base: Any, prompt: list[int], max_tokens: int,
                     out: Any) -> None:
    """In a child process: load ``spec``'s engine, answer ``prompt``, send the peak."""
    import os

    from app.benchmarks.bench import runner_engine_config
    from engine.decoding.generation import GenerationConfig
    from engine.planning.memory_plan import engine_memory
    from engine.session import Engine

    try:
        import torch  # noqa: F401  # as the app runs: the interpreter and torch before a model

        start = peak_bytes(os.getpid())
        with Engine(runner_engine_config(spec, base)) as engine:
            loaded = peak_bytes(os.getpid())
            engine.generate(prompt, GenerationConfig(max_tokens=max_tokens), remember=False)
            out.put({"peak_bytes": peak_bytes(os.getpid()), "loaded_bytes": loaded,
                     "start_bytes": start,
                     "predicted": engine_memory(engine.model, engine.target, engine.setup.spec,
                                                engine.config.draft_model).parts()})
    except Exception as exc:  # a runner that fails here is a row, not the bench's end
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def engine_peak(spec: str, base: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The peak memory of a process that loads ``spec``'s engine and answers ``prompt``
    (a fresh child, so nothing else in this process counts), and what the engine's plan
    predicted it would need."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_answer_in_child,
                        args=(spec, replace(base, memory_dir=Path(tempfile.mkdtemp(
                            prefix="tandem-peak-memory-"))), prompt, max_tokens, queue))
    child.start()
    try:
        result = queue.get(timeout=3600)
    finally:
        child.join(timeout=60)
    return result


def _ratio(value: float, ref_value: float | None, lower_better: bool = False) -> str:
    """`` 1.05x``: ours against the peer's (higher is better for us), or nothing."""
    if not ref_value or not value:
        return ""
    return f" {(ref_value / value if lower_better else value / ref_value):.2f}x"


def _row_cells(r: dict[str, Any], ref: dict[str, Any] | None) -> tuple[str, str, str]:
    """Prompt tok/s, first token ms and decode tok/s of a row, with ratios to ``ref``."""
    pp = r["n_prompt"] / r["ttft_s"] if r["ttft_s"] else 0.0
    pp_ref = ref["n_prompt"] / ref["ttft_s"] if ref and ref["ttft_s"] else None
    return (f"{pp:.0f}" + _ratio(pp, pp_ref),
            f"{r['ttft_s'] * 1000:.0f}" + _ratio(r["ttft_s"], ref and ref["ttft_s"], True),
            f"{r['tok_per_s']:.1f}" + _ratio(r["tok_per_s"], ref and ref["tok_per_s"]))


def format_long_table(payload: dict[str, Any], memory: dict[str, dict[str, Any]]) -> str:
    """Per size and runner: prompt tokens per second, first token, decode tokens per
    second, each as a ratio to llama-server's where it ran; then the peak memory."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for r in payload["results"]:
        rows.setdefault(r["category"], {})[r["drafter"]] = r
    runners = list(dict.fromkeys(r["drafter"] for r in payload["results"]))
    peer = "server" if "server" in runners else None
    head = (f"{'size':<9}{'runner':<10}{'prompt':>7}{'prompt tok/s':>16}"
            f"{'first token ms':>18}{'decode tok/s':>16}{'same':>6}")
    lines = [head, "-" * len(head)]
    for category in sorted(rows, key=lambda c: int(c.split("-")[1].rstrip("k"))):
        by_runner = rows[category]
        plain_text = by_runner.get("none", {}).get("text")
        for name in runners:
            r = by_runner.get(name)
            if r is None:
                continue
            ref = by_runner.get(peer) if peer and name != peer else None
            pp, first, decode = _row_cells(r, ref)
            same = "" if plain_text is None or name == peer else (
                "yes" if r.get("text") == plain_text else "NO")
            lines.append(f"{category:<9}{name:<10}{r['n_prompt']:>7}{pp:>16}{first:>18}"
                         f"{decode:>16}{same:>6}")
    if memory:
        lines += ["", "peak memory of the process at the largest prompt, MiB (Tandem's "
                  "model's part: the peak less the process before it loads)"]
        for name, m in memory.items():
            if "error" in m:
                lines.append(f"  {name:<10} failed: {m['error']}")
                continue
            text = f"  {name:<10} {m['peak_bytes'] / 2**20:8.0f}"
            start = m.get("start_bytes", 0)
            if m.get("loaded_bytes"):
                text += (f"  (before the model {start / 2**20:.0f}, after its load "
                         f"{m['loaded_bytes'] / 2**20:.0f})")
            predicted = m.get("predicted", {}).get("total")
            if predicted:
                text += (f"  model's part {(m['peak_bytes'] - start) / 2**20:.0f} against "
                         f"{predicted / 2**20:.0f} predicted, "
                         f"{(m['peak_bytes'] - start) / predicted:.2f}x")
            lines.append(text)
    lines.append("ratios: to llama-server (prompt and decode: higher is faster; first "
                 "token: its time over ours)")
    return "\n".join(lines)
