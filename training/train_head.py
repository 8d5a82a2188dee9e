"""Training a draft head on feature shards (``training.distill_data``).

Loss (method-notes section 1, Dovetail/EAGLE): ``1.0 * SmoothL1(f_hat, f) + 0.1 *
CE(p_target, p_draft)`` on answer positions; AdamW, betas (0.9, 0.95), gradient clip 0.5,
small uniform noise on the input features.

Training-time test (EAGLE-3): at draft time the head reads its *own* predicted features
from depth 2 on, so training unrolls ``unroll`` steps: step k feeds the step k-1
predictions back in, and attends to true-feature keys only up to where a draft of depth
k would see them (``unroll_mask``). Step k's accuracy is the draft's accuracy at depth k.

A checkpoint (weights, optimiser, step) is written atomically every few minutes and on
exit; the same command resumes from it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from models.draft_head import DraftHead
from models.head_config import HeadConfig
from training.distill_data import Sample

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000  # optimiser steps
    seqs_per_step: int = 4
    max_len: int = 640
    # EAGLE trains ~300k steps at 3e-5; a CPU budget of a few thousand steps needs a
    # larger rate to converge (same optimiser otherwise).
    lr: float = 3e-4
    warmup: int = 100
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 0.5
    unroll: int = 3  # training-time-test depth
    depth_weight: float = 0.8  # step k's loss weighs depth_weight ** (k-1)
    reg_weight: float = 1.0
    ce_weight: float = 0.1
    feature_noise: float = 0.1  # uniform noise, relative to each feature's RMS
    checkpoint_every_s: float = 300.0
    time_limit_s: float | None = None  # stop early (a safety net on lent machines)
    seed: int = 0
    bf16: bool = True  # autocast to bf16 on CUDA (on a CPU it ran 20x slower here: off)


@dataclass
class DepthAccuracy:
    correct: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)

    def add(self, depth: int, correct: int, total: int) -> None:
        while len(self.correct) < depth:
            self.correct.append(0)
            self.total.append(0)
        self.correct[depth - 1] += correct
        self.total[depth - 1] += total

    def rates(self) -> list[float]:
        return [c / t if t else 0.0 for c, t in zip(self.correct, self.total, strict=True)]


def draft_vocabulary(samples: list[Sample], size: int, always: set[int]) -> torch.Tensor:
    """The ``size`` tokens the target most often writes in answers (``d2t``), plus
    ``always`` (end-of-generation tokens), most frequent first."""
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(s.target_next[s.answer].tolist())
    chosen = [t for t, _ in counts.most_common(size)]
    for t in sorted(always):
        if t not in chosen:
            chosen = chosen[:size - 1] + [t] if len(chosen) >= size else chosen + [t]
    return torch.tensor(chosen, dtype=torch.long)


def vocabulary_coverage(samples: list[Sample], d2t: torch.Tensor) -> float:
    """Share of answer tokens the draft vocabulary can propose at all."""
    keep = set(d2t.tolist())
    seen = np.concatenate([s.target_next[s.answer] for s in samples])
    return float(np.isin(seen, list(keep)).mean()) if len(seen) else 0.0


def unroll_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """Attention mask [n, step*n] of unroll ``step`` over the keys of steps 1..step.

    Query j may see true-feature keys (step 1) at positions <= j-step+1 and, from each
    later step s, only its own chain's key at position j-(step-s): exactly what a draft
    node at depth ``step`` sees at inference.
    """
    j = torch.arange(n, device=device)[:, None]
    i = torch.arange(n, device=device)[None, :]
    blocks = [i <= j - step + 1]
    blocks += [i == j - (step - s) for s in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def _window(sample: Sample, max_len: int, rng: np.random.Generator | None) -> int:
    """Start of a ``max_len`` window of a long sample that still holds answer tokens
    (random when training, the start of the answer when evaluating)."""
    if len(sample.tokens) <= max_len:
        return 0
    first = int(np.argmax(sample.answer))
    lo = max(0, min(first, len(sample.tokens) - max_len))
    return lo if rng is None else int(rng.integers(lo, len(sample.tokens) - max_len + 1))


def batch_tensors(samples: list[Sample], starts: list[int], max_len: int,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Samples padded into one batch: entry j pairs feature j with token j+1 and learns
    feature j+1; padding (and the unknown last target) has weight False."""
    ends = [min(len(s.tokens), a + max_len) for s, a in zip(samples, starts, strict=True)]
    n = max(e - a for a, e in zip(starts, ends, strict=True)) - 1
    b, d = len(samples), samples[0].features.shape[1]
    feat = np.zeros((b, n + 1, d), np.float32)
    tok = np.zeros((b, n + 1), np.int64)
    nxt = np.zeros((b, n + 1), np.int64)
    ans = np.zeros((b, n + 1), bool)
    for r, (s, a, e) in enumerate(zip(samples, starts, ends, strict=True)):
        feat[r, :e - a] = s.features[a:e]
        tok[r, :e - a] = s.tokens[a:e]
        nxt[r, :e - a] = s.target_next[a:e]
        ans[r, :e - a - 1] = s.answer[a + 1:e]  # weight of entry j: token j+1 is an answer
    t = {k: torch.from_numpy(v).to(device) for k, v in
         (("feat", feat), ("tok", tok), ("nxt", nxt), ("ans", ans))}
    return {"feat_in": t["feat"][:, :-1], "tok_in": t["tok"][:, 1:],
            "feat_tgt": t["feat"][:, 1:], "label": t["nxt"][:, 1:],
            "weight": t["ans"][:, :-1]}


