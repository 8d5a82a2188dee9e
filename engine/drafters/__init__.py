"""Drafters by name, as the CLI, the bench and the app choose them."""

from __future__ import annotations

from engine.drafters.base import Drafter
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter

DRAFTER_NAMES = ("none", "lookup")


def make_drafter(name: str) -> Drafter | None:
    """A fresh drafter for ``name``; None means plain decoding. Raises ValueError."""
    if name == "none":
        return None
    if name == "lookup":
        return PromptLookupDrafter(LookupConfig())
    raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTER_NAMES)}")


__all__ = ["DRAFTER_NAMES", "Drafter", "LookupConfig", "PromptLookupDrafter", "make_drafter"]
