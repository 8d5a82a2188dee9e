"""How each drafter kind is built: ``build_drafter`` makes what a ``DrafterSpec`` names,
with no fallback (engine.drafters.fallback has the one fallback policy)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.drafters.base import Drafter
from engine.drafters.kinds import DrafterKind
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
from engine.drafters.memory import MemoryDrafter
from engine.drafters.spec import DEFAULT_EAGLE3_HEAD, DrafterSpec
from engine.drafters.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from engine.runtime.target import Target
    from models.head_config import TargetFingerprint


def build_drafter(spec: DrafterSpec, target: Target | None = None,
                  fingerprint: TargetFingerprint | None = None,
                  memory: SuffixIndex | None = None) -> Drafter | None:
    """The drafter ``spec`` names, no fallback; None means plain decoding. Head drafters
    need the ``target`` (its features and GGUF); ``fingerprint`` (the target's, computed
    from it when not given) decides whether the head fits. ``memory`` is the model's
    memory of earlier answers for the memory drafter (empty when None). Raises
    FileNotFoundError, IncompatibleDraftError, ValueError, or whatever the device raises
    (out of memory)."""
    kind = spec.kind
    if kind is DrafterKind.NONE:
        return None
    if kind is DrafterKind.MEMORY:
        return MemoryDrafter(memory)
    if kind is DrafterKind.LOOKUP:
        return PromptLookupDrafter(LookupConfig())
    if target is None:
        raise ValueError(f"the {kind} drafter needs the target model")
    if kind is DrafterKind.DRAFT:
        return open_draft_model(spec.draft_model, target, spec.head_options)
    if kind.native:
        return _native_head(spec, target)
    return _torch_head(spec, target, fingerprint, memory)


def _native_head(spec: DrafterSpec, target: Target) -> Drafter:
    """A head llama.cpp runs beside the target: the target's MTP block or an EAGLE-3
    head GGUF (the bundled one when the spec names none)."""
    from engine.drafters.native_head import HeadChainConfig

    depth = spec.head_options.get("depth")
    config = HeadChainConfig(depth=int(depth)) if depth else HeadChainConfig()
    if spec.kind is DrafterKind.MTP:
        from engine.drafters.mtp import MtpDrafter

        return MtpDrafter(target, config)
    from engine.drafters.eagle3 import Eagle3Drafter

    return Eagle3Drafter(Path(spec.head_dir or DEFAULT_EAGLE3_HEAD), target, config)


def _torch_head(spec: DrafterSpec, target: Target, fingerprint: TargetFingerprint | None,
                memory: SuffixIndex | None) -> Drafter:
    """Tandem's torch head, in the variant's mode; joined by drafts from memory for
    ``head+memory``."""
    from engine.drafters.head import HeadDrafterConfig, load_head_drafter

    if spec.kind.uses_memory:
        from engine.drafters.merged import MergedDrafter

        head = _torch_head(DrafterSpec(DrafterKind.HEAD, spec.head_dir, spec.device,
                                       spec.head_options, spec.draft_model),
                           target, fingerprint, None)
        return MergedDrafter(head, MemoryDrafter(memory))
    options = spec.kind.head_options(spec.head_options)
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


def target_fingerprint(target: Target) -> TargetFingerprint:
    """What a draft must match in ``target`` (vocabulary, hidden size, token pieces)."""
    from models.gguf_weights import fingerprint

    return fingerprint(target.model.pieces(), target.n_embd)


def make_drafter(kind: DrafterKind | str, target: Target | None = None,
                 head_dir: Path | None = None, device: str = "cpu",
                 **head_options: object) -> Drafter | None:
    """Shorthand for ``build_drafter(DrafterSpec(...), target)`` (tests, calibration)."""
    return build_drafter(DrafterSpec(DrafterKind.parse(kind, auto=False), head_dir, device,
                                     dict(head_options)), target)