def unrolled_losses(head: DraftHead, batch: dict[str, torch.Tensor], cfg: TrainConfig,
                    acc: DepthAccuracy, train: bool) -> torch.Tensor:
    """The weighted loss of a batch [B, n] over ``cfg.unroll`` steps; adds accuracies."""
    feat_in, feat_tgt, weight = batch["feat_in"], batch["feat_tgt"], batch["weight"]
    b, n = weight.shape
    device = feat_in.device
    positions = torch.arange(n, device=device)[None].expand(b, n)
    tok = batch["tok_in"]
    with torch.no_grad():
        p_target = F.softmax(head.logits(feat_tgt[weight]).float(), dim=-1)  # [N, V]
    x = feat_in
    if train and cfg.feature_noise > 0:
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        x = x + (torch.rand_like(x) * 2 - 1) * cfg.feature_noise * rms
    total = feat_in.new_zeros(())
    cache = None
    for step in range(1, cfg.unroll + 1):
        mask = None if step == 1 else unroll_mask(n, step, device)
        out, cache = head(x, tok, positions, cache, mask)  # [B, n, d]
        valid = weight.clone()
        valid[:, : step - 1] = False
        if valid.any():
            picked = out[valid]
            logits = head.logits(picked).float()
            reg = F.smooth_l1_loss(picked.float(), feat_tgt[valid], reduction="mean")
            p = p_target[valid[weight]]
            ce = -(p * F.log_softmax(logits, -1)).sum(-1).mean()
            total = total + cfg.depth_weight ** (step - 1) * (cfg.reg_weight * reg
                                                               + cfg.ce_weight * ce)
            guess = head.d2t[logits.argmax(-1)]
            acc.add(step, int((guess == batch["label"][valid]).sum()), int(valid.sum()))
        # Step k+1 reads the step-k prediction of the previous position.
        x = torch.cat([out.new_zeros(b, 1, out.shape[-1]), out[:, :-1]], dim=1)
    return total


def _autocast(cfg: TrainConfig, device: torch.device):  # noqa: ANN202
    enabled = cfg.bf16 and device.type == "cuda"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def evaluate(head: DraftHead, samples: list[Sample], cfg: TrainConfig) -> dict:
    """Mean loss and per-depth accuracy (draft argmax == target argmax) on ``samples``."""
    head.eval()
    acc = DepthAccuracy()
    losses = []
    device = head.lm_head.device
    usable = [s for s in samples if len(s.tokens) >= 3 and s.answer.any()]
    with torch.no_grad(), _autocast(cfg, device):
        for i in range(0, len(usable), 8):
            group = usable[i:i + 8]
            batch = batch_tensors(group, [_window(s, cfg.max_len, None) for s in group],
                                  cfg.max_len, device)
            losses.append(float(unrolled_losses(head, batch, cfg, acc, train=False)))
    head.train()
    return {"loss": float(np.mean(losses)) if losses else math.nan,
            "accuracy_by_depth": acc.rates()}


@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)


