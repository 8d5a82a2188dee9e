"""Drafters by name, as the CLI, the bench and the app choose them."""

from __future__ import annotations

from pathlib import Path

from engine.drafters.base import Drafter
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter

HEAD_DRAFTERS = ("head", "head-chain", "head-multi", "head-ahead")
DRAFTER_NAMES = ("none", "lookup", *HEAD_DRAFTERS)
# The head trained for the bundled model (README says how it was made).
DEFAULT_HEAD_DIR = Path(__file__).resolve().parents[2] / "assets" / "draft-head-smollm2-135m"


def make_drafter(name: str, target=None, head_dir: Path | None = None,  # noqa: ANN001
                 device: str = "cpu", **head_options: object) -> Drafter | None:
    """A fresh drafter for ``name``; None means plain decoding. ``head`` (an EAGLE-2
    tree), ``head-chain`` and ``head-multi`` (DuoDecoding's multi-sequence) need the
    ``target`` (an engine.target.Target) whose features they read; ``device`` is where
    the head runs. Raises ValueError, or HeadMismatchError / FileNotFoundError for an
    unusable head."""
    if name == "none":
        return None
    if name == "lookup":
        return PromptLookupDrafter(LookupConfig())
    if name in HEAD_DRAFTERS:
        if name == "head-ahead":
            head_options = {"mode": "chain", "draft_ahead": True, **head_options}
        elif name != "head":
            head_options = {**head_options, "mode": name.removeprefix("head-")}
        if target is None:
            raise ValueError("the head drafter needs the target model")
        from engine.drafters.head import HeadDrafterConfig, load_head_drafter

        directory = Path(head_dir) if head_dir else DEFAULT_HEAD_DIR
        if not (directory / "head.json").is_file():
            raise FileNotFoundError(f"no draft head in {directory} (head.json missing)")
        return load_head_drafter(directory, target.path, target.model.pieces(),
                                 HeadDrafterConfig(**head_options),  # type: ignore[arg-type]
                                 device=device)
    raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTER_NAMES)}")


__all__ = ["DEFAULT_HEAD_DIR", "DRAFTER_NAMES", "HEAD_DRAFTERS", "Drafter", "LookupConfig",
           "PromptLookupDrafter", "make_drafter"]
