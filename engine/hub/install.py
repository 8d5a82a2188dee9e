"""A target with its draft head and draft model, downloaded as one job and registered as
one model."""

from __future__ import annotations

from engine.hub.catalog import HeadChoice
from engine.hub.download import (
    DownloadControl,
    Downloader,
    DownloadItem,
    DownloadResult,
    ProgressFn,
)
from engine.hub.draft_pairing import DraftOffer
from engine.hub.local_models import LocalModel, ModelRegistry
from engine.hub.search import GGUFChoice, RemoteFile, list_repo


def _item(repo_id: str, commit: str, f: RemoteFile, revision: str) -> DownloadItem:
    return DownloadItem(repo_id, commit, f.filename, f.n_bytes, f.etag, revision)


def job_items(choice: GGUFChoice, head: HeadChoice | None = None,
              revision: str = "main", draft: GGUFChoice | None = None
              ) -> tuple[DownloadItem, ...]:
    """The files of one job: the target's (every shard), the head's, then the draft
    model's (every shard)."""
    items = [_item(choice.repo_id, choice.commit, f, revision) for f in choice.files]
    if head is not None:
        items += [_item(head.repo_id, head.commit, f, "main") for f in head.files]
    if draft is not None:
        items += [_item(draft.repo_id, draft.commit, f, "main") for f in draft.files]
    return tuple(items)


def model_name(choice: GGUFChoice) -> str:
    """The registry name of a downloaded model: ``owner/repo:QUANT``."""
    return f"{choice.repo_id}:{choice.quant}"


def find_choice(repo_id: str, wanted: str, *, revision: str | None = None,
                endpoint: str | None = None) -> GGUFChoice:
    """The model in ``repo_id`` whose file name or quantization is ``wanted``
    ("Q4_K_M" or "model-Q4_K_M.gguf"). Raises KeyError listing what there is,
    NetworkUnavailableError or HubServerError."""
    choices = list_repo(repo_id, revision=revision, endpoint=endpoint).gguf_choices()
    for c in choices:
        if wanted in (c.name, c.quant) or wanted.upper() == c.quant:
            return c
    have = ", ".join(f"{c.quant} ({c.name})" for c in choices) or "no GGUF files"
    raise KeyError(f"{repo_id} has no {wanted!r}; it has {have}")


def install(choice: GGUFChoice, head: HeadChoice | None, downloader: Downloader,
            registry: ModelRegistry, *, revision: str = "main",
            control: DownloadControl | None = None, on_progress: ProgressFn | None = None,
            draft: DraftOffer | None = None) -> tuple[LocalModel, DownloadResult]:
    """Download target, head and draft model as one job, then register the model with
    them. A ``draft`` already on this machine (``draft.path``) is only remembered.
    Nothing is registered unless every file arrived and verified. Raises what
    Downloader.run raises."""
    remote_draft = draft.choice if draft is not None else None
    items = job_items(choice, head, revision, remote_draft)
    result = downloader.run(items, control, on_progress)
    n_target = len(choice.files)
    n_head = len(head.files) if head is not None else 0
    head_dir = str(result.paths[n_target].parent) if head is not None else None
    draft_path = (str(result.paths[n_target + n_head]) if remote_draft is not None
                  else draft.path if draft is not None else None)
    model = LocalModel(
        name=model_name(choice), path=str(result.paths[0]), source="hub",
        n_bytes=choice.n_bytes, quant=choice.quant, repo_id=choice.repo_id,
        commit=choice.commit, files=tuple(f.filename for f in choice.files),
        head_dir=head_dir, head_repo=head.repo_id if head else None,
        head_commit=head.commit if head else None, draft_path=draft_path,
        draft_repo=remote_draft.repo_id if remote_draft else None,
        draft_commit=remote_draft.commit if remote_draft else None,
        draft_files=tuple(f.filename for f in remote_draft.files) if remote_draft else ())
    return registry.add(model), result
