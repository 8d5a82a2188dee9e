"""What to draft with: a ``DrafterSpec`` names a kind (engine.drafters.kinds) and the
files, device and options it is built with; the heads shipped with Tandem."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.drafters.kinds import DrafterKind

# The head trained for the bundled model (README says how it was made).
DEFAULT_HEAD_DIR = Path(__file__).resolve().parents[2] / "assets" / "draft-head-smollm2-135m"
# The EAGLE-3 head trained for the bundled model (docs/eagle3-notes.md says how).
DEFAULT_EAGLE3_HEAD = (Path(__file__).resolve().parents[2] / "assets"
                       / "eagle3-smollm2-135m" / "head.gguf")


@dataclass(frozen=True)
class DrafterSpec:
    """What to draft with. ``kind`` is a DrafterKind or its name (``auto`` is refused:
    it is no drafter). ``head_options`` go to the head drafter's config (mode, depth,
    top_k, draft_ahead, dynamic_depth); for a draft model, ``depth``, ``n_gpu_layers``
    and ``draft_ahead``; for a llama.cpp head, ``depth``."""

    kind: DrafterKind = DrafterKind.MEMORY
    # None: the head shipped for the bundled model; for an EAGLE-3 head, its GGUF
    head_dir: Path | None = None
    device: str = "cpu"
    head_options: dict[str, object] = field(default_factory=dict)
    draft_model: Path | None = None  # the GGUF a draft model drafter runs

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", DrafterKind.parse(self.kind, auto=False))

    @property
    def head_path(self) -> Path:
        return Path(self.head_dir) if self.head_dir else DEFAULT_HEAD_DIR
