"""What a model can draft with, and why not where it cannot: drafts from memory, prompt
lookup, a draft model, Tandem's torch head, an EAGLE-3 head run by llama.cpp and the
model's own MTP block. The GUI's drafter selector and ``tandem models drafters`` show
this list; it reads headers and vocabularies only (vocab-only loads, milliseconds), so
the weights are not loaded to say what would run (issue 35, item 5)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.drafters.eagle3 import check_eagle3_head
from engine.drafters.head_fit import NO_TORCH, check_head_fits, torch_available
from engine.drafters.kinds import DrafterKind
from engine.drafters.mtp import why_no_mtp_block
from engine.drafters.spec import DEFAULT_EAGLE3_HEAD, DEFAULT_HEAD_DIR
from engine.errors import IncompatibleDraftError, ModelLoadError, TandemError
from engine.gguf.eagle3 import EAGLE3_ARCHITECTURE
from engine.gguf.header import GGUFFacts, read_file_facts
from engine.hub.draft_pairing import compatible_local_drafts
from engine.runtime.architecture import LAYER_INPUT_ARCHITECTURES
from engine.runtime.model_info import ModelInfo
from engine.runtime.native import NativeModel

# Families with public EAGLE-3 heads (llama.cpp's docs/speculative.md lists them).
PUBLIC_EAGLE3_FAMILIES = "Llama 3.1/3.3, Qwen3, gpt-oss and Gemma 4"
# The drafters a model is asked about, in the order they are listed.
LISTED = (DrafterKind.MEMORY, DrafterKind.LOOKUP, DrafterKind.DRAFT, DrafterKind.HEAD,
          DrafterKind.EAGLE3, DrafterKind.MTP)


@dataclass(frozen=True)
class DrafterOption:
    drafter: DrafterKind
    label: str
    available: bool
    detail: str  # what it would draft with, or why it is not offered

    def line(self) -> str:
        return f"{self.label}: {self.detail}" if self.available else \
            f"{self.label}: not offered ({self.detail})"


def drafter_options(info: ModelInfo, draft_candidates: Iterable[tuple[str, Path]] = (),
                    eagle3_heads: Sequence[Path] = (), head_dir: Path | None = None
                    ) -> list[DrafterOption]:
    """Every drafter for the model ``info`` describes, available or with the reason it is
    not. ``draft_candidates``: (name, path) of local GGUFs that might draft for it;
    ``eagle3_heads``: head GGUFs to try besides the bundled one; ``head_dir``: a torch
    head besides the bundled one."""
    if info.why_plain is not None:
        return [DrafterOption(kind, kind.label, False, info.why_plain) for kind in LISTED]
    memory, lookup = DrafterKind.MEMORY, DrafterKind.LOOKUP
    return [
        DrafterOption(memory, memory.label, True,
                      "earlier answers and the conversation, no extra weights"),
        DrafterOption(lookup, lookup.label, True, "n-grams of the prompt"),
        _draft_model_option(info, draft_candidates),
        _torch_head_option(info, head_dir),
        _eagle3_option(info, eagle3_heads),
        mtp_option(info.header),
    ]


def _draft_model_option(info: ModelInfo, candidates: Iterable[tuple[str, Path]]
                        ) -> DrafterOption:
    kind = DrafterKind.DRAFT
    try:
        drafts = compatible_local_drafts(info.path, candidates)
    except (TandemError, ValueError, OSError) as exc:
        return DrafterOption(kind, kind.label, False, f"its header cannot be read ({exc})")
    if not drafts:
        return DrafterOption(kind, kind.label, False,
                             "no local model of its family is small enough and shares its "
                             "vocabulary (tandem models search finds one)")
    return DrafterOption(kind, kind.label, True, ", ".join(d.name for d in drafts))


def _torch_head_option(info: ModelInfo, head_dir: Path | None) -> DrafterOption:
    kind = DrafterKind.HEAD
    if not torch_available():
        return DrafterOption(kind, kind.label, False, NO_TORCH)
    reasons = []
    for folder in ([head_dir] if head_dir else []) + [DEFAULT_HEAD_DIR]:
        try:
            check_head_fits(folder, info.fingerprint)
        except (FileNotFoundError, TandemError, ValueError) as exc:
            reasons.append(str(exc))
            continue
        return DrafterOption(kind, kind.label, True, str(folder))
    return DrafterOption(kind, kind.label, False,
                         reasons[0] if head_dir else "the bundled head is for the bundled "
                         "model only; tandem train-draft trains one")


def eagle3_heads_dir() -> Path:
    """Where ``tandem models import-eagle3`` writes heads, and where they are looked for."""
    from engine.hub.model_store import data_dir

    return data_dir() / "heads"


def find_eagle3_head(info: ModelInfo, heads: Sequence[Path] = ()) -> tuple[Path | None,
                                                                        list[str]]:
    """The first EAGLE-3 head GGUF that fits the model: ``heads``, then the imported ones,
    then the bundled one; None with the reasons each was refused. Reads headers and
    vocabularies only, and the model's vocabulary only for a head whose header fits: auto
    looks at every start, and a vocabulary-only load is not free (docs/benchmarks.md:
    figures behind the code's rules, "Reading GGUF headers")."""
    imported = sorted(eagle3_heads_dir().glob("*.gguf"))
    reasons: list[str] = []
    candidates = []
    for path in (Path(p) for p in (*heads, *imported, DEFAULT_EAGLE3_HEAD)):
        if path.is_file():
            why = _header_misfit(path, info)
            reasons += [why] if why else []
            candidates += [] if why else [path]
    if not candidates:
        return None, reasons
    with NativeModel(info.path, vocab_only=True) as target:
        for path in candidates:
            try:
                # Whole (its layer ids), mapped without repacking: no copy of its weights.
                with NativeModel(path, repack=False) as head:
                    check_eagle3_head(head, target, (info.n_layer, info.n_embd))
            except TandemError as exc:
                reasons.append(str(exc))
                continue
            return path, reasons
    return None, reasons


def _header_misfit(head: Path, info: ModelInfo) -> str | None:
    """Why ``head`` cannot fit the model, from its header alone (``check_eagle3_head``'s
    first checks); None when the header leaves it possible."""
    try:
        facts = read_file_facts(head)
    except (OSError, ValueError, ModelLoadError):
        return None  # the full check says what is wrong with the file
    if facts.architecture != EAGLE3_ARCHITECTURE:
        found = [("architecture", facts.architecture, EAGLE3_ARCHITECTURE)]
    elif facts.hidden_size and info.n_embd and facts.hidden_size != info.n_embd:
        found = [("hidden size", facts.hidden_size, info.n_embd)]
    else:
        return None
    return str(IncompatibleDraftError(head.name, found))


def _eagle3_option(info: ModelInfo, heads: Sequence[Path]) -> DrafterOption:
    kind = DrafterKind.EAGLE3
    arch = info.header.architecture or "unknown"
    if arch not in LAYER_INPUT_ARCHITECTURES:
        return DrafterOption(kind, kind.label, False,
                             f"llama.cpp's {arch} graph cannot export the layer inputs a "
                             "head reads")
    path, reasons = find_eagle3_head(info, heads)
    if path is not None:
        where = str(path) if path != DEFAULT_EAGLE3_HEAD else \
            f"{path.parent.name}/{path.name} (bundled)"
        return DrafterOption(kind, kind.label, True, where)
    why = (reasons[0] if heads and reasons else
           f"no EAGLE-3 head for it here (public heads exist for {PUBLIC_EAGLE3_FAMILIES}; "
           "tandem train-draft --fusion eagle3 trains one)")
    return DrafterOption(kind, kind.label, False, why)


def usable_eagle3_head(info: ModelInfo) -> Path | None:
    """The EAGLE-3 head auto may price for this model (imported or bundled), or None."""
    if (info.header.architecture or "") not in LAYER_INPUT_ARCHITECTURES:
        return None
    return find_eagle3_head(info)[0]


def shipped_acceptance(head: Path) -> tuple[tuple[float, ...], str] | None:
    """The acceptance by depth a head GGUF ships beside it: ``acceptance.json``
    (``by_depth``, measured on chats) or its training report's held-out accuracy by
    depth; None when it ships neither."""
    folder = Path(head).parent
    for name, keys, source in (
            ("acceptance.json", ("by_depth",), "measured on chats when it was made"),
            ("train_report.json", ("eval_teacher_forced", "accuracy_by_depth"),
             "its training's held-out accuracy")):
        path = folder / name
        if not path.is_file():
            continue
        try:
            value: object = json.loads(path.read_text())
            for key in keys:
                value = value[key]  # type: ignore[index]
            acceptance = tuple(float(a) for a in value)  # type: ignore[union-attr]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if acceptance and all(0.0 <= a <= 1.0 for a in acceptance):
            return acceptance, source
    return None


def mtp_option(header: GGUFFacts) -> DrafterOption:
    """From the header alone (``nextn_predict_layers``): a file not downloaded yet too."""
    why = why_no_mtp_block(header.architecture or "unknown", header.mtp_layers)
    return DrafterOption(DrafterKind.MTP, DrafterKind.MTP.label, why is None,
                         why or "its own next-token block, no download")
