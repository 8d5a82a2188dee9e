"""Training data for a draft head: token sequences with the target's own features.

Each sample is one chat exchange formatted with the GGUF's chat template: the tokens,
which of them belong to the answer (the loss looks only there), the target's post-norm
hidden state of every token (what the head reads and predicts) and the target's greedy
next token after every token (for accuracy). Everything comes from llama.cpp running the
same GGUF the head will serve.

Answers are either the dataset's (one prefill per exchange: fast) or written by the
target itself (self-distillation: the head then learns the text it will really be
asked to draft). Self-distillation decodes several conversations at once, one KV
sequence each, so a step costs one batched decode for all of them.

Samples go to numbered shards; a build that stops resumes after the last full shard.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.runtime.target import Target, TargetConfig
from training.sharegpt import Conversation

_CHUNK = 512  # tokens per decode
MANIFEST = "manifest.json"


@dataclass
class Sample:
    tokens: np.ndarray  # int32 [T]
    answer: np.ndarray  # bool [T], True for the assistant's tokens (incl. its end token)
    features: np.ndarray  # float16 [T, d]
    target_next: np.ndarray  # int32 [T], the target's argmax after each token


@dataclass(frozen=True)
class BuildConfig:
    answers: str = "self"  # "self" (the target writes them) or "dataset"
    max_prompt_tokens: int = 384
    max_answer_tokens: int = 256
    n_parallel: int = 8  # conversations decoded together (self-distillation)
    shard_samples: int = 64
    n_threads: int = 2
    # Features are these target layers' inputs side by side (an EAGLE-3 head's); none:
    # the last layer's post-norm output (the DGF head's).
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.answers not in ("self", "dataset"):
            raise ValueError(f"answers must be 'self' or 'dataset', got {self.answers!r}")


def _mostly_text(s: str) -> bool:
    """SmolLM-class targets are English models; skip prompts that are mostly other
    scripts (they would teach the head text it is never asked to draft)."""
    return sum(ch.isascii() for ch in s) >= 0.9 * len(s)


@dataclass
class _Slot:
    seq: int
    prompt_len: int = 0
    tokens: list[int] = field(default_factory=list)
    feats: list[np.ndarray] = field(default_factory=list)
    nexts: list[int] = field(default_factory=list)
    active: bool = False


class FeatureExtractor:
    """The target in features mode, one independent KV sequence per conversation."""

    def __init__(self, model_path: Path, config: BuildConfig) -> None:
        self.config = config
        n_seq = max(1, config.n_parallel)
        per_seq = config.max_prompt_tokens + config.max_answer_tokens + 8
        # Features need no bit-exactness: F16 K keeps llama.cpp's fast prefill kernel.
        self.target = Target(model_path, TargetConfig(
            n_ctx=per_seq * n_seq, n_threads=config.n_threads, n_batch=_CHUNK,
            n_seq_max=n_seq, features=True, type_k="f16", type_v="f16", unified_kv=False))
        if config.feature_layers:
            self.target.set_feature_layers(tuple(config.feature_layers))
        self.eog = self.target.model.eog_ids

    def close(self) -> None:
        self.target.close()

    def prompt_tokens(self, user: str, answer: str | None = None) -> list[int]:
        messages = [{"role": "user", "content": user}]
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
        return self.target.chat_prompt(messages, add_generation_prompt=answer is None)

    def _eval(self, tokens: list[int], seq: int, pos0: int
              ) -> tuple[list[np.ndarray], list[int]]:
        """Append ``tokens`` to ``seq``: their features and the target's argmax after each."""
        feats, nexts = [], []
        for start in range(0, len(tokens), _CHUNK):
            chunk = tokens[start:start + _CHUNK]
            positions = list(range(pos0 + start, pos0 + start + len(chunk)))
            f, n = decode_sequences(self.target, chunk, positions, [seq] * len(chunk))
            feats.append(f)
            nexts.extend(n)
        return feats, nexts

    def dataset_sample(self, user: str, answer: str) -> Sample | None:
        """The dataset's own answer, in one prefill."""
        prompt = self.prompt_tokens(user)
        full = self.prompt_tokens(user, answer)
        if len(prompt) > self.config.max_prompt_tokens or full[:len(prompt)] != prompt:
            return None
        full = full[:len(prompt) + self.config.max_answer_tokens]
        forget_sequence(self.target, 0)
        feats, nexts = self._eval(full, 0, 0)
        answer_mask = np.zeros(len(full), bool)
        answer_mask[len(prompt):] = True
        return Sample(np.asarray(full, np.int32), answer_mask,
                      np.concatenate(feats).astype(np.float16), np.asarray(nexts, np.int32))

    def self_samples(self, prompts: Iterator[str]) -> Iterator[Sample]:
        """Greedy answers by the target, ``n_parallel`` conversations at a time."""
        slots = [_Slot(seq=s) for s in range(max(1, self.config.n_parallel))]
        prompts = iter(prompts)
        exhausted = False

        def start(slot: _Slot) -> bool:
            nonlocal exhausted
            while not exhausted:
                user = next(prompts, None)
                if user is None:
                    exhausted = True
                    return False
                toks = self.prompt_tokens(user)
                if len(toks) > self.config.max_prompt_tokens:
                    continue
                forget_sequence(self.target, slot.seq)
                feats, nexts = self._eval(toks, slot.seq, 0)
                slot.prompt_len, slot.tokens = len(toks), list(toks)
                slot.feats, slot.nexts, slot.active = feats, nexts, True
                return True
            return False

        for slot in slots:
            start(slot)
        while any(s.active for s in slots):
            active = [s for s in slots if s.active]
            # Feed each conversation the target's own next token.
            toks = [s.nexts[-1] for s in active]
            feats, nexts = decode_sequences(self.target,
                toks, [len(s.tokens) for s in active], [s.seq for s in active])
            for i, s in enumerate(active):
                s.tokens.append(toks[i])
                s.feats.append(feats[i:i + 1])
                s.nexts.append(nexts[i])
                n_answer = len(s.tokens) - s.prompt_len
                if toks[i] in self.eog or n_answer >= self.config.max_answer_tokens:
                    answer = np.zeros(len(s.tokens), bool)
                    answer[s.prompt_len:] = True
                    yield Sample(np.asarray(s.tokens, np.int32), answer,
                                 np.concatenate(s.feats).astype(np.float16),
                                 np.asarray(s.nexts, np.int32))
                    s.active = False
                    start(s)


