"""The one fallback policy every entry point (CLI, bench, app, calibration) opens a
drafter with: the head on its device, then on the CPU, then drafts from memory; a
llama.cpp drafter that cannot run means drafts from memory; a drafter that cannot be
built at all means plain decoding. Each step's reason is kept as a note."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.drafters.base import Drafter
from engine.drafters.factory import build_drafter
from engine.drafters.kinds import DrafterKind
from engine.drafters.spec import DrafterSpec
from engine.drafters.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from engine.runtime.target import Target
    from models.head_config import TargetFingerprint

log = logging.getLogger(__name__)


def open_drafter(spec: DrafterSpec, target: Target | None = None,
                 fingerprint: TargetFingerprint | None = None,
                 memory: SuffixIndex | None = None) -> tuple[Drafter | None, list[str]]:
    """The drafter ``spec`` names, or the next one down the fallback chain (head on its
    device, head on the CPU, drafts from memory, plain), with a note for each fallback
    that names the file or device and the reason."""
    notes: list[str] = []
    if spec.kind.head:
        devices = [spec.device] + (["cpu"] if spec.device != "cpu" else [])
        for device in devices:
            try:
                drafter = build_drafter(replace(spec, device=device), target, fingerprint,
                                        memory)
                # What could not be checked (an EAGLE-1 head's tokenizer) is said too.
                return drafter, notes + list(drafter.load_notes if drafter else ())
            except Exception as exc:  # noqa: BLE001 - bad file, no device, out of memory
                log.info("draft head on %s failed: %s", device, exc)
                notes.append(f"the draft head could not run on {device}: {exc}")
                if not _device_problem(exc):
                    break  # the files themselves are wrong: another device will not help
        notes.append("using drafts from memory instead")
        spec = DrafterSpec(DrafterKind.MEMORY)
    if spec.kind.native:
        try:
            return build_drafter(spec, target, fingerprint, memory), notes
        except Exception as exc:  # noqa: BLE001 - bad file, another vocabulary, memory
            notes.append(f"the {spec.kind.native} could not run: {exc}; using drafts from "
                         "memory instead")
            spec = DrafterSpec(DrafterKind.MEMORY)
    try:
        return build_drafter(spec, target, fingerprint, memory), notes
    except Exception as exc:  # noqa: BLE001 - nothing left to try but plain decoding
        notes.append(f"the {spec.kind} drafter could not start ({exc}); plain decoding")
        return None, notes


def _device_problem(exc: Exception) -> bool:
    """Whether another device might succeed (out of memory, no such device, driver)."""
    from engine.errors import IncompatibleDraftError

    return not isinstance(exc, IncompatibleDraftError | FileNotFoundError | ValueError) or (
        "out of memory" in str(exc).lower())
