"""Training an EAGLE-3 head (``training.eagle3_head``) on feature shards whose features are
three target layers' inputs (``BuildConfig.feature_layers``), and writing it as the
``eagle3`` GGUF llama.cpp runs (issue 35, item 4).

Loss (EAGLE-3): cross-entropy of the head's draft-vocabulary scores against the target's
own next token, on answer positions whose token the draft vocabulary holds, over a
``unroll``-step training-time test: step k reads the step k-1 vectors of the previous
position and attends as a depth-k draft does (``train_head.unroll_mask``). Checkpoints
(weights, optimiser, step) are written atomically every few minutes and on exit; the same
call resumes from them.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from engine.gguf.eagle3 import Eagle3Shape, write_eagle3_head
from training.distill_data import Sample
from training.eagle3_head import Eagle3Head
from training.train_head import (
    DepthAccuracy,
    TrainState,
    _window,
    batch_tensors,
    optimise,
    unroll_mask,
)

if TYPE_CHECKING:
    from training.train_draft import Progress, TrainDraftJob

CHECKPOINT = "eagle3-checkpoint.pt"


@dataclass(frozen=True)
class Eagle3TrainConfig:
    steps: int = 100_000
    seqs_per_step: int = 4
    max_len: int = 384
    lr: float = 1e-3
    warmup: int = 50
    clip: float = 0.5
    unroll: int = 3
    depth_weight: float = 0.8
    feature_noise: float = 0.05  # uniform, relative to each feature's RMS
    checkpoint_every_s: float = 120.0
    time_limit_s: float | None = None
    seed: int = 0


def target_to_draft(d2t: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """Target id -> draft id, -1 for tokens outside the draft vocabulary."""
    t2d = torch.full((n_vocab,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(len(d2t), device=d2t.device)
    return t2d


def unrolled_loss(head: Eagle3Head, batch: dict[str, torch.Tensor], t2d: torch.Tensor,
                  cfg: Eagle3TrainConfig, acc: DepthAccuracy, train: bool) -> torch.Tensor:
    """The weighted loss of a batch over ``cfg.unroll`` steps; adds accuracies (the
    head's best token against the target's, over every answer position)."""
    weight, label = batch["weight"], batch["label"]
    b, n = weight.shape
    positions = torch.arange(n, device=weight.device)
    feats = batch["feat_in"]
    if train and cfg.feature_noise > 0:
        rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + (torch.rand_like(feats) * 2 - 1) * cfg.feature_noise * rms
    x = head.fuse(feats)
    draft_label = t2d[label]
    total = x.new_zeros(())
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    for step in range(1, cfg.unroll + 1):
        mask = None if step == 1 else unroll_mask(n, step, x.device)
        h, past = head.decode(batch["tok_in"], x, positions, past, mask)
        valid = weight.clone()
        valid[:, :step - 1] = False
        if valid.any():
            logits = head.logits(h[valid]).float()
            target = draft_label[valid]
            known = target >= 0
            if known.any():
                ce = F.cross_entropy(logits[known], target[known])
                total = total + cfg.depth_weight ** (step - 1) * ce
            guess = head.d2t[logits.argmax(-1)]
            acc.add(step, int((guess == label[valid]).sum()), int(valid.sum()))
        x = torch.cat([h.new_zeros(b, 1, h.shape[-1]), h[:, :-1]], dim=1)
    return total


def evaluate(head: Eagle3Head, samples: list[Sample], t2d: torch.Tensor,
             cfg: Eagle3TrainConfig) -> dict:
    """Loss and teacher-forced accuracy by depth on ``samples``."""
    head.eval()
    acc, losses = DepthAccuracy(), []
    usable = [s for s in samples if len(s.tokens) >= 3 and s.answer.any()]
    with torch.no_grad():
        for i in range(0, len(usable), 8):
            group = usable[i:i + 8]
            batch = batch_tensors(group, [_window(s, cfg.max_len, None) for s in group],
                                  cfg.max_len, t2d.device)
            losses.append(float(unrolled_loss(head, batch, t2d, cfg, acc, train=False)))
    head.train()
    return {"loss": float(np.mean(losses)) if losses else math.nan,
            "accuracy_by_depth": acc.rates()}


def train(head: Eagle3Head, samples: list[Sample], n_vocab: int, cfg: Eagle3TrainConfig,
          work_dir: Path, on_progress: Callable[[int, dict], None] | None = None
          ) -> TrainState:
    """Train ``head`` in place, resuming from ``work_dir``'s checkpoint."""
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = TrainState()
    ckpt_path = work_dir / CHECKPOINT
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["opt"])
        state = TrainState(**ckpt["state"])
    t2d = target_to_draft(head.d2t, n_vocab)

    def save() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(),
                    "state": asdict(state)}, tmp)
        os.replace(tmp, ckpt_path)

    head.train()
    optimise(params, opt, state, cfg, samples, t2d.device,
             lambda batch, acc: unrolled_loss(head, batch, t2d, cfg, acc, train=True),
             save, on_progress)
    return state


