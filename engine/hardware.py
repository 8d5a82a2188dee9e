"""Facts about the machine the engine runs on."""

from __future__ import annotations

import os

import psutil


def physical_cores() -> int:
    """Physical cores (hyper-threads share a core's units, and decode is compute-bound)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def default_threads() -> int:
    """Threads for the target: one per physical core."""
    return max(1, physical_cores())
