"""What follows the drafter in use: the acceptance record its answers correct
(engine.planning.draft_record), and the governor that pauses ``auto``'s drafter when
its drafts do not pay."""

from __future__ import annotations

from pathlib import Path

from engine.decoding.budget import SpeculationGovernor
from engine.drafters.base import Drafter
from engine.drafters.kinds import Record
from engine.planning.draft_record import mtp_key, pair_key


def record_key(model: Path, drafter: Drafter | None) -> str | None:
    """The record ``drafter``'s steps add to with the target ``model`` (the pair's, or
    the model's own block's), or None when its kind keeps none (a fallback's)."""
    kind = drafter.kind if drafter is not None else None
    if drafter is None or kind is None or kind.record is None:
        return None
    if kind.record is Record.OWN:
        return mtp_key(model)
    return pair_key(model, drafter.path) if drafter.path is not None else None


def governor_for(drafter: Drafter) -> SpeculationGovernor:
    """The governor of a drafter ``auto`` chose. A head or draft model whose drafts cost
    time and are not accepted is paused and probed again. Drafts from memory cost
    microseconds and their hits come in bursts: they are let off 5% of a token and
    paused 32 steps at most, so a repeat is not missed for long, and a new prompt ends
    their pause (what it brings is judged by a probe of its own)."""
    if drafter.is_draft_model:
        return SpeculationGovernor()
    return SpeculationGovernor(tolerance=0.05, max_pause=32, resume_on_new_request=True)
