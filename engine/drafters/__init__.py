"""Every drafter (memory, prompt lookup, draft head, draft model, head and memory merged),
the suffix index drafts from memory read, and the one drafter factory: every entry point
(CLI, bench, app, calibration) asks here.

``open_drafter`` builds what was asked and falls back with one policy, each step's
reason kept as a note: the head on its GPU, then on the CPU, then drafts from memory; a
drafter that cannot be built at all means plain decoding.

May import: ``engine.runtime``, ``engine.gguf``, ``engine.errors``, ``models``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.drafters.base import Drafter
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
from engine.drafters.memory import MemoryDrafter
from engine.drafters.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from engine.runtime.target import Target
    from models.head_config import TargetFingerprint

log = logging.getLogger(__name__)

# "head+memory": the head's tree and the memory's as one draft (engine.drafters.merged).
HEAD_DRAFTERS = ("head", "head-chain", "head-multi", "head-ahead", "head+memory")
# "eagle3": an EAGLE-3 head GGUF run by llama.cpp (engine.drafters.eagle3); "mtp": the
# target GGUF's own next-token block (engine.drafters.mtp).
DRAFTER_NAMES = ("none", "memory", "lookup", *HEAD_DRAFTERS, "draft", "eagle3", "mtp")
# What the app's drafter selector offers, in its order, with the label a user reads
# (``tandem models drafters`` and the selector's tooltips use the same labels). "auto"
# (the planner decides) is the session's (engine.session.ENGINE_DRAFTERS), named here,
# not imported: engine.session imports this package.
DRAFTER_LABELS: dict[str, str] = {
    "auto": "Auto (the planner decides)",
    "head": "Draft head (torch)",
    "draft": "Draft model",
    "eagle3": "EAGLE-3 head (llama.cpp)",
    "mtp": "MTP block (in the model)",
    "memory": "Drafts from memory",
    "lookup": "Prompt lookup",
    "none": "None (plain decoding)",
}
OFFERED_DRAFTERS: tuple[str, ...] = tuple(DRAFTER_LABELS)
# Drafters llama.cpp runs beside the target, which fall back to memory drafts.
NATIVE_DRAFTERS = {"draft": "draft model", "eagle3": "EAGLE-3 head", "mtp": "MTP block"}
# The head trained for the bundled model (README says how it was made).
DEFAULT_HEAD_DIR = Path(__file__).resolve().parents[2] / "assets" / "draft-head-smollm2-135m"
# The EAGLE-3 head trained for the bundled model (docs/eagle3-notes.md says how).
DEFAULT_EAGLE3_HEAD = (Path(__file__).resolve().parents[2] / "assets"
                       / "eagle3-smollm2-135m" / "head.gguf")


@dataclass(frozen=True)
class DrafterSpec:
    """What to draft with. ``head_options`` go to the head drafter's config (mode,
    depth, top_k, draft_ahead, dynamic_depth); for a draft model, ``depth``,
    ``n_gpu_layers`` and ``draft_ahead``."""

    name: str = "memory"
    # None: the head shipped for the bundled model; for "eagle3", the head's GGUF
    head_dir: Path | None = None
    device: str = "cpu"
    head_options: dict[str, object] = field(default_factory=dict)
    draft_model: Path | None = None  # the GGUF the "draft" drafter runs

    def __post_init__(self) -> None:
        if self.name not in DRAFTER_NAMES:
            raise ValueError(f"unknown drafter {self.name!r}; choose from "
                             f"{', '.join(DRAFTER_NAMES)}")

    @property
    def head_path(self) -> Path:
        return Path(self.head_dir) if self.head_dir else DEFAULT_HEAD_DIR


def build_drafter(spec: DrafterSpec, target: Target | None = None,
                  fingerprint: TargetFingerprint | None = None,
                  memory: SuffixIndex | None = None) -> Drafter | None:
    """The drafter ``spec`` names, no fallback; None means plain decoding. Head drafters
    need the ``target`` (its features and GGUF); ``fingerprint`` (the target's, computed
    from it when not given) decides whether the head fits. ``memory`` is the model's
    memory of earlier answers for the memory drafter (empty when None). Raises
    FileNotFoundError, IncompatibleDraftError, ValueError, or whatever the device raises
    (out of memory)."""
    if spec.name == "none":
        return None
    if spec.name == "memory":
        return MemoryDrafter(memory)
    if spec.name == "lookup":
        return PromptLookupDrafter(LookupConfig())
    if target is None:
        raise ValueError(f"the {spec.name} drafter needs the target model")
    if spec.name == "draft":
        return open_draft_model(spec.draft_model, target, spec.head_options)
    if spec.name in ("eagle3", "mtp"):
        from engine.drafters.native_head import HeadChainConfig

        depth = spec.head_options.get("depth")
        config = HeadChainConfig(depth=int(depth)) if depth else HeadChainConfig()
        if spec.name == "mtp":
            from engine.drafters.mtp import MtpDrafter

            return MtpDrafter(target, config)
        from engine.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter(Path(spec.head_dir or DEFAULT_EAGLE3_HEAD), target, config)
    from engine.drafters.head import HeadDrafterConfig, load_head_drafter

    if spec.name == "head+memory":
        from engine.drafters.merged import MergedDrafter

        head = build_drafter(replace(spec, name="head"), target, fingerprint)
        assert head is not None
        return MergedDrafter(head, MemoryDrafter(memory))
    options = dict(spec.head_options)
    if spec.name == "head-ahead":
        options = {"mode": "chain", "draft_ahead": True, **options}
    elif spec.name != "head":
        options = {**options, "mode": spec.name.removeprefix("head-")}
    return load_head_drafter(spec.head_path, target.path,
                             fingerprint or target_fingerprint(target),
                             HeadDrafterConfig(**options),  # type: ignore[arg-type]
                             device=spec.device)


def open_draft_model(path: Path | None, target: Target,
                     options: dict[str, object] | None = None) -> Drafter:
    """A draft-model drafter for ``target``, after llama.cpp's compatibility rules;
    ``options``: ``depth`` (tokens per sequence at most), ``n_gpu_layers``,
    ``draft_ahead`` (draft the next chain while the target verifies). Raises
    ValueError (no path), ModelLoadError, IncompatibleDraftError."""
    from engine.drafters.draft_model import DraftModelConfig, DraftModelDrafter
    from engine.gguf.draft_compat import check_draft_model
    from engine.runtime.model_info import read_vocab_facts

    if path is None:
        raise ValueError("the draft drafter needs a draft model (--draft-model PATH)")
    check_draft_model(read_vocab_facts(path), target.model.vocab_facts())
    options = options or {}
    config = DraftModelConfig(max_depth=int(options.get("depth", DraftModelConfig.max_depth)),
                              draft_ahead=bool(options.get("draft_ahead", False)))
    # Room for the side sequences' cells beside the target's context.
    n_ctx = target.n_ctx + config.max_depth * config.max_sequences
    return DraftModelDrafter(path, n_ctx, target.n_threads, config,
                             n_gpu_layers=int(options.get("n_gpu_layers", 0)))


def open_drafter(spec: DrafterSpec, target: Target | None = None,
                 fingerprint: TargetFingerprint | None = None,
                 memory: SuffixIndex | None = None) -> tuple[Drafter | None, list[str]]:
    """The drafter ``spec`` names, or the next one down the fallback chain (head on its
    device, head on the CPU, drafts from memory, plain), with a note for each fallback
    that names the file or device and the reason."""
    notes: list[str] = []
    if spec.name in HEAD_DRAFTERS:
        devices = [spec.device] + (["cpu"] if spec.device != "cpu" else [])
        for device in devices:
            try:
                drafter = build_drafter(DrafterSpec(spec.name, spec.head_dir, device,
                                                    spec.head_options), target, fingerprint,
                                        memory)
                # What could not be checked (an EAGLE-1 head's tokenizer) is said too.
                return drafter, notes + list(getattr(drafter, "load_notes", []))
            except Exception as exc:  # noqa: BLE001 - bad file, no device, out of memory
                log.info("draft head on %s failed: %s", device, exc)
                notes.append(f"the draft head could not run on {device}: {exc}")
                if not _device_problem(exc):
                    break  # the files themselves are wrong: another device will not help
        notes.append("using drafts from memory instead")
        spec = DrafterSpec("memory")
    if spec.name in NATIVE_DRAFTERS:
        try:
            return build_drafter(spec, target, fingerprint, memory), notes
        except Exception as exc:  # noqa: BLE001 - bad file, another vocabulary, memory
            what = NATIVE_DRAFTERS[spec.name]
            notes.append(f"the {what} could not run: {exc}; using drafts from memory "
                         "instead")
            spec = DrafterSpec("memory")
    try:
        return build_drafter(spec, target, fingerprint, memory), notes
    except Exception as exc:  # noqa: BLE001 - nothing left to try but plain decoding
        notes.append(f"the {spec.name} drafter could not start ({exc}); plain decoding")
        return None, notes


def _device_problem(exc: Exception) -> bool:
    """Whether another device might succeed (out of memory, no such device, driver)."""
    from engine.errors import IncompatibleDraftError

    return not isinstance(exc, IncompatibleDraftError | FileNotFoundError | ValueError) or (
        "out of memory" in str(exc).lower())


def target_fingerprint(target: Target) -> TargetFingerprint:
    """What a draft must match in ``target`` (vocabulary, hidden size, token pieces)."""
    from models.gguf_weights import fingerprint

    return fingerprint(target.model.pieces(), target.n_embd)


def make_drafter(name: str, target: Target | None = None, head_dir: Path | None = None,
                 device: str = "cpu", **head_options: object) -> Drafter | None:
    """Shorthand for ``build_drafter(DrafterSpec(...), target)`` (tests, calibration)."""
    return build_drafter(DrafterSpec(name, head_dir, device, dict(head_options)), target)


__all__ = ["DEFAULT_EAGLE3_HEAD", "DEFAULT_HEAD_DIR", "DRAFTER_LABELS", "DRAFTER_NAMES",
           "HEAD_DRAFTERS", "OFFERED_DRAFTERS", "Drafter", "DrafterSpec", "LookupConfig",
           "MemoryDrafter", "PromptLookupDrafter", "build_drafter", "make_drafter",
           "open_drafter", "target_fingerprint"]
