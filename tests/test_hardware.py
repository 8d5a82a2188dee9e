"""The hardware probe on this machine, and recorded profiles of others."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine.runtime.hardware as hardware
from engine.runtime.hardware import GpuInfo, HardwareProfile, load_profile, probe_hardware

PROFILES = sorted((Path(__file__).parent / "profiles").glob("*.json"))
# Hardware profiles only: not calibration costs, not measured model profiles.
HW_PROFILES = [p for p in PROFILES if "costs_" not in p.name and "measured_" not in p.name]


def test_probe_reads_this_machine():
    from engine.runtime.native_rpc import local_devices

    hw = probe_hardware()
    assert hw.physical_cores >= 1 and hw.logical_cores >= hw.physical_cores
    assert 0 < hw.ram_available_bytes <= hw.ram_total_bytes
    # Offload means a GPU device of this machine, not a build that merely could offload.
    assert hw.llama_gpu_offload == any(d.kind in ("gpu", "igpu") for d in local_devices())
    assert set(hw.cpu_features) <= {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx",
                                    "neon", "fma", "f16c"}
    text = hw.describe()
    assert f"{hw.physical_cores} physical cores" in text
    assert ("no GPU" in text) == (not hw.gpus)


def test_a_build_with_rpc_alone_does_not_offload():
    """llama_supports_gpu_offload() is true for the RPC backend; with no GPU device here
    the planner must not put target layers "on the GPU" (they would stay on the CPU and
    be priced as GPU layers)."""
    import llama_cpp

    from engine.runtime.native_rpc import local_devices

    if any(d.kind in ("gpu", "igpu") for d in local_devices()):
        pytest.skip("this machine has a GPU device")
    assert llama_cpp.llama_supports_gpu_offload()  # the Makefile builds RPC in
    assert not probe_hardware().llama_gpu_offload


def test_fingerprint_ignores_free_memory_but_not_a_new_gpu():
    hw = probe_hardware()
    again = probe_hardware()
    assert hw.fingerprint() == again.fingerprint()
    data = hw.to_json()
    data["ram_available_bytes"] = 1
    assert HardwareProfile.from_json(data).fingerprint() == hw.fingerprint()
    data["gpus"] = [GpuInfo("cuda", 0, "NVIDIA GeForce RTX 3050", 4 << 30, 3 << 30).__dict__]
    assert HardwareProfile.from_json(data).fingerprint() != hw.fingerprint()


@pytest.mark.parametrize("path", HW_PROFILES, ids=lambda p: p.stem)
def test_recorded_profiles_round_trip(path):
    hw = load_profile(path)
    assert HardwareProfile.from_json(hw.to_json()) == hw


def test_describe_names_the_gpu_and_its_free_memory():
    hw = load_profile(Path(__file__).parent / "profiles" / "synthetic_laptop_4gb_gpu.json")
    text = hw.describe()
    assert "RTX 3050" in text and "3.6 GB free" in text and "can offload" in text
    assert hw.best_gpu is not None and hw.best_gpu.backend == "cuda"


def test_a_gpu_that_fails_to_answer_is_skipped(monkeypatch):
    torch = pytest.importorskip("torch")
    # No GPU here to fail for real: make CUDA claim a device whose query then raises.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def broken(*_args, **_kwargs):
        raise RuntimeError("CUDA driver error")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert all(g.backend != "cuda" for g in hardware._probe_gpus())
