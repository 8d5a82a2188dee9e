"""What drafting ahead gains: a draft model decoding on its own context while the target
verifies (DuoDecoding's layout: the target on a GPU or on its own cores, the draft model on
the CPU), against drafting then verifying in turn. Prints a table, writes JSON.

    .venv/bin/python -m app.benchmarks.draft_overlap_bench --json draft_overlap.json \\
        [--target MODEL.gguf] [--draft MODEL.gguf] [--target-gpu-layers N] \\
        [--target-threads 1] [--draft-threads 1] [--depth 4] [--steps 32] \\
        [--prompt-tokens 256] [--repeats 3]

Both models default to the bundled one. Each step the draft model decodes ``depth + 1``
tokens one by one (its guess of the target's next token, then a chain of ``depth``), and
the target verifies those tokens in one batch (every row an output, its argmax read), as
engine.drafters.draft_model's ``draft_ahead`` and the target do. The work is the same in
every mode; only the order differs:

- ``in turn``: draft step i, then verify step i;
- ``ahead, one decode at a time``: draft step i+1 on a second thread while step i is
  verified, with every decode alone in the process (the rule before decodes of different
  contexts could overlap: engine.runtime.decode_gate);
- ``ahead``: the same, the two contexts' decodes at once.

The draft always drafts from its own guesses (everything accepted), so the tokens, and
the work, do not depend on how well the two models agree: this measures the overlap, not
acceptance. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from engine.runtime.decode_gate import DECODE_GATE
from engine.runtime.native import NativeBatch, NativeContext, NativeModel

PROMPT = ("Explain, step by step and with an example, how a hash table handles "
          "collisions, and when a balanced tree is the better choice. ")
MODES = ("in turn", "ahead, one decode at a time", "ahead")


class _Drafter:
    """The draft model's context: greedy, one token per decode, from its own guesses."""

    def __init__(self, model: NativeModel, prompt: list[int], n_ctx: int, threads: int,
                 alone: Callable[[], AbstractContextManager[Any]]) -> None:
        # F16 K and V, as engine.drafters.draft_model's context.
        self.ctx = NativeContext(model, n_ctx=n_ctx, n_batch=len(prompt), n_seq_max=1,
                                 n_threads=threads, features=False, type_k="f16",
                                 type_v="f16")
        self.batch = NativeBatch(len(prompt), 1)
        self.n_prompt = len(prompt)
        self.batch.fill(prompt, list(range(len(prompt))), None,
                        [False] * (len(prompt) - 1) + [True])
        self.ctx.decode(self.batch)
        self.first = int(self.ctx.logits_view(1)[0].argmax())
        self.alone = alone
        self.reset()

    def reset(self) -> None:
        self.ctx.kv_remove(0, self.n_prompt)
        self.pos, self.next = self.n_prompt, self.first

    def step(self, n: int) -> list[int]:
        """Decode ``n`` tokens one by one; the tokens decoded."""
        out = []
        for _ in range(n):
            out.append(self.next)
            self.batch.fill_one(self.next, self.pos)
            with self.alone():
                self.ctx.decode(self.batch)
            self.pos += 1
            self.next = int(self.ctx.last_logits_view(1).argmax())
        return out

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


class _Verifier:
    """The target's context: Tandem's cache and rules (NativeContext), one batch a step."""

    def __init__(self, model: NativeModel, prompt: list[int], n_ctx: int, threads: int,
                 width: int, alone: Callable[[], AbstractContextManager[Any]]) -> None:
        self.ctx = NativeContext(model, n_ctx=n_ctx, n_batch=max(len(prompt), width),
                                 n_seq_max=1, n_threads=threads, features=False)
        self.batch = NativeBatch(max(len(prompt), width), 1)
        self.n_prompt = len(prompt)
        self.batch.fill(prompt, list(range(len(prompt))), None, False)
        self.ctx.decode(self.batch)
        self.alone = alone
        self.reset()

    def reset(self) -> None:
        self.ctx.kv_remove(0, self.n_prompt)
        self.pos = self.n_prompt

    def verify(self, tokens: list[int]) -> list[int]:
        n = len(tokens)
        self.batch.fill(tokens, list(range(self.pos, self.pos + n)), None, True)
        with self.alone():
            self.ctx.decode(self.batch)
        self.pos += n
        return self.ctx.argmax_logits(n)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def _in_turn(drafter: _Drafter, verifier: _Verifier, steps: int, width: int
             ) -> dict[str, float]:
    t_draft = t_verify = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        tokens = drafter.step(width)
        t_draft += time.perf_counter() - t
        t = time.perf_counter()
        verifier.verify(tokens)
        t_verify += time.perf_counter() - t
    return {"wall_s": time.perf_counter() - t0, "draft_s": t_draft, "verify_s": t_verify}