def _lr_at(step: int, cfg: Any, elapsed_s: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 10%; under a time limit the decay follows
    whichever runs out first, steps or time, so a cut-short run still anneals."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.time_limit_s:
        progress = max(progress, elapsed_s / cfg.time_limit_s)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _save_checkpoint(path: Path, head: DraftHead, opt: torch.optim.Optimizer,
                     state: TrainState, cfg: TrainConfig, head_cfg: HeadConfig) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": asdict(state),
                "train_config": asdict(cfg), "head_config": head_cfg.to_json()}, tmp)
    os.replace(tmp, path)


def optimise(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
             state: TrainState, cfg: Any, samples: list[Sample], device: torch.device,
             step_loss: Callable[[dict[str, torch.Tensor], DepthAccuracy], torch.Tensor],
             save: Callable[[], None],
             on_progress: Callable[[int, dict], None] | None = None) -> None:
    """The optimiser loop every head kind trains with: random windows of ``samples``,
    the learning-rate schedule, gradient clipping, accuracies by depth over the last 50
    steps, a checkpoint (``save``) every few minutes and on exit. ``cfg`` has ``steps``,
    ``seqs_per_step``, ``max_len``, ``clip``, ``lr``, ``warmup``, ``time_limit_s``,
    ``checkpoint_every_s`` and ``seed``."""
    rng = np.random.default_rng(cfg.seed + state.step)
    usable = [s for s in samples if len(s.tokens) >= 3 and s.answer.any()]
    if not usable:
        raise ValueError("no training samples with an answer")
    last_save = time.monotonic()
    t_start = time.monotonic() - state.seconds
    window = DepthAccuracy()
    window_loss: list[float] = []
    try:
        t_run = time.monotonic()
        t_limit = None if cfg.time_limit_s is None else time.monotonic() + cfg.time_limit_s
        while state.step < cfg.steps and (t_limit is None or time.monotonic() < t_limit):
            for group in opt.param_groups:
                group["lr"] = _lr_at(state.step, cfg, time.monotonic() - t_run)
            opt.zero_grad(set_to_none=True)
            acc = DepthAccuracy()
            group = [usable[i] for i in rng.integers(0, len(usable), cfg.seqs_per_step)]
            batch = batch_tensors(group, [_window(s, cfg.max_len, rng) for s in group],
                                  cfg.max_len, device)
            loss = step_loss(batch, acc)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            state.step += 1
            state.seconds = time.monotonic() - t_start
            for d, (c, t) in enumerate(zip(acc.correct, acc.total, strict=True), start=1):
                window.add(d, c, t)
            window_loss.append(float(loss.detach()))
            if on_progress:
                on_progress(state.step, {"loss": float(np.mean(window_loss[-50:])),
                                         "acc": window.rates()})
            if state.step % 50 == 0:
                window = DepthAccuracy()
            if time.monotonic() - last_save > cfg.checkpoint_every_s:
                save()
                last_save = time.monotonic()
    finally:
        state.seconds = time.monotonic() - t_start
        save()


def train(head: DraftHead, train_samples: list[Sample], eval_samples: list[Sample],
          cfg: TrainConfig, work_dir: Path,
          on_progress: Callable[[int, dict], None] | None = None) -> TrainState:
    """Train ``head`` in place for ``cfg.steps`` steps, resuming from ``work_dir``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    device = head.lm_head.device
    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    state = TrainState()
    ckpt_path = work_dir / CHECKPOINT
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        if HeadConfig.from_json(ckpt["head_config"]) != head.cfg:
            raise ValueError(f"{ckpt_path} belongs to another head configuration; "
                             "use another --work-dir")
        head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["opt"])
        state = TrainState(**ckpt["state"])

    def step_loss(batch: dict[str, torch.Tensor], acc: DepthAccuracy) -> torch.Tensor:
        with _autocast(cfg, device):
            return unrolled_losses(head, batch, cfg, acc, train=True)

    head.train()
    optimise(params, opt, state, cfg, train_samples, device, step_loss,
             lambda: _save_checkpoint(ckpt_path, head, opt, state, cfg, head.cfg),
             on_progress)
    if eval_samples:
        state.history.append({"step": state.step, **evaluate(head, eval_samples, cfg)})
        (work_dir / "eval.json").write_text(json.dumps(state.history[-1], indent=2))
    return state
