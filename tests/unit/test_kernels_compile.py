"""Every CUDA kernel compiles with nvcc for sm_90, exactly as the loader instantiates it.

Runs without a GPU: a syntax or type error in ``kernels/`` fails here. The
instantiations come from the loader's own table (:data:`mpitrain.backends.kernels.SOURCES`),
so the two cannot drift. Skipped, with a message, where nvcc is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mpitrain.backends import kernels

NVCC = shutil.which("nvcc")
ARCH = "sm_90"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA kernels not compiled")
def test_every_kernel_compiles_with_nvcc(tmp_path: Path) -> None:
    jobs = {}
    for name, source in kernels.SOURCES.items():
        unit = tmp_path / f"{name}.cu"
        unit.write_text(kernels.nvcc_translation_unit(source), encoding="utf-8")
        command = [str(NVCC), f"-arch={ARCH}", "--cubin", "-Werror", "all-warnings",
                   *kernels.include_options(), "-o", str(tmp_path / f"{name}.cubin"), str(unit)]
        jobs[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
    failures = []
    for name, job in jobs.items():
        output, _ = job.communicate(timeout=300)
        if job.returncode != 0:
            failures.append(f"{kernels.SOURCES[name].file}:\n{output}")
    assert not failures, "nvcc failed:\n" + "\n".join(failures)
    for name, source in kernels.SOURCES.items():
        cubin = (tmp_path / f"{name}.cubin").read_bytes()
        kernel_names = {expr.split("<")[0] for expr in source.names}
        for kernel in kernel_names:  # mangled names start with _Z<len><name>
            assert f"_Z{len(kernel)}{kernel}".encode() in cubin, f"{kernel} missing from {name}"


def test_table_covers_the_gpu_dtypes_and_ops() -> None:
    names = kernels.SOURCES["reduce"].names
    assert len(names) == len(kernels.CTYPES) * (2 * len(kernels.OP_CODES) + 1)
    assert "reduce<__nv_bfloat16, 3, true>" in names and "scale<long long>" in names
    assert set(kernels.CTYPES) == {"float16", "bfloat16", "float32", "float64", "int32", "int64"}
    assert ("float32", "bfloat16") in kernels.CASTS and ("float16", "float64") in kernels.CASTS
    for source in kernels.SOURCES.values():
        assert (kernels.KERNEL_DIR / source.file).is_file()
        assert len(set(source.names)) == len(source.names)


def test_integer_divisor_matches_numpy_scaling() -> None:
    assert kernels.integer_divisor(1 / 3) == 3 and kernels.integer_divisor(0.25) == 4
    assert kernels.integer_divisor(0.3) == 0 and kernels.integer_divisor(0.0) == 0
    assert kernels.integer_divisor(1.0) == 1 and kernels.integer_divisor(2.0) == 0


def _nvrtc() -> object | None:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception:  # CuPy or libnvrtc missing
        return None
    return nvrtc


NVRTC = _nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="CuPy with NVRTC not installed: loader path not "
                                          "compiled (pip install 'mpitrain[cuda13]')")
def test_loader_code_compiles_with_nvrtc_and_lowers_every_name() -> None:
    """What the loader hands cupy.RawModule, compiled by NVRTC for sm_90 (no GPU needed)."""
    nvrtc: Any = NVRTC
    options = (*kernels.nvrtc_options(), f"-arch={ARCH}", "--device-as-default-execution-space")
    for name, source in kernels.SOURCES.items():
        program = nvrtc.createProgram(kernels.loaded_code(source), f"{name}.cu", (), ())
        try:
            for expression in source.names:
                nvrtc.addNameExpression(program, expression)
            try:
                nvrtc.compileProgram(program, options)
            except nvrtc.NVRTCError:
                pytest.fail(f"NVRTC failed on {source.file}:\n"
                            + nvrtc.getProgramLog(program))
            lowered = {e: nvrtc.getLoweredName(program, e) for e in source.names}
            assert len(set(lowered.values())) == len(source.names)
            assert len(nvrtc.getCUBIN(program)) > 0
        finally:
            nvrtc.destroyProgram(program)
