"""Typed errors of the engine. Every public function names the ones it raises."""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelLoadError(TandemError):
    """A GGUF file is missing, truncated, not a GGUF, or llama.cpp refused it."""


class ContextTooLargeError(ModelLoadError):
    """The context asked for needs more memory than this machine can give; says which
    context fits (``n_ctx_fits``, 0 when none does)."""

    def __init__(self, model: str, n_ctx: int, need: str, room: int, n_ctx_fits: int) -> None:
        self.n_ctx, self.n_ctx_fits = n_ctx, n_ctx_fits
        fits = (f"a context of at most {n_ctx_fits} tokens fits" if n_ctx_fits
                else "no context fits: choose a smaller model")
        super().__init__(f"{model} with a context of {n_ctx} tokens needs {need}, and this "
                         f"machine has {room / 2**30:.2f} GiB to give it: {fits}")


class ContextFullError(TandemError):
    """The prompt (plus what must follow it) does not fit the context. Recoverable:
    the engine is left as it was and a shorter prompt can be sent."""

    def __init__(self, n_needed: int, n_ctx: int, what: str = "prompt") -> None:
        super().__init__(
            f"the {what} needs {n_needed} tokens but the context holds {n_ctx}; "
            "shorten it or load the model with a larger context"
        )
        self.n_needed = n_needed
        self.n_ctx = n_ctx


class InvalidPromptError(TandemError, ValueError):
    """A prompt that cannot run: empty, or holding token ids outside the vocabulary."""


class InvalidSettingError(TandemError, ValueError):
    """A setting is out of range. ``setting`` is its name in the engine's API; each front
    end names it its own way (``named``: the CLI's flag, the API's field, the GUI's label)."""

    def __init__(self, setting: str, rule: str, value: object) -> None:
        super().__init__(f"{setting} {rule}, got {value!r}")
        self.setting = setting
        self.rule = rule
        self.value = value

    def named(self, name: str) -> str:
        """The message with the setting called ``name``."""
        return f"{name} {self.rule}, got {self.value!r}"


class InvalidSamplingError(InvalidSettingError):
    """A sampling setting is out of range (temperature, top-p, top-k, max tokens)."""


class NativeError(TandemError):
    """llama.cpp returned an error code from a call that should not fail."""

    def __init__(self, call: str, code: int, meaning: str = "") -> None:
        detail = f": {meaning}" if meaning else ""
        super().__init__(f"{call} failed with code {code}{detail}")
        self.call = call
        self.code = code


class ClosedError(TandemError):
    """A model, context or batch was used after ``close()``."""

    def __init__(self, what: str) -> None:
        super().__init__(f"the {what} has been closed; load the model again")


def describe_mismatches(mismatches: list[tuple[str, object, object]],
                        quoted: bool = False) -> str:
    """(field, the draft's value, the target's value) rows in words; ``quoted`` shows
    values as Python literals (where a text value needs its quotes to be read)."""
    show = repr if quoted else str
    return "; ".join(f"{name}: the draft has {show(mine)}, the target {show(theirs)}"
                     for name, mine, theirs in mismatches)


class IncompatibleDraftError(TandemError):
    """A draft (head or draft model) does not fit the target it was paired with.
    ``mismatches`` holds (field, the draft's value, the target's value) per field."""

    def __init__(self, draft: str, mismatches: list[tuple[str, object, object]]) -> None:
        super().__init__(f"{draft} does not fit this model ({describe_mismatches(mismatches)})")
        self.draft = draft
        self.mismatches = mismatches


class DrafterUnavailableError(TandemError):
    """A drafter this model cannot use (an MTP block it lacks, an architecture without
    the graph); ``reason`` says why in a few words."""

    def __init__(self, model: str, drafter: str, reason: str) -> None:
        super().__init__(f"{model} cannot draft with {drafter}: {reason}")
        self.reason = reason


class DownloadError(TandemError):
    """A model download failed; what was already on disk is kept."""


class ChecksumMismatchError(DownloadError):
    """A downloaded file's hash differs from the one the Hub reports; the file was
    deleted (it is corrupt, so it is not kept for a resume)."""

    def __init__(self, filename: str, expected: str, actual: str) -> None:
        super().__init__(f"{filename}: the Hub reports sha256 {expected}, the download has "
                         f"{actual}; the file was removed, download it again")
        self.filename = filename
        self.expected = expected
        self.actual = actual


class NotEnoughDiskError(DownloadError):
    """The download needs more free disk space than the cache's disk has."""

    def __init__(self, n_needed: int, n_free: int, where: str) -> None:
        super().__init__(f"the download needs {n_needed / 2**30:.2f} GiB but {where} has "
                         f"{n_free / 2**30:.2f} GiB free")
        self.n_needed = n_needed
        self.n_free = n_free


class NetworkUnavailableError(DownloadError):
    """The Hub cannot be reached (no network, name resolution, connection refused or
    dropped) even after the retries."""


class HubServerError(DownloadError):
    """The Hub answered with an HTTP error (5xx after the retries, or a 4xx such as a
    missing or gated repository)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class DownloadCancelledError(DownloadError):
    """The user cancelled the download; ``kept_partial`` says whether the partial files
    were kept for a later resume."""

    def __init__(self, kept_partial: bool) -> None:
        what = "partial files kept for a resume" if kept_partial else "partial files removed"
        super().__init__(f"download cancelled ({what})")
        self.kept_partial = kept_partial


class WorkerError(TandemError):
    """A worker (another machine's llama.cpp RPC server, ``tandem worker``) cannot be
    used: unreachable, another protocol version, or lost mid-answer. ``endpoint`` is its
    HOST:PORT."""

    def __init__(self, endpoint: str, why: str) -> None:
        super().__init__(f"worker {endpoint}: {why}")
        self.endpoint = endpoint
        self.why = why


class WorkerLostError(WorkerError):
    """A worker stopped answering while the target ran through it. The answer in
    progress ends; the engine that used it is gone (llama.cpp aborts the process that
    loses a worker, which is why that engine runs in a child process)."""
