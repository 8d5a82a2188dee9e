"""Where the head's acceptance at inference parts from its training evaluation.

The training eval scores the head teacher-forced: every answer position, the whole
conversation in its attention, the target's features from one prefill. Inference
differs in three ways, each measured here on the same texts:

1. *Context*: the engine gives the head only the last ``prompt_features`` prompt
   tokens' features (each one costs the target an LM-head row before the first token).
2. *Which positions*: a drafting step starts right after the target corrected the last
   draft, so steps over-sample the positions where the head was just wrong.
3. *Path*: the head's cache is fed through the drafter (``begin``/``accept``/``draft``),
   features from verification batches, not from one prefill.

For each text the script prefills prompt + the target's greedy answer once (features of
every token), scores the head teacher-forced with the whole context and with the
engine's window, then runs the real drafter (chain mode) through ``generate`` and
compares its first draft token of every step with the teacher-forced guess at that
position. Texts: Spec-Bench dev prompts and unseen ShareGPT conversations (the training
distribution).

    python -m training.acceptance_gap --per-category 2 --sharegpt 24 --json gap.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.head import HeadDrafter, HeadDrafterConfig
from engine.runtime.target import Target, TargetConfig
from training.spec_bench import DEV_PROMPTS

# The bundled head's data: samples from the first 1408 usable ShareGPT exchanges (its
# report), the last 96 held out for its eval. Built 8 at a time in order of completion, so
# the split is known to within a few samples: "eval" takes samples 1320-1399 (inside it);
# "unseen" those from raw conversation 6000 on (after anything it was built from).
EVAL_SPLIT = (1320, 1400)
SHAREGPT_UNSEEN_FROM = 6000


@dataclass
class Text:
    source: str  # "dev:<category>" or "sharegpt"
    prompt: list[int]
    answer: list[int]  # the target's greedy answer (max_tokens)


@dataclass
class Tally:
    hit: int = 0
    total: int = 0

    def add(self, hit: bool) -> None:
        self.hit += int(hit)
        self.total += 1

    @property
    def rate(self) -> float:
        return self.hit / self.total if self.total else float("nan")


@dataclass
class SourceReport:
    teacher_full: Tally = field(default_factory=Tally)  # whole prompt in the attention
    teacher_window: Tally = field(default_factory=Tally)  # the engine's prompt window
    teacher_at_steps: Tally = field(default_factory=Tally)  # window, at step starts only
    engine_first: Tally = field(default_factory=Tally)  # the drafter's first token
    engine_equals_teacher: Tally = field(default_factory=Tally)  # same guess as teacher
    teacher_first_answer: Tally = field(default_factory=Tally)  # answer's 2nd..9th token

    def merge(self, other: SourceReport) -> None:
        for name, tally in vars(other).items():
            mine = getattr(self, name)
            mine.hit += tally.hit
            mine.total += tally.total

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for name, tally in vars(self).items():
            out[name] = round(tally.rate, 4)
            out[f"{name}_n"] = tally.total
        return out


def teacher_guesses(drafter: HeadDrafter, tokens: list[int], feats: np.ndarray,
                    first: int) -> np.ndarray:
    """The head's depth-0 guess of token j+2 from (feature j, token j+1) for j >= first,
    with entries from ``first`` on in its attention (as the engine's cache holds them).
    Returns guesses indexed by the position j+2 they predict (-1 before)."""
    head = drafter.head
    f = torch.from_numpy(np.ascontiguousarray(feats[first:-1], np.float32))
    tok = torch.tensor(tokens[first + 1:])
    pos = torch.arange(first, len(tokens) - 1)
    with torch.no_grad():
        out, _ = head(f[None], tok[None], pos[None], None)
        guess = head.d2t[head.logits(out[0]).argmax(-1)].numpy()
    by_position = np.full(len(tokens) + 1, -1, np.int64)
    by_position[first + 2:first + 2 + len(guess)] = guess
    return by_position


def measure(target: Target, drafter: HeadDrafter, text: Text, report: SourceReport) -> None:
    full = text.prompt + text.answer
    target.reset()
    target.set_features(True)
    pre = target.prefill(full, feature_tail=None)
    assert pre.features is not None and len(pre.features) == len(full)
    # The answer is greedy: the token at each position is what the target would say.
    n_prompt = len(text.prompt)
    window = drafter.prompt_features or n_prompt
    full_guess = teacher_guesses(drafter, full, pre.features, 0)
    window_guess = teacher_guesses(drafter, full, pre.features, max(0, n_prompt - window))
    # Answer token i (at position n_prompt + i) for i >= 1: the first answer token comes
    # from the prefill, never from a draft.
    for pos in range(n_prompt + 1, len(full)):
        report.teacher_full.add(full_guess[pos] == full[pos])
        report.teacher_window.add(window_guess[pos] == full[pos])
        if pos < n_prompt + 9:
            report.teacher_first_answer.add(window_guess[pos] == full[pos])

    # The real drafter: every step's first guess is recorded, kept by the budget or not.
    # It drafts the position after its context (prompt, answer so far, the root).
    first_tokens: list[tuple[int, int]] = []  # (position drafted, token)
    real_draft = drafter.draft

    def recording_draft(max_tokens: int, token_time_s: float):  # noqa: ANN202
        tree = real_draft(max(1, max_tokens), token_time_s)
        if tree.tokens:
            first_tokens.append((len(drafter._tokens), tree.tokens[0]))
        return tree

    drafter.draft = recording_draft  # type: ignore[method-assign]
    try:
        target.reset()
        result = generate(target, text.prompt, drafter,
                          GenerationConfig(max_tokens=len(text.answer)), remember=False)
    finally:
        del drafter.draft
    if result.tokens != text.answer:
        print(f"warning: drafted answer differs from plain ({text.source})", file=sys.stderr)
    for pos, token in first_tokens:
        if pos >= len(full):
            continue
        report.engine_first.add(token == full[pos])
        report.teacher_at_steps.add(window_guess[pos] == full[pos])
        report.engine_equals_teacher.add(window_guess[pos] == token)


def dev_texts(target: Target, path: Path, per_category: int, max_tokens: int
              ) -> Iterator[Text]:
    from training.spec_bench import load_prompts

    for row in load_prompts(path, per_category):
        yield _greedy(target, f"dev:{row.category}",
                      [{"role": "user", "content": row.turns[0]}], max_tokens)


def sharegpt_texts(target: Target, n: int, max_tokens: int, split: str) -> Iterator[Text]:
    from training.distill_data import BuildConfig, _mostly_text
    from training.sharegpt import iter_conversations

    max_prompt_tokens = BuildConfig().max_prompt_tokens  # the training data's cut
    made = built = 0
    for i, conv in enumerate(iter_conversations()):
        if split == "unseen" and i < SHAREGPT_UNSEEN_FROM:
            continue
        pair = conv.first_exchange()
        if not pair or not (_mostly_text(pair[0]) and _mostly_text(pair[1])):
            continue  # the training data's filters, in its order
        prompt = target.chat_prompt([{"role": "user", "content": pair[0]}])
        if len(prompt) > max_prompt_tokens:
            continue
        built += 1
        if split == "eval" and built - 1 < EVAL_SPLIT[0]:
            continue
        if made >= n or (split == "eval" and built - 1 >= EVAL_SPLIT[1]):
            return
        yield _greedy(target, f"sharegpt-{split}", [{"role": "user", "content": pair[0]}],
                      max_tokens)
        made += 1


def _greedy(target: Target, source: str, messages: list[dict[str, str]], max_tokens: int
            ) -> Text:
    target.reset()
    target.set_features(False)
    prompt = target.chat_prompt(messages)
    answer = generate(target, prompt, None, GenerationConfig(max_tokens=max_tokens)).tokens
    return Text(source, prompt, answer)


def main(argv: list[str] | None = None) -> int:
    from engine.drafters import target_fingerprint
    from engine.drafters.head import load_head_drafter
    from engine.hub.model_store import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--head", type=Path,
                   default=Path(__file__).resolve().parents[1] / "assets"
                   / "draft-head-smollm2-135m")
    p.add_argument("--prompts", type=Path, default=DEV_PROMPTS)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--sharegpt", type=int, default=24)
    p.add_argument("--sharegpt-split", choices=("eval", "unseen"), default="unseen",
                   help="the head's held-out eval exchanges, or ones after its data")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-features", type=int, default=8,
                   help="prompt tokens the head reads (the engine's default: 8)")
    p.add_argument("--weights", choices=("int8", "float"), default="int8",
                   help="the head's weights on the CPU (the engine's default: int8)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    model = args.model or default_model_path()
    with Target(model, TargetConfig(n_ctx=4096, features=True)) as target:
        fingerprint = target_fingerprint(target)
        drafter = load_head_drafter(
            args.head, model, fingerprint,
            HeadDrafterConfig(mode="chain", depth=1, prompt_features=args.prompt_features,
                              weights=args.weights))
        reports: dict[str, SourceReport] = {}
        texts = list(dev_texts(target, args.prompts, args.per_category, args.max_tokens))
        texts += list(sharegpt_texts(target, args.sharegpt, args.max_tokens,
                                    args.sharegpt_split))
        for k, text in enumerate(texts, 1):
            report = SourceReport()
            measure(target, drafter, text, report)
            # Each text counts for its source and its group ("dev:math" and "dev").
            for key in dict.fromkeys((text.source.split(":")[0], text.source)):
                reports.setdefault(key, SourceReport()).merge(report)
            print(f"\r{k}/{len(texts)} texts", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    table = {k: r.as_dict() for k, r in sorted(reports.items())}
    cols = ["teacher_full", "teacher_window", "teacher_first_answer", "teacher_at_steps",
            "engine_first", "engine_equals_teacher"]
    print(f"{'texts':<22}" + "".join(f"{c:>22}" for c in cols))
    for k, row in table.items():
        print(f"{k:<22}" + "".join(f"{row[c]:>16.3f} ({row[c + '_n']:>4})" for c in cols))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "by_source": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
