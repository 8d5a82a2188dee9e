"""Facts about the machine the engine runs on: cores, CPU features, memory, GPUs, and
whether the installed llama.cpp can offload to a GPU. The planner reads these."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from engine.errors import InvalidSettingError

GB = 1024**3
_FLAG_NAMES = {"avx2": "avx2", "avx512f": "avx512f", "avx512_vnni": "avx512_vnni",
               "avx512_bf16": "avx512_bf16", "amx_tile": "amx", "fma": "fma", "f16c": "f16c"}


def physical_cores() -> int:
    """Physical cores (hyper-threads share a core's units, and decode is compute-bound)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def default_threads() -> int:
    """Threads for the target: one per physical core."""
    return max(1, physical_cores())


@dataclass(frozen=True)
class GpuInfo:
    backend: str  # "cuda", "mps" or "xpu"
    index: int
    name: str
    total_bytes: int
    free_bytes: int

    @property
    def device(self) -> str:
        """The torch device name: "cuda:0", "xpu:1", "mps"."""
        return device_name(self.backend, self.index)


DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu")


def device_name(backend: str, index: int = 0) -> str:
    return backend if backend in ("cpu", "mps") else f"{backend}:{index}"


def check_device(name: str) -> str:
    """``name`` if it names a torch device kind Tandem can run a draft on ("cpu",
    "cuda", "cuda:1", "mps", "xpu:0"); raises InvalidSettingError naming the choices."""
    kind, _, index = name.partition(":")
    if kind not in DEVICE_KINDS or (index and not index.isdigit()) or (
            index and kind in ("cpu", "mps")):
        raise InvalidSettingError("head_device", "must be cpu, cuda, cuda:N, mps, xpu or "
                                  "xpu:N", name)
    return name


@dataclass(frozen=True)
class HardwareProfile:
    physical_cores: int
    logical_cores: int
    cpu_model: str
    cpu_features: tuple[str, ...]
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)
    llama_gpu_offload: bool = False
    os: str = ""

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def best_gpu(self) -> GpuInfo | None:
        return max(self.gpus, key=lambda g: g.free_bytes, default=None)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> HardwareProfile:
        d = dict(d)
        d["cpu_features"] = tuple(d.get("cpu_features", ()))
        d["gpus"] = tuple(GpuInfo(**g) for g in d.get("gpus", ()))
        return cls(**d)

    def fingerprint(self) -> str:
        """What does not change between runs (free memory does): a calibration key."""
        stable = {"cpu": self.cpu_model, "cores": self.physical_cores,
                  "features": list(self.cpu_features), "ram_gb": round(self.ram_total_bytes / GB),
                  "gpus": [(g.backend, g.name, round(g.total_bytes / GB, 1)) for g in self.gpus],
                  "offload": self.llama_gpu_offload, "os": self.os}
        return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        feats = [f.upper().replace("AVX512F", "AVX-512").replace("_", "-")
                 for f in self.cpu_features if f in ("avx2", "avx512f", "amx", "neon")]
        cpu = self.cpu_model or "CPU"
        cpu += f", {', '.join(feats)}" if feats else ""
        parts = [f"{self.physical_cores} physical cores ({cpu})",
                 f"{self.ram_total_bytes / GB:.1f} GB RAM ({self.ram_available_bytes / GB:.1f} GB "
                 "free)"]
        if not self.gpus:
            parts.append("no GPU")
        for g in self.gpus:
            parts.append(f"GPU: {g.name} ({g.backend.upper()}, {g.total_bytes / GB:.1f} GB, "
                         f"{g.free_bytes / GB:.1f} GB free)")
        parts.append("llama.cpp can offload to the GPU" if self.llama_gpu_offload
                     else "llama.cpp: CPU only")
        return "; ".join(parts)