def save_shard(path: Path, samples: list[Sample]) -> None:
    lengths = np.asarray([len(s.tokens) for s in samples], np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, lengths=lengths,
             tokens=np.concatenate([s.tokens for s in samples]),
             answer=np.concatenate([s.answer for s in samples]),
             features=np.concatenate([s.features for s in samples]),
             target_next=np.concatenate([s.target_next for s in samples]))
    os.replace(tmp, path)


def load_shard(path: Path) -> list[Sample]:
    with np.load(path) as z:
        cuts = np.cumsum(z["lengths"])[:-1]
        parts = [np.split(z[k], cuts) for k in ("tokens", "answer", "features", "target_next")]
    return [Sample(*fields) for fields in zip(*parts, strict=True)]


def load_samples(directory: Path) -> list[Sample]:
    out: list[Sample] = []
    for shard in sorted(directory.glob("shard_*.npz")):
        out.extend(load_shard(shard))
    return out


def build(model_path: Path, conversations: Iterator[Conversation], out_dir: Path,
          n_samples: int, config: BuildConfig,
          on_sample: Callable[[Sample], None] | None = None,
          time_limit_s: float | None = None) -> int:
    """Write shards of ``n_samples`` samples under ``out_dir``; resumes a stopped build
    (the conversation order is deterministic). ``time_limit_s`` ends the build early, after
    a whole shard. Returns the number of samples there."""
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    settings = {"answers": config.answers, "model": str(model_path),
                "max_prompt_tokens": config.max_prompt_tokens,
                "max_answer_tokens": config.max_answer_tokens,
                **({"feature_layers": list(config.feature_layers)}
                   if config.feature_layers else {})}
    if manifest.get("settings", settings) != settings:
        raise ValueError(f"{out_dir} holds data built with other settings "
                         f"({manifest['settings']}); choose another directory")
    shards = sorted(out_dir.glob("shard_*.npz"))
    done = len(shards) * config.shard_samples
    # Conversations a shard consumed (skipped ones included): resume after them.
    consumed = manifest.get("consumed", 0) if shards else 0
    if done >= n_samples or (time_limit_s is not None and time_limit_s <= 0):
        return done

    exchanges: list[tuple[str, str]] = []
    counter = {"seen": 0}

    def usable() -> Iterator[tuple[str, str]]:
        for i, conv in enumerate(conversations):
            counter["seen"] = i + 1
            if i < consumed:
                continue
            pair = conv.first_exchange()
            if pair and _mostly_text(pair[0]) and _mostly_text(pair[1]):
                exchanges.append(pair)
                yield pair

    extractor = FeatureExtractor(model_path, config)
    try:
        if config.answers == "self":
            stream: Iterator[Sample | None] = extractor.self_samples(u for u, _ in usable())
        else:
            stream = (extractor.dataset_sample(u, a) for u, a in usable())
        pending: list[Sample] = []
        for sample in stream:
            if sample is None:
                continue
            pending.append(sample)
            if on_sample:
                on_sample(sample)
            if len(pending) == config.shard_samples:
                save_shard(out_dir / f"shard_{len(shards):05d}.npz", pending)
                shards.append(out_dir / f"shard_{len(shards):05d}.npz")
                done += len(pending)
                pending = []
                # Conversations still in flight are skipped on resume, not repeated.
                manifest = {"settings": settings, "consumed": counter["seen"],
                            "samples": done}
                manifest_path.write_text(json.dumps(manifest, indent=2))
                if done >= n_samples or (deadline and time.monotonic() > deadline):
                    break
        else:
            if pending:  # the conversations ran out: the last, short shard is kept too
                save_shard(out_dir / f"shard_{len(shards):05d}.npz", pending)
                done += len(pending)
                manifest_path.write_text(json.dumps({"settings": settings,
                                                     "consumed": counter["seen"],
                                                     "samples": done}, indent=2))
    finally:
        extractor.close()
    return done


def decode_sequences(target: Target, tokens: list[int], positions: list[int], seqs: list[int]
                     ) -> tuple[np.ndarray, list[int]]:
    """Decode tokens of independent sequences (one sequence id per token) in the target's
    context, outside its sequence 0. Returns their features and the target's argmax
    after each. Needs features on; the caller owns the sequences it names."""
    if not target.ctx.features_on:
        raise ValueError("decode_sequences needs a target opened with features=True")
    ctx = target.sequence.settled()
    target.batch.fill(tokens, positions, [(s,) for s in seqs], True)
    ctx.decode(target.batch)
    return ctx.features(len(tokens)), ctx.argmax_logits(len(tokens))


def forget_sequence(target: Target, seq: int) -> None:
    """Drop every cached cell of ``seq`` (independent sequences only)."""
    target.sequence.settled().kv_remove(seq, -1, -1)
