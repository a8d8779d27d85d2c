"""The CUDA kernels of ``kernels/`` and their one loader.

Each ``.cu`` file is compiled by ``cupy.RawModule(code=..., name_expressions=...)``
with the template instantiations listed in :data:`SOURCES`, once per device (the
module is memoized per device id, and CuPy caches the binary on disk). The same
table drives the ``nvcc`` check of ``tests/unit/test_kernels_compile.py``
(:func:`nvcc_translation_unit`), so what is compiled without a GPU is exactly what
is loaded with one.

This module imports CuPy only inside the functions that launch kernels.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import BFLOAT16
from ..ops import ReduceOp


def _kernel_dir() -> Path:
    """``kernels/`` of a source checkout, or ``mpitrain/kernels`` of an installed package."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "common.cuh").is_file():
            return candidate
    return here.parent / "kernels"


KERNEL_DIR = _kernel_dir()
BLOCK = 256
"""Threads per block of every launch."""

# dtype name -> C++ element type of the kernels.
CTYPES: dict[str, str] = {
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
    "float64": "double",
    "int32": "int",
    "int64": "long long",
}
# The reduction codes of kernels/common.cuh.
OP_CODES: dict[ReduceOp, int] = {ReduceOp.SUM: 0, ReduceOp.MIN: 1, ReduceOp.MAX: 2,
                                 ReduceOp.PRODUCT: 3}
# Compression casts: (from, to) dtype names.
CASTS: tuple[tuple[str, str], ...] = tuple(
    pair for wide in ("float32", "float64") for narrow in ("float16", "bfloat16")
    for pair in ((wide, narrow), (narrow, wide)))
# Element size -> the unsigned type that moves it in pack/unpack.
MOVERS: dict[int, str] = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
                          8: "unsigned long long"}
DEFINES: dict[str, str] = {}
"""Macros prepended to every source (none needed today; kept in one place)."""


def reduce_name(dtype: str, op: ReduceOp, scaled: bool) -> str:
    """Name expression of the reduction kernel for ``dtype`` and ``op``."""
    return f"reduce<{CTYPES[dtype]}, {OP_CODES[op]}, {'true' if scaled else 'false'}>"


def scale_name(dtype: str) -> str:
    """Name expression of the scaling kernel for ``dtype``."""
    return f"scale<{CTYPES[dtype]}>"


def cast_name(src: str, dst: str) -> str:
    """Name expression of the cast kernel from ``src`` to ``dst`` dtype names."""
    return f"cast<{CTYPES[src]}, {CTYPES[dst]}>"


def pack_name(itemsize: int, unpack: bool = False) -> str:
    """Name expression of the pack (or unpack) kernel for elements of ``itemsize`` bytes."""
    return f"{'unpack' if unpack else 'pack'}<{MOVERS[itemsize]}>"


@dataclass(frozen=True)
class Source:
    """One ``.cu`` file and the template instantiations loaded from it."""

    file: str
    names: tuple[str, ...]

    def text(self) -> str:
        """The code handed to the compiler: the macros, then the file."""
        defines = "".join(f"#define {k} {v}\n" for k, v in DEFINES.items())
        return defines + (KERNEL_DIR / self.file).read_text(encoding="utf-8")


SOURCES: dict[str, Source] = {
    "reduce": Source("reduce.cu", tuple(
        [reduce_name(d, op, scaled) for d in CTYPES for op in OP_CODES for scaled in (False, True)]
        + [scale_name(d) for d in CTYPES])),
    "cast": Source("cast.cu", tuple(cast_name(a, b) for a, b in CASTS)),
    "pack": Source("pack.cu", tuple(pack_name(size, unpack) for size in MOVERS
                                    for unpack in (False, True))),
}


def include_options() -> tuple[str, ...]:
    """Compiler options shared by NVRTC and nvcc."""
    return ("-std=c++17", f"-I{KERNEL_DIR}")


def cuda_include_dir() -> Path | None:
    """A directory with CUDA's ``cuda_fp16.h`` and ``cuda_bf16.h`` for NVRTC, if any.

    Looked for under CuPy's CUDA path, ``$CUDA_PATH``, ``$CUDA_HOME``, beside ``nvcc``
    and in ``/usr/local/cuda``.
    """
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")]
    try:
        import cupy

        roots.insert(0, cupy.cuda.get_cuda_path())
    except ImportError:
        pass
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    for root in roots:
        if root and (Path(root) / "include" / "cuda_bf16.h").is_file():
            return Path(root) / "include"
    return None


def nvrtc_options() -> tuple[str, ...]:
    """The options the loader gives NVRTC: :func:`include_options` and the CUDA headers
    (NVRTC does not look for them itself)."""
    found = cuda_include_dir()
    return include_options() + ((f"-I{found}",) if found else ())


def loaded_code(source: Source) -> str:
    """The exact code the loader compiles for ``source``."""
    return f"// headers {_headers_digest()}\n{source.text()}"


def nvcc_translation_unit(source: Source) -> str:
    """A file for ``nvcc`` that instantiates every kernel of ``source``.

    Taking the address of each name expression is what NVRTC does with a name
    expression, so nvcc compiles exactly the kernels the loader asks NVRTC for.
    """
    addresses = ",\n".join(f"    (const void*)&{name}" for name in source.names)
    return (f"{source.text()}\n\nextern const void* const mpitrain_instances[];\n"
            f"const void* const mpitrain_instances[] = {{\n{addresses}\n}};\n")


