"""Saving and loading a draft head: safetensors weights plus its JSON config."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.draft_head import DraftHead
from models.head_config import HeadConfig, TargetFingerprint

WEIGHTS = "head.safetensors"
CONFIG = "head.json"


class HeadMismatchError(ValueError):
    """The head was trained for another target; the message names both values."""


def save_head(head: DraftHead, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # Weights in float16 halve the file (the head computes in float32 on a CPU: it is
    # loaded back as float32).
    state = {k: (v.half() if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(directory / WEIGHTS))
    head.cfg.save(directory / CONFIG)


def load_head(directory: Path, target: TargetFingerprint, embed: torch.Tensor,
              lm_head: torch.Tensor, device: str = "cpu") -> DraftHead:
    """Load a head for ``target``. Raises HeadMismatchError when it does not fit and
    FileNotFoundError when the files are missing."""
    cfg = HeadConfig.load(directory / CONFIG)
    if cfg.target is not None:
        problems = cfg.target.mismatches(target)
        if problems:
            raise HeadMismatchError(f"draft head {directory} does not fit this target: "
                                    + "; ".join(problems))
    state = {k: v.float() if v.is_floating_point() else v
             for k, v in load_file(str(directory / WEIGHTS), device=device).items()}
    head = DraftHead(cfg, embed.to(device), lm_head.to(device), state["d2t"].to(device))
    head.load_state_dict(state)
    return head.to(device).eval()
