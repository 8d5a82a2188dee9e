"""A portable llama.cpp build's CPU libraries: one per instruction-set level, of which ggml
loads the best this CPU runs (or the one ``TANDEM_CPU_VARIANT`` names), and which of them
this process mapped. Plain ctypes and file names: engine.runtime.llama_bindings gives it
the folder llama-cpp-python keeps its libraries in."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import tempfile
from pathlib import Path

from engine.errors import ModelLoadError

# Names one CPU library of a portable build to load instead of the best this CPU runs.
CPU_VARIANT_ENV = "TANDEM_CPU_VARIANT"
_CPU_VARIANT_PREFIX = "libggml-cpu-"


def variants_in(folder: Path) -> list[str]:
    """The instruction-set levels of a portable build's CPU libraries in ``folder``
    ("haswell", "zen4"), in name order; empty where the build links its CPU backend in."""
    return sorted(p.name[len(_CPU_VARIANT_PREFIX):-len(".so")]
                  for p in folder.glob(f"{_CPU_VARIANT_PREFIX}*.so"))


def mapped_path(stem: str, variants: bool = False) -> str | None:
    """The path of the ``lib<stem>`` this process mapped (with ``variants``, also
    ``lib<stem>-<level>.so``); None when none is, or where there is no /proc."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None  # not Linux: the caller falls back to names
    for line in maps.splitlines():
        path = line.rpartition(" ")[2]
        name = os.path.basename(path)
        if name.startswith(f"lib{stem}.so") or (variants and name.startswith(f"lib{stem}-")):
            return path
    return None


def mapped_library(stem: str, variants: bool = False) -> ctypes.CDLL | None:
    """The copy of ``lib<stem>`` (with ``variants``, also ``lib<stem>-<level>.so``, what
    a portable build loads) this process has already mapped: opening it by that path
    returns the loaded copy's handle, never a second instance with its own state."""
    path = mapped_path(stem, variants)
    return ctypes.CDLL(path) if path is not None else None


def mapped_variant() -> str:
    """The level of the CPU library this process mapped, or "linked" where the build
    links its CPU backend in (make install's)."""
    path = mapped_path("ggml-cpu", variants=True)
    name = os.path.basename(path) if path is not None else ""
    if name.startswith(_CPU_VARIANT_PREFIX):
        return name[len(_CPU_VARIANT_PREFIX):].split(".so")[0]
    return "linked"


def load_backend_libraries(folder: Path) -> None:
    """A portable build (GGML_BACKEND_DL: the packaged build, packaging/dist) keeps its
    backends as libraries ggml loads at run time, one CPU library per instruction-set
    level, of which it takes the best this CPU runs. ggml looks for them beside the
    executable and in the working directory, not in ``folder``, where llama-cpp-python
    keeps them. ``TANDEM_CPU_VARIANT`` names one level to load instead of the best (the
    variants check runs each level this CPU can run in turn)."""
    wanted = os.environ.get(CPU_VARIANT_ENV)
    if not variants_in(folder):
        if wanted:
            raise ModelLoadError(f"{CPU_VARIANT_ENV}={wanted}: this llama.cpp build links "
                                 "one CPU backend in; levels are a portable build's "
                                 "(make dist)")
        return  # the CPU backend is linked in (make install's build)
    ggml = mapped_library("ggml")
    load_all = getattr(ggml, "ggml_backend_load_all_from_path", None)
    if load_all is None:
        raise ModelLoadError("this llama.cpp build keeps its CPU backend in libraries "
                             "but cannot load them (no ggml_backend_load_all_from_path)")
    load_all.argtypes, load_all.restype = [ctypes.c_char_p], None
    load_all(str(_one_variant_folder(folder, wanted) if wanted else folder).encode())
    if wanted and mapped_path("ggml-cpu", variants=True) is None:
        raise ModelLoadError(f"this CPU cannot run llama.cpp's {wanted} CPU library "
                             f"({CPU_VARIANT_ENV}={wanted})")


def _one_variant_folder(folder: Path, level: str) -> Path:
    """A folder where ggml finds the backends of ``folder`` with one CPU library: ggml
    loads the best-scoring CPU library of a folder, so this is how to pick a lower one."""
    levels = variants_in(folder)
    if level not in levels:
        raise ModelLoadError(f"{CPU_VARIANT_ENV}={level}: this build's CPU libraries are "
                             f"{', '.join(levels)}")
    one = Path(tempfile.mkdtemp(prefix=f"tandem-cpu-{level}-"))
    atexit.register(shutil.rmtree, one, True)
    for lib in folder.glob("libggml-*.so"):
        is_cpu = lib.name.startswith(_CPU_VARIANT_PREFIX)
        if lib.name == f"{_CPU_VARIANT_PREFIX}{level}.so" or (
                not is_cpu and lib.name not in ("libggml-base.so", "libggml.so")):
            (one / lib.name).symlink_to(lib)
    return one
