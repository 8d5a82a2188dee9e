"""The engine's plan in one sentence a user reads ("Drafting from earlier answers: about
1.2x faster here, same answer as without"); the kernel details stay behind "Details"."""

from __future__ import annotations

from app.gui.engine_worker import EngineReady
from engine.drafters.kinds import DrafterKind
from engine.planning.kernels import EXACT

# Below this predicted gain the plan is "about as fast as plain decoding".
SHOWN_GAIN = 1.05


def plan_in_words(ready: EngineReady) -> str:
    """One sentence: what drafts, the speed-up expected here, and whether the answers
    are the ones the model alone would give."""
    same = ("same answer as without" if ready.guarantee.startswith(EXACT)
            else "answers may differ slightly from the model's alone (see Details)")
    kind = DrafterKind.of(ready.drafter)
    if kind is DrafterKind.NONE:
        why = ("drafting would not pay on this machine" if ready.plan is not None
               else "as chosen")
        return f"Plain decoding, one token at a time: {why}."
    # What drafts, in the user's words (the registry's), for the engine's drafter.
    what = kind.drafting if kind is not None and kind.drafting else \
        f"Drafting with {ready.drafter}"
    if ready.plan is None:
        return f"{what}, as chosen: {same}."
    speedup = float(ready.plan.get("predicted_speedup") or 1.0)
    speed = (f"about {speedup:.1f}x faster here" if speedup >= SHOWN_GAIN
             else "about as fast as plain decoding here")
    return f"{what}: {speed}, {same}."
