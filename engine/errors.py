"""Typed errors of the engine. Every public function names the ones it raises."""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelLoadError(TandemError):
    """A GGUF file is missing, truncated, not a GGUF, or llama.cpp refused it."""


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


class InvalidSamplingError(TandemError, ValueError):
    """A sampling setting is out of range (temperature, top-p, top-k, max tokens)."""


class NativeError(TandemError):
    """llama.cpp returned an error code from a call that should not fail."""

    def __init__(self, call: str, code: int, meaning: str = "") -> None:
        detail = f": {meaning}" if meaning else ""
        super().__init__(f"{call} failed with code {code}{detail}")
        self.call = call
        self.code = code


class IncompatibleDraftError(TandemError):
    """A draft does not fit the target it was paired with."""


class DownloadError(TandemError):
    """A model download failed; what was already on disk is kept."""
