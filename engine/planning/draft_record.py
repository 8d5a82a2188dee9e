"""What a draft model really achieved with a target, kept across conversations.

The planner prices a draft model from its acceptance by depth. Before a pair has run,
that is a prior; every answer drafted with the pair adds its steps here, and the next
plan uses the prior corrected by them (each depth's rate is the prior worth
``PRIOR_STEPS`` steps plus the steps that reached that depth). One small JSON file beside
the calibration cache, written atomically; a damaged file is an empty record."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from engine.decoding.stats import StepStats
from engine.planning.json_store import read_dict, write_dict

RECORD_FILE = "draft_record.json"
PRIOR_STEPS = 32  # how many observed steps the prior is worth at each depth
MAX_DEPTH = 8


def pair_key(target: Path, draft: Path) -> str:
    """The pair, by file names and sizes (a re-download of the same file keeps it)."""
    return f"{Path(target).name}:{Path(target).stat().st_size}|" \
           f"{Path(draft).name}:{Path(draft).stat().st_size}"


def mtp_key(target: Path) -> str:
    """The record of a model's own MTP block drafting for it."""
    return f"{Path(target).name}:{Path(target).stat().st_size}|mtp"


def depth_counts(steps: Iterable[StepStats]) -> tuple[list[int], list[int]]:
    """(steps that reached depth j, steps that had depth j accepted), j = 1..MAX_DEPTH.
    Depth j is reached when the first j - 1 drafts were accepted and at least j were
    proposed (side sequences make that an upper bound on the chain's own length)."""
    reached, accepted = [0] * MAX_DEPTH, [0] * MAX_DEPTH
    for s in steps:
        if s.n_proposed == 0:
            continue
        for j in range(min(s.n_proposed, MAX_DEPTH)):
            if s.n_accepted < j:
                break
            reached[j] += 1
            accepted[j] += s.n_accepted > j
    return reached, accepted


class DraftRecord:
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / RECORD_FILE

    def _read(self) -> dict:
        return read_dict(self.path)

    def add(self, key: str, steps: Iterable[StepStats]) -> None:
        """Count a generation's drafting steps for the pair ``key``."""
        reached, accepted = depth_counts(steps)
        if not reached[0]:
            return
        data = self._read()
        entry = data.get(key) or {"reached": [0] * MAX_DEPTH, "accepted": [0] * MAX_DEPTH}
        try:
            entry = {name: [int(a) + b for a, b in zip(entry[name], new, strict=True)]
                     for name, new in (("reached", reached), ("accepted", accepted))}
        except (KeyError, TypeError, ValueError):
            entry = {"reached": reached, "accepted": accepted}
        data[key] = entry
        write_dict(self.path, data)

    def acceptance(self, key: str, prior: tuple[float, ...],
                   prior_is: str = "the prior for a draft model of the target's family"
                   ) -> tuple[tuple[float, ...], str]:
        """(acceptance by depth, where it came from): the prior corrected by the pair's
        record, or the prior alone (``prior_is`` says what it is)."""
        entry = self._read().get(key)
        try:
            reached = [int(x) for x in entry["reached"]][:MAX_DEPTH]
            accepted = [int(x) for x in entry["accepted"]][:MAX_DEPTH]
        except (KeyError, TypeError, ValueError):
            return prior, prior_is
        rates = []
        for j in range(len(prior)):
            r, a = (reached[j], accepted[j]) if j < len(reached) else (0, 0)
            rates.append((prior[j] * PRIOR_STEPS + a) / (PRIOR_STEPS + r))
        return tuple(rates), f"measured over {reached[0]} drafting steps with this pair"
