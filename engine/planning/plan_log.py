"""When the plan changed and why, kept across starts: the dashboard and ``tandem plan``
show the last change. One small JSON file beside the calibration cache (written
atomically; a damaged file is an empty log), the last ``KEEP`` changes per cache key."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.planning.json_store import read_dict, write_dict

LOG_FILE = "plan_log.json"
KEEP = 20


@dataclass(frozen=True)
class PlanEvent:
    at: float  # seconds since the epoch
    plan: str  # the plan's layout in words (Plan.layout_text)
    why: str  # what set it: a first measurement, a new one, answers that disagreed

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at))
        return f"{when}: {self.why}"


class PlanLog:
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOG_FILE

    def _read(self) -> dict:
        return read_dict(self.path)

    def events(self, key: str) -> list[PlanEvent]:
        out = []
        for entry in self._read().get(key) or []:
            try:
                out.append(PlanEvent(float(entry["at"]), str(entry["plan"]), str(entry["why"])))
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def record(self, key: str, plan: str, why: str) -> PlanEvent:
        """Add a change (the disk may refuse: the event still comes back)."""
        event = PlanEvent(time.time(), plan, why)
        data = self._read()
        kept = [e for e in data.get(key) or [] if isinstance(e, dict)][-(KEEP - 1):]
        data[key] = [*kept, asdict(event)]
        with contextlib.suppress(OSError):  # a read-only disk must not stop the chat
            write_dict(self.path, data)
        return event