def _ahead(drafter: _Drafter, verifier: _Verifier, steps: int, width: int
           ) -> dict[str, float]:
    """Step i verified while step i+1 is drafted on another thread (as the engine's
    draft-ahead thread)."""
    with ThreadPoolExecutor(1, thread_name_prefix="draft-ahead") as pool:
        t0 = time.perf_counter()
        tokens = drafter.step(width)
        for i in range(steps):
            ahead = pool.submit(drafter.step, width) if i + 1 < steps else None
            verifier.verify(tokens)
            if ahead is not None:
                tokens = ahead.result()
        wall = time.perf_counter() - t0
    return {"wall_s": wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.hub.model_store import default_model_path

    target_path = args.target or default_model_path()
    draft_path = args.draft or target_path
    width = args.depth + 1
    serialized = {"on": False}

    def alone() -> AbstractContextManager[Any]:
        # Every decode alone in the process: the former rule, for the middle mode.
        return DECODE_GATE.exclusive() if serialized["on"] else nullcontext()

    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "target": str(target_path),
        "draft": str(draft_path), "target_gpu_layers": args.target_gpu_layers,
        "target_threads": args.target_threads, "draft_threads": args.draft_threads,
        "depth": args.depth, "steps": args.steps, "repeats": args.repeats, "modes": {}}
    with NativeModel(target_path, n_gpu_layers=args.target_gpu_layers) as target_model, \
            NativeModel(draft_path) as draft_model:
        text = PROMPT * (1 + args.prompt_tokens // 20)
        prompt = target_model.tokenize(text, True, False)[:args.prompt_tokens]
        out["prompt_tokens"] = len(prompt)
        n_ctx = len(prompt) + (args.steps + 2) * width + 16
        drafter = _Drafter(draft_model, prompt, n_ctx, args.draft_threads, alone)
        verifier = _Verifier(target_model, prompt, n_ctx, args.target_threads, width, alone)
        try:
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for _ in range(args.repeats + 1):  # the first round warms up, not counted
                for mode in MODES:
                    drafter.reset()
                    verifier.reset()
                    serialized["on"] = mode == "ahead, one decode at a time"
                    go = _in_turn if mode == "in turn" else _ahead
                    runs[mode].append(go(drafter, verifier, args.steps, width))
            serialized["on"] = False
        finally:
            drafter.close()
            verifier.close()
    for mode, results in runs.items():
        walls = [r["wall_s"] for r in results[1:]]
        row: dict[str, Any] = {"wall_s": round(statistics.median(walls), 4),
                               "walls_s": [round(w, 4) for w in walls]}
        row["ms_per_step"] = round(1000 * row["wall_s"] / args.steps, 2)
        if mode == "in turn":
            for key in ("draft_s", "verify_s"):
                row[key.replace("_s", "_ms_per_step")] = round(
                    1000 * statistics.median(r[key] for r in results[1:]) / args.steps, 2)
        out["modes"][mode] = row
    turn = out["modes"]["in turn"]
    out["ideal_ms_per_step"] = max(turn["draft_ms_per_step"], turn["verify_ms_per_step"])
    for row in out["modes"].values():
        row["vs_in_turn"] = round(turn["wall_s"] / row["wall_s"], 3) if row["wall_s"] else 0.0
    return out


def table(out: dict[str, Any]) -> str:
    turn = out["modes"]["in turn"]
    lines = [f"target {Path(out['target']).name} ({out['target_threads']} threads, "
             f"{out['target_gpu_layers']} GPU layers), draft {Path(out['draft']).name} "
             f"({out['draft_threads']} threads); {out['prompt_tokens']}-token prompt, "
             f"{out['steps']} steps of {out['depth'] + 1} tokens, median of "
             f"{out['repeats']}",
             f"a step alone: draft {turn['draft_ms_per_step']} ms, verify "
             f"{turn['verify_ms_per_step']} ms (overlapped at best: "
             f"{out['ideal_ms_per_step']} ms)",
             "| mode | wall s | ms per step | vs in turn |", "|---|---|---|---|"]
    for mode, row in out["modes"].items():
        lines.append(f"| {mode} | {row['wall_s']} | {row['ms_per_step']} | "
                     f"{row['vs_in_turn']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, help="target GGUF (default: the bundled)")
    parser.add_argument("--draft", type=Path, help="draft GGUF (default: the target's)")
    parser.add_argument("--target-gpu-layers", type=int, default=0)
    parser.add_argument("--target-threads", type=int, default=1)
    parser.add_argument("--draft-threads", type=int, default=1)
    parser.add_argument("--depth", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("draft_overlap.json"))
    args = parser.parse_args(argv)
    if args.depth < 1 or args.steps < 1 or args.repeats < 1 or args.prompt_tokens < 2:
        parser.error("--depth, --steps and --repeats must be >= 1, --prompt-tokens >= 2")
    out = run(args)
    args.json.write_text(json.dumps(out, indent=1))
    print(table(out))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
