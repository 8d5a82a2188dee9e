"""Whether a draft head fits a target, and whether this install can run Tandem's torch
head at all: read from the files, without torch (the packaged build ships none)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from engine.errors import IncompatibleDraftError
from models.eagle1_config import is_eagle1_dir, read_eagle1_config
from models.head_config import HeadConfig, TargetFingerprint

# An EAGLE-1 config names no tokenizer: a head for another tokenizer of the same size
# loads (still lossless, since the target verifies, but it would rarely be accepted).
EAGLE1_UNCHECKED = ("its config.json names no tokenizer, so only hidden_size and "
                    "vocab_size could be checked, not the tokenizer")


@functools.cache
def torch_available() -> bool:
    """torch can be imported here (without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken install, or torch blocked in sys.modules
        return False


NO_TORCH = ("torch is not installed (the packaged build leaves it out: EAGLE-3 heads run "
            "through llama.cpp; a source install, make run, has it)")


def check_head_fits(head_dir: Path, target: TargetFingerprint) -> HeadConfig:
    """The head's config if it was trained for ``target``. Raises FileNotFoundError (no
    head there), IncompatibleDraftError naming each field that differs, ValueError for
    an unreadable ``head.json`` (the message names the file). A public EAGLE-1 head
    (config.json) is checked on what it names: its width and vocabulary size."""
    if is_eagle1_dir(head_dir):
        return _check_eagle1_fits(head_dir, target)
    path = Path(head_dir) / "head.json"
    if not path.is_file():
        raise FileNotFoundError(f"no draft head in {head_dir} (head.json missing, and no "
                                "EAGLE-1 config.json)")
    try:
        cfg = HeadConfig.load(path)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path} is not a draft head config ({exc})") from exc
    if cfg.target is not None:
        differences = cfg.target.differences(target)
        if differences:
            raise IncompatibleDraftError(f"the draft head in {head_dir}", differences)
    return cfg


def _check_eagle1_fits(head_dir: Path, target: TargetFingerprint) -> HeadConfig:
    eagle = read_eagle1_config(head_dir)
    differences = [(name, mine, theirs) for name, mine, theirs in (
        ("hidden_size", eagle.head.hidden_size, target.hidden_size),
        ("vocab_size", eagle.vocab_size, target.vocab_size)) if mine != theirs]
    if differences:
        raise IncompatibleDraftError(f"the EAGLE-1 head in {head_dir} ({EAGLE1_UNCHECKED})",
                                     differences)
    return eagle.head
