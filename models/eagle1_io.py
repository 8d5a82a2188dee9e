"""Loading a public EAGLE-1 head (SafeAILab's ``cnets1.Model`` weights) as a DraftHead.

EAGLE-1's forward is DraftHead's with ``fusion="fc"``: ``fc(cat(embed(x_{t+1}), f_t))``
(embedding first), decoder layers of which the first has no input norm, no final norm,
and the target's own LM head on the output. Only the names differ; the target's
embedding and LM head come from its GGUF, as for Tandem's heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch

from models.draft_head import DraftHead
from models.eagle1_config import read_eagle1_config, weights_file
from models.head_config import HeadConfig


def tensor_names(cfg: HeadConfig) -> dict[str, str]:
    """EAGLE-1 tensor name -> DraftHead state name, for every tensor the head needs."""
    names = {"fc.weight": "fusion.fc.weight"}
    if cfg.fc_bias:
        names["fc.bias"] = "fusion.fc.bias"
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"blocks.{i}."
        for proj in ("q", "k", "v", "o"):
            names[f"{src}self_attn.{proj}_proj.weight"] = f"{dst}{proj}.weight"
        if cfg.qkv_bias:
            for proj in ("q", "k", "v"):
                names[f"{src}self_attn.{proj}_proj.bias"] = f"{dst}{proj}.bias"
        for proj in ("gate", "up", "down"):
            names[f"{src}mlp.{proj}_proj.weight"] = f"{dst}{proj}.weight"
        names[f"{src}post_attention_layernorm.weight"] = f"{dst}post_norm.weight"
        if i > 0:  # EAGLE's layer 0 has no input_layernorm (the fc output goes straight in)
            names[f"{src}input_layernorm.weight"] = f"{dst}input_norm.weight"
    return names


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` or ``pytorch_model.bin`` file. Raises ValueError
    naming the file when it cannot be read as one."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:  # weights_only: a checkpoint from the internet must not run code
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - each format fails its own way
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path} could not be read as a weights file ({first})") from exc
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor)
                                                for v in tensors.values()):
        raise ValueError(f"{path} does not hold a dictionary of tensors")
    return tensors


def draft_vocabulary(vocab_size: int, size: int, keep: Iterable[int] = ()) -> torch.Tensor | None:
    """``d2t`` for a draft vocabulary of the first ``size`` ids plus ``keep`` (the
    end-of-generation tokens), or None for the whole vocabulary. BPE vocabularies number
    tokens in merge order, which roughly follows frequency; any subset is lossless,
    since the target verifies every drafted token."""
    if size <= 0 or size >= vocab_size:
        return None
    ids = set(range(size)) | {int(t) for t in keep if 0 <= int(t) < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def load_eagle1(directory: Path, embed: torch.Tensor, lm_head: torch.Tensor,
                device: str = "cpu", draft_vocab_size: int = 0,
                keep_ids: Iterable[int] = ()) -> DraftHead:
    """The EAGLE-1 head in ``directory`` with its target's ``embed`` and ``lm_head``
    ([vocab, hidden]); the caller has checked that it fits the target. With
    ``draft_vocab_size`` only that many LM-head rows are kept (see draft_vocabulary).
    Raises FileNotFoundError (no weights file), ValueError naming the file and the
    tensor when one is missing or of the wrong shape."""
    cfg = read_eagle1_config(directory).head
    d2t = draft_vocabulary(lm_head.shape[0], draft_vocab_size, keep_ids)
    if d2t is not None:
        cfg = dataclasses.replace(cfg, draft_vocab_size=len(d2t))
    path = weights_file(directory)
    tensors = read_tensors(path)
    head = DraftHead(cfg, embed, lm_head, d2t)
    wanted = head.state_dict()
    state: dict[str, torch.Tensor] = {"d2t": wanted["d2t"]}
    # Other tensors (a copy of embed_tokens, rotary tables) are ignored, as EAGLE's own
    # strict=False load ignores them.
    for src, dst in tensor_names(cfg).items():
        if src not in tensors:
            raise ValueError(f"{path} lacks tensor {src} (an EAGLE-1 head as its "
                             f"config.json describes has it)")
        t = tensors[src]
        if tuple(t.shape) != tuple(wanted[dst].shape):
            raise ValueError(f"{path}: tensor {src} has shape {list(t.shape)}, its "
                             f"config.json implies {list(wanted[dst].shape)}")
        state[dst] = t.float()  # stored in fp16/bf16; the head computes in float32
    head.load_state_dict(state)
    return head.to(device).eval()
