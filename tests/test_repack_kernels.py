"""The repacked kernels of the CPU library this process loaded (the source build's, or the
portable build's level ggml chose) multiply a row inside a batch bit for bit as they
multiply it alone (engine.runtime.repack_check; ``tandem check-cpu`` runs the same check on
every level of a portable build)."""

from __future__ import annotations

import platform

import pytest

from engine.runtime.native import ggml_cpu_library, loaded_cpu_variant
from engine.runtime.repack_check import KERNELS, RepackedKernel, check_kernel, cpu_has


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_a_row_in_a_batch_equals_the_row_alone(kernel: RepackedKernel) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the repacked kernels checked here are x86's")
    lib = ggml_cpu_library()
    assert lib is not None, "llama.cpp's CPU library was not found in this process"
    lib.ggml_cpu_init()
    if not cpu_has(lib, kernel.needs):
        pytest.skip(f"the {loaded_cpu_variant()} CPU library has no {kernel.needs}: "
                    f"llama.cpp does not repack this layout there")
    check = check_kernel(lib, kernel)
    assert check.status == "exact", (f"{kernel.name} on the {loaded_cpu_variant()} library: "
                                     f"outputs differing from the row alone, by batch size: "
                                     f"{check.differing}")