def export(head: Eagle3Head, path: Path, target: Path, matrices: str = "q8_0") -> Path:
    """Write the trained head as an ``eagle3`` GGUF for ``target``."""
    return write_eagle3_head(path, target, head.shape, head.gguf_weights(),  # type: ignore[arg-type]
                             matrices=matrices)


def new_head(shape: Eagle3Shape, embed: np.ndarray, lm_head: np.ndarray,
             d2t: torch.Tensor) -> Eagle3Head:
    return Eagle3Head(shape, torch.from_numpy(embed), torch.from_numpy(lm_head), d2t)


def run_job(job: TrainDraftJob, progress: Progress) -> dict:
    """``tandem train-draft --fusion eagle3``: features of three target layers, the draft
    vocabulary, training, an evaluation, and ``head.gguf`` (Q8_0 matrices) with a report
    in ``job.out_dir``. Every phase resumes from ``job.work_dir``."""
    from engine.gguf.eagle3 import shape_for_target
    from engine.runtime.model_info import read_model_info
    from models.gguf_weights import read_embeddings
    from training.train_draft import job_samples
    from training.train_head import draft_vocabulary

    phase = progress.on_phase or (lambda _: None)
    t0 = time.monotonic()
    shape = shape_for_target(job.target)
    if job.shape.draft_vocab_size:
        shape = replace(shape, draft_vocab=job.shape.draft_vocab_size)
    phase("features")
    data = replace(job.data, feature_layers=shape.target_layers)
    train_samples, eval_samples = job_samples(job, data, "-eagle3", progress)
    t_data = time.monotonic() - t0

    phase("model")
    info = read_model_info(job.target)
    embed, lm_head = read_embeddings(job.target)
    vocab = shape.draft_vocab or embed.shape[0]
    d2t_path = job.work_dir / "eagle3-d2t.pt"
    if d2t_path.exists():  # a resumed run keeps the vocabulary its checkpoint learnt
        d2t = torch.load(d2t_path)
    else:
        d2t = (draft_vocabulary(train_samples, vocab, set(info.eog_ids))
               if shape.draft_vocab else torch.arange(vocab))
        if len(d2t) < vocab:  # few answers: the rest of the vocabulary in id order
            unused = torch.ones(embed.shape[0], dtype=torch.bool)
            unused[d2t] = False
            d2t = torch.cat([d2t, unused.nonzero()[:, 0][:vocab - len(d2t)]])
        torch.save(d2t, d2t_path)
    if not shape.draft_vocab:
        shape = replace(shape, draft_vocab=vocab)  # its own LM head, every token
    torch.manual_seed(job.train.seed)
    head = new_head(shape, embed, lm_head, d2t)
    cfg = Eagle3TrainConfig(steps=job.train.steps, seqs_per_step=job.train.seqs_per_step,
                            lr=job.train.lr, unroll=job.train.unroll, seed=job.train.seed,
                            time_limit_s=job.train.time_limit_s)

    phase("training")
    t1 = time.monotonic()
    state = train(head, train_samples, embed.shape[0], cfg, job.work_dir / "train-eagle3",
                  on_progress=progress.on_step)
    t_train = time.monotonic() - t1

    phase("evaluation")
    result = evaluate(head, eval_samples, target_to_draft(head.d2t, embed.shape[0]), cfg)
    job.out_dir.mkdir(parents=True, exist_ok=True)
    export(head, job.out_dir / "head.gguf", job.target)
    report = {
        "target": job.target.name, "head": {**asdict(shape), "format": "eagle3 GGUF, Q8_0"},
        "data": {"answers": data.answers, "conversations": len(train_samples),
                 "tokens": sum(len(s.tokens) for s in train_samples),
                 "answer_tokens": sum(int(s.answer.sum()) for s in train_samples),
                 "eval_conversations": len(eval_samples)},
        "train": {**asdict(cfg), "steps_done": state.step, "device": "cpu",
                  "task_prompts": job.task_prompts},
        "eval": result,
        "time_s": {"features": t_data, "training": t_train,
                   "total": time.monotonic() - t0},
    }
    (job.out_dir / "train_report.json").write_text(json.dumps(report, indent=2))
    return report
