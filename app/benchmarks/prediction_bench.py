"""How fast a predicted answer decodes, by how much of the prediction it repeats.

    python -m app.benchmarks.prediction_bench [--model FILE.gguf] [--json OUT.json]

A model that edits a file repeats most of it; how much of a prediction the answer
repeats decides the speed. The bundled 135M model does not copy a 300-line file when asked
to edit it (it writes its own text), so this bench takes the answer the model does write
to each code-edit request of ``tandem bench --documents`` and makes predictions of it
with a known share of lines kept: all (100%), four lines in five (80%: every fifth line
changed, as an edit that touches that much), and an unrelated file (0%). Each is decoded
with plain decoding, ``auto`` without a prediction and ``auto`` with it, in one run, with
the tokens compared to plain decoding's. Results go to JSON after every row (resumed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from app.benchmarks.document_tasks import code_edit_prompts
from engine.decoding.generation import GenerationConfig
from engine.session import Engine, EngineConfig

SHARES = {"100%": 0, "80%": 5, "0%": -1}  # lines kept: change every Nth (0: none, -1: all)
CTX = 8192


def with_lines_kept(answer: str, every: int, unrelated: str) -> str:
    """``answer`` with every ``every``-th line changed (0: as it is; -1: ``unrelated``)."""
    if every < 0:
        return unrelated
    if every == 0:
        return answer
    lines = answer.split("\n")
    return "\n".join(f"# line {i} changed" if i % every == every - 1 else line
                     for i, line in enumerate(lines))


def _row(engine: Engine, prompt: list[int], max_tokens: int, plain: bool,
         prediction: str = "") -> dict[str, Any]:
    engine.target.reset(cold=True)
    result = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens,
                                                      prediction=prediction),
                             plain=plain, remember=False)
    s = result.stats
    return {"tok_per_s": s.tok_per_s, "tokens": result.tokens, "tau": s.mean_accepted,
            "accepted": s.n_prediction_accepted, "rejected": s.n_prediction_rejected,
            "new_tokens": s.n_new}


def run(model: Path | None, max_tokens: int, out: Path | None) -> list[dict[str, Any]]:
    from tqdm import tqdm

    done: list[dict[str, Any]] = json.loads(out.read_text())["rows"] \
        if out is not None and out.exists() else []
    seen = {(r["question_id"], r["share"]) for r in done}
    prompts = code_edit_prompts()
    unrelated = Path(__file__).read_text(encoding="utf-8")
    rows = list(done)
    with Engine(EngineConfig(model_path=model, n_ctx=CTX)) as engine, \
            tqdm(total=len(prompts) * len(SHARES), file=sys.stderr, unit="row") as bar:
        for bench_prompt in prompts:
            prompt = engine.chat_prompt([{"role": "user", "content": bench_prompt.turns[0]}])
            plain = auto = None
            for share, every in SHARES.items():
                bar.update(1)
                if (bench_prompt.question_id, share) in seen:
                    continue
                if plain is None:  # both baselines once per prompt, beside its rows
                    plain = _row(engine, prompt, max_tokens, True)
                    auto = _row(engine, prompt, max_tokens, False)
                assert auto is not None
                answer = engine.target.detokenize(plain["tokens"])
                predicted = _row(engine, prompt, max_tokens, False,
                                 with_lines_kept(answer, every, unrelated))
                rows.append({
                    "question_id": bench_prompt.question_id, "share": share,
                    "n_prompt": len(prompt), "new_tokens": plain["new_tokens"],
                    "plain_tok_per_s": plain["tok_per_s"], "auto_tok_per_s": auto["tok_per_s"],
                    "predicted_tok_per_s": predicted["tok_per_s"],
                    "ratio_to_plain": predicted["tok_per_s"] / plain["tok_per_s"],
                    "ratio_to_auto": predicted["tok_per_s"] / auto["tok_per_s"],
                    "tau": predicted["tau"], "accepted": predicted["accepted"],
                    "rejected": predicted["rejected"],
                    "same_answer": predicted["tokens"] == plain["tokens"]
                    and auto["tokens"] == plain["tokens"]})
                if out is not None:
                    out.write_text(json.dumps({"model": str(engine.model.path),
                                               "max_tokens": max_tokens, "rows": rows},
                                              indent=1))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'file':<22} {'kept':>5} {'plain':>7} {'auto':>7} {'+pred':>7} "
             f"{'x plain':>7} {'x auto':>7} {'tau':>5} {'acc/rej':>9} same"]
    for r in rows:
        lines.append(
            f"{r['question_id'].split('/')[-1]:<22} {r['share']:>5} "
            f"{r['plain_tok_per_s']:>7.1f} {r['auto_tok_per_s']:>7.1f} "
            f"{r['predicted_tok_per_s']:>7.1f} {r['ratio_to_plain']:>6.2f}x "
            f"{r['ratio_to_auto']:>6.2f}x {r['tau']:>5.2f} "
            f"{r['accepted']:>4}/{r['rejected']:<4} {'yes' if r['same_answer'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.benchmarks.prediction_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: bundled)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--json", type=Path, default=None, help="write rows here (resumes)")
    args = p.parse_args(argv)
    rows = run(args.model, args.max_tokens, args.json)
    print(table(rows))
    return 0 if all(r["same_answer"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