def _headers_digest() -> str:
    """Digest of the shared headers: part of the code, so CuPy's disk cache follows them."""
    digest = hashlib.sha256()
    for header in sorted(KERNEL_DIR.glob("*.cuh")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def module(name: str, device_id: int) -> Any:
    """The compiled :class:`cupy.RawModule` of source ``name`` on ``device_id`` (memoized)."""
    import cupy

    source = SOURCES[name]
    with cupy.cuda.Device(device_id):
        mod = cupy.RawModule(code=loaded_code(source), options=nvrtc_options(),
                             name_expressions=list(source.names))
        mod.compile()
    return mod


@functools.cache
def _multiprocessors(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.cache
def _function(name: str, expression: str, device_id: int) -> Any:
    return module(name, device_id).get_function(expression)


def function(name: str, expression: str) -> Any:
    """The kernel ``expression`` of source ``name`` on the current device (memoized:
    looking a kernel up costs more than launching it)."""
    import cupy

    return _function(name, expression, cupy.cuda.Device().id)


def grid(n: int, device_id: int | None = None) -> int:
    """Blocks for ``n`` elements: enough to cover them, at most 32 per multiprocessor
    of ``device_id`` (default: the current device)."""
    if device_id is None:
        import cupy

        device_id = cupy.cuda.Device().id
    return max(1, min(math.ceil(n / BLOCK), 32 * _multiprocessors(device_id)))


def integer_divisor(factor: float) -> int:
    """``k`` when ``factor`` is exactly ``1/k`` (integer scaling divides), else 0.

    The same test as the numpy backend's :func:`~.numpy_backend.scale_integer`.
    """
    inverse = 1.0 / factor if factor != 0 else 0.0
    k = round(inverse)
    return k if k != 0 and abs(inverse - k) <= 1e-12 * abs(inverse) else 0


def has_kernel(dtype: np.dtype[Any]) -> bool:
    """True if the reduction and scaling kernels cover ``dtype``."""
    return dtype_name(dtype) in CTYPES


@functools.cache
def dtype_name(dtype: np.dtype[Any]) -> str:
    """The name of ``dtype`` in :data:`CTYPES` (``bfloat16`` for ml_dtypes' type;
    memoized: comparing with that type is slow)."""
    return "bfloat16" if BFLOAT16 is not None and dtype == BFLOAT16 else str(dtype)


_UNSCALED = (np.float64(1.0), np.int64(0))


def _scale_args(dtype: np.dtype[Any], factor: float) -> tuple[Any, Any]:
    if factor == 1.0:
        return _UNSCALED
    divisor = integer_divisor(factor) if dtype.kind in "iu" else 0
    return np.float64(factor), np.int64(divisor)


@functools.cache
def _reduce_kernel(dtype: np.dtype[Any], op: ReduceOp, scaled: bool, device_id: int) -> Any:
    return _function("reduce", reduce_name(dtype_name(dtype), op.reduction, scaled), device_id)


def reduce(dst: Any, a: Any, b: Any, op: ReduceOp, factor: float = 1.0) -> None:
    """``dst = (a <op> b) * factor`` on the current stream (flat contiguous cupy arrays)."""
    import cupy

    n = dst.size
    if n == 0:
        return
    device_id = cupy.cuda.Device().id
    kernel = _reduce_kernel(dst.dtype, op, factor != 1.0, device_id)
    kernel((grid(n, device_id),), (BLOCK,), (dst, a, b, np.int64(n),
                                            *_scale_args(dst.dtype, factor)))


def scale(dst: Any, src: Any, factor: float) -> None:
    """``dst = src * factor`` on the current stream; ``dst`` may be ``src``."""
    n = dst.size
    if n == 0:
        return
    kernel = function("reduce", scale_name(dtype_name(dst.dtype)))
    kernel((grid(n),), (BLOCK,), (dst, src, np.int64(n), *_scale_args(dst.dtype, factor)))


def cast(dst: Any, src: Any) -> None:
    """``dst = src`` converted to ``dst``'s dtype (a pair of :data:`CASTS`)."""
    n = dst.size
    if n == 0:
        return
    kernel = function("cast", cast_name(dtype_name(src.dtype), dtype_name(dst.dtype)))
    kernel((grid(n),), (BLOCK,), (dst, src, np.int64(n)))


def pack_tables(parts: list[Any]) -> tuple[Any, Any, int]:
    """Device tables of ``parts``' addresses and element offsets, and the longest part."""
    import cupy

    sizes = [p.size for p in parts]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    addresses = np.array([p.data.ptr for p in parts], dtype=np.uint64)
    return cupy.asarray(addresses), cupy.asarray(offsets), max(sizes, default=0)


def pack(buffer: Any, parts: list[Any], unpack: bool = False) -> None:
    """Gather ``parts`` (flat, contiguous, ``buffer``'s element size) into ``buffer``, or
    (``unpack``) scatter ``buffer`` back into them."""
    if not parts:
        return
    addresses, offsets, longest = pack_tables(parts)
    if longest == 0:
        return
    kernel = function("pack", pack_name(buffer.dtype.itemsize, unpack))
    blocks = (min(grid(longest), 1024), min(len(parts), 65535))
    count = np.int32(len(parts))
    args = (addresses, buffer, offsets, count) if unpack else (buffer, addresses, offsets, count)
    kernel(blocks, (BLOCK,), args)
