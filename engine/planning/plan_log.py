"""When the plan changed and why, kept across starts: the dashboard and ``tandem plan``
show the last change. One small JSON file beside the calibration cache (written
atomically; a damaged file is an empty log), the last ``KEEP`` changes per cache key."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

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
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only disk must not stop the chat
        return event
