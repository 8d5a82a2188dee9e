"""Small JSON files beside the calibration cache (the draft record, the plan log): a
damaged or missing file reads as empty, and a write replaces the file atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_dict(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_dict(path: Path, data: dict) -> None:
    """Raises OSError (a full or read-only disk): callers decide whether it matters."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
