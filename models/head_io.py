"""Saving and loading a draft head: safetensors weights plus its JSON config."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.draft_head import DraftHead
from models.head_config import HeadConfig

WEIGHTS = "head.safetensors"
CONFIG = "head.json"


def save_head(head: DraftHead, directory: Path) -> None:
    if head.is_int8:
        raise ValueError("an int8 head is for drafting only: save the float head it was "
                         "made from")
    directory.mkdir(parents=True, exist_ok=True)
    # Weights in float16 halve the file (the head computes in float32 on a CPU: it is
    # loaded back as float32).
    state = {k: (v.half() if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(directory / WEIGHTS))
    head.cfg.save(directory / CONFIG)


def load_head(directory: Path, embed: torch.Tensor, lm_head: torch.Tensor,
              device: str = "cpu") -> DraftHead:
    """Load a head with its target's ``embed`` and ``lm_head`` matrices. The caller has
    checked that the head fits the target (``HeadConfig.target``). Raises
    FileNotFoundError when the files are missing, ValueError/RuntimeError when they are
    not a head of the shapes its config names."""
    cfg = HeadConfig.load(directory / CONFIG)
    state = {k: v.float() if v.is_floating_point() else v
             for k, v in load_file(str(directory / WEIGHTS), device=device).items()}
    head = DraftHead(cfg, embed.to(device), lm_head.to(device), state["d2t"].to(device))
    head.load_state_dict(state)
    return head.to(device).eval()