def machine_line(hw: HardwareProfile) -> str:
    """This computer in one line: "2 cores (AMD EPYC), 23.5 GB memory, no GPU"."""
    cpu = f" ({hw.cpu_model})" if hw.cpu_model else ""
    gpu = hw.best_gpu
    gpus = (f"GPU {gpu.name} ({gpu.free_bytes / GB:.1f} GB free)" if gpu is not None
            else "no GPU")
    return (f"{hw.physical_cores} cores{cpu}, {hw.ram_total_bytes / GB:.1f} GB memory, "
            f"{gpus}")


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """A recorded profile (JSON written by ``to_json``)."""
    return HardwareProfile.from_json(json.loads(Path(path).read_text()))


def _cpu_linux() -> tuple[str, tuple[str, ...]]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    found = {name for flag, name in _FLAG_NAMES.items() if flag in flags}
    if "asimd" in flags:
        found.add("neon")
    return model, tuple(sorted(found))


def _cpu_macos() -> tuple[str, tuple[str, ...]]:
    def sysctl(key: str) -> str:
        try:
            return subprocess.run(["sysctl", "-n", key], capture_output=True, text=True,
                                  timeout=2).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    model = sysctl("machdep.cpu.brand_string")
    feats = {"neon"} if platform.machine() == "arm64" else set()
    text = sysctl("machdep.cpu.features").lower() + " " + sysctl(
        "machdep.cpu.leaf7_features").lower()
    feats |= {name for flag, name in _FLAG_NAMES.items() if flag in text.split()}
    return model, tuple(sorted(feats))


def _probe_gpus() -> tuple[GpuInfo, ...]:
    """GPUs torch can use; any error while probing one means that GPU is skipped."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - no torch, no GPU drafting
        return ()
    gpus: list[GpuInfo] = []
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                try:
                    free, total = torch.cuda.mem_get_info(i)
                    gpus.append(GpuInfo("cuda", i, torch.cuda.get_device_name(i), int(total),
                                        int(free)))
                except Exception:  # noqa: BLE001
                    continue
    except Exception:  # noqa: BLE001 - a broken driver is no GPU
        pass
    try:
        if torch.backends.mps.is_available():
            total = int(getattr(torch.mps, "recommended_max_memory", lambda: 0)()
                        or psutil.virtual_memory().total)
            used = int(getattr(torch.mps, "current_allocated_memory", lambda: 0)())
            gpus.append(GpuInfo("mps", 0, "Apple GPU", total, max(0, total - used)))
    except Exception:  # noqa: BLE001
        pass
    try:
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            for i in range(xpu.device_count()):
                try:
                    props = xpu.get_device_properties(i)
                    total = int(props.total_memory)
                    gpus.append(GpuInfo("xpu", i, props.name, total,
                                        total - int(xpu.memory_allocated(i))))
                except Exception:  # noqa: BLE001
                    continue
    except Exception:  # noqa: BLE001
        pass
    return tuple(gpus)


def llama_can_offload() -> bool:
    """Whether llama.cpp can put layers on a GPU of this machine: a local device of GPU
    type. (``llama_supports_gpu_offload`` is true in any build with the RPC backend, whose
    devices are other machines', added by endpoint: a CPU build said it offloads.)"""
    try:
        from engine.runtime.native_rpc import local_devices

        return any(d.kind in ("gpu", "igpu") for d in local_devices())
    except Exception:  # noqa: BLE001 - no llama.cpp, or one without the symbols
        return False


def probe_hardware() -> HardwareProfile:
    system = platform.system()
    model, feats = _cpu_macos() if system == "Darwin" else (
        _cpu_linux() if system == "Linux" else (platform.processor(), ()))
    mem = psutil.virtual_memory()
    return HardwareProfile(
        physical_cores=physical_cores(), logical_cores=psutil.cpu_count() or 1,
        cpu_model=model, cpu_features=feats, ram_total_bytes=int(mem.total),
        ram_available_bytes=int(mem.available), gpus=_probe_gpus(),
        llama_gpu_offload=llama_can_offload(), os=f"{system} {platform.machine()}")
