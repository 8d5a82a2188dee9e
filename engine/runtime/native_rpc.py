"""ggml's backend-device and RPC functions, bound with ctypes (llama-cpp-python binds
none of them). The RPC ones exist where llama.cpp was built with ``GGML_RPC=ON`` (the
Makefile's build is).

Every call that connects to a worker aborts the process on failure inside llama.cpp, so
callers probe the worker first (engine.workers.handshake) and run the target of a remote
layout in a child process (engine.session_process).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from engine.errors import ModelLoadError
from engine.runtime.native import ensure_backend, lib_dir, mapped_library

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


def _library(stem: str) -> ctypes.CDLL | None:
    ensure_backend()  # a portable build maps its backends (the CPU variant) only then
    mapped = mapped_library(stem, variants=stem == "ggml-cpu")
    if mapped is not None:
        return mapped
    folder = lib_dir()
    for name in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll"):
        if (folder / name).exists():
            return ctypes.CDLL(str(folder / name))
    return None


class _Symbols:
    """Functions looked up across ggml's libraries (the registry is in libggml, device
    calls in libggml-base; a static build has every symbol in libllama)."""

    def __init__(self, libs: list[ctypes.CDLL]) -> None:
        self._libs = libs

    def bind(self, name: str, args: list[object], res: object) -> None:
        for lib in self._libs:
            func = getattr(lib, name, None)
            if func is not None:
                func.argtypes, func.restype = args, res
                setattr(self, name, func)
                return
        raise ModelLoadError(f"this llama.cpp build lacks {name}")


@functools.cache
def _base() -> _Symbols:
    libs = [lib for lib in (_library("ggml"), _library("ggml-base")) if lib is not None]
    lib = _Symbols(libs + [llama_cpp.llama_cpp._lib])
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, args, res in (
            ("ggml_backend_dev_count", [], sz),
            ("ggml_backend_dev_get", [sz], vp),
            ("ggml_backend_dev_name", [vp], ctypes.c_char_p),
            ("ggml_backend_dev_description", [vp], ctypes.c_char_p),
            ("ggml_backend_dev_type", [vp], ctypes.c_int),
            ("ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
            ("ggml_backend_reg_dev_count", [vp], sz),
            ("ggml_backend_reg_dev_get", [vp, sz], vp)):
        lib.bind(name, args, res)
    return lib


@functools.cache
def _rpc() -> ctypes.CDLL | None:
    lib = _library("ggml-rpc")
    if lib is None or not hasattr(lib, "ggml_backend_rpc_add_server"):
        return None
    lib.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    lib.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p)]
    lib.ggml_backend_rpc_start_server.restype = None
    return lib


def require_rpc() -> ctypes.CDLL:
    """The RPC library; raises ModelLoadError naming the build switch where it is missing."""
    ensure_backend()
    lib = _rpc()
    if lib is None:
        raise ModelLoadError("this llama.cpp build has no RPC backend: rebuild with "
                             "GGML_RPC=ON (the Makefile's build has it)")
    return lib


@dataclass(frozen=True)
class Device:
    handle: int  # ggml_backend_dev_t
    name: str  # llama.cpp's: CPU, CUDA0, Vulkan0, RPC0...
    description: str
    kind: str  # DEVICE_TYPES
    free_bytes: int
    total_bytes: int


def _device(handle: int) -> Device:
    base = _base()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    base.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    return Device(handle, base.ggml_backend_dev_name(handle).decode(),
                  base.ggml_backend_dev_description(handle).decode(),
                  DEVICE_TYPES.get(base.ggml_backend_dev_type(handle), "other"),
                  free.value, total.value)


def local_devices() -> list[Device]:
    """This machine's devices as llama.cpp sees them (the CPU first)."""
    ensure_backend()
    base = _base()
    return [_device(base.ggml_backend_dev_get(i)) for i in range(base.ggml_backend_dev_count())]


def worker_devices(endpoint: str) -> list[Device]:
    """A worker's devices, for ``llama_model_params.devices``. Connects: probe the worker
    first (a failed connect aborts the process)."""
    lib = require_rpc()
    reg = lib.ggml_backend_rpc_add_server(endpoint.encode())
    if not reg:
        return []
    base = _base()
    return [_device(base.ggml_backend_reg_dev_get(reg, i))
            for i in range(base.ggml_backend_reg_dev_count(reg))]


def device_array(devices: list[Device]) -> ctypes.Array[ctypes.c_void_p]:
    """A NULL-terminated ``ggml_backend_dev_t[]`` (the caller keeps it alive)."""
    return (ctypes.c_void_p * (len(devices) + 1))(*[d.handle for d in devices], None)


class _BuftOverride(ctypes.Structure):
    _fields_ = (("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p))


def cpu_overrides(pattern: str) -> ctypes.Array[_BuftOverride]:
    """A NULL-terminated ``llama_model_tensor_buft_override[]`` keeping the tensors whose
    names match ``pattern`` (a regex) in this machine's memory (the caller keeps it
    alive while the model loads)."""
    cpu = _library("ggml-cpu") or llama_cpp.llama_cpp._lib
    cpu.ggml_backend_cpu_buffer_type.argtypes = []
    cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    return (_BuftOverride * 2)(_BuftOverride(pattern.encode(), cpu.ggml_backend_cpu_buffer_type()),
                               _BuftOverride(None, None))


def serve_devices(endpoint: str, devices: list[Device], n_threads: int,
                  cache_dir: Path | None) -> None:
    """Serve ``devices`` at ``endpoint`` (llama.cpp's RPC server). Blocks for good: run it
    in a thread the process can leave."""
    lib = require_rpc()
    array = device_array(devices)
    lib.ggml_backend_rpc_start_server(endpoint.encode(),
                                      str(cache_dir).encode() if cache_dir else None,
                                      n_threads, len(devices), array)
