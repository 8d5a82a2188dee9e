"""One model's memory of what it wrote before, on disk: a file per model and tokenizer,
opened when a drafter first reads it (a missing or unusable file is an empty memory, the
latter with a note) and saved after each answer a drafter from memory remembered."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.drafters.suffix_index import SuffixIndex, open_memory

log = logging.getLogger(__name__)

FOLDER = "memory"  # where the memories are kept in Tandem's data directory


@dataclass(frozen=True)
class MemoryFile:
    path: Path
    tag: str  # the tokenizer's hash: a memory of other token ids is not read

    @classmethod
    def of_model(cls, directory: Path, model: Path, tokenizer_sha256: str) -> MemoryFile:
        """The memory of ``model`` (its tokenizer's hash ``tokenizer_sha256``) kept in
        ``directory``."""
        return cls(Path(directory) / f"{Path(model).stem}-{tokenizer_sha256[:12]}.idx",
                   tokenizer_sha256)

    def open(self) -> tuple[SuffixIndex, str]:
        """The memory and a note for the user ("" unless the file was unusable)."""
        return open_memory(self.path, tag=self.tag)

    def save(self, memory: SuffixIndex) -> None:
        """Write ``memory``; a full or read-only disk is logged, never raised: it must
        not stop the chat."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            memory.save(self.path)
        except OSError as exc:
            log.warning("could not save the draft memory to %s: %s", self.path, exc)
