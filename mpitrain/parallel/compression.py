"""Gradient compression: cast before the allreduce, cast back after.

A compressor is any object with ``compress(x) -> (compressed, ctx)`` and
``decompress(compressed, ctx) -> x``, Horovod's interface. The built-in ones work on
numpy and cupy arrays (``astype``) and on torch tensors (``to``), so the numpy trainer
and :mod:`mpitrain.torch` share them. Only floating-point values are cast; integer
gradients pass through unchanged. numpy arrays are cast by the numpy backend, which
converts float32 to and from float16/bfloat16 in the compiled host extension where it
is built (:mod:`mpitrain.backends.hostcopy`; numpy's own float16 cast is ten times
slower).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import NUMPY
from ..dtypes import BFLOAT16, FLOAT_DTYPES
from ..errors import DtypeError


def _is_floating(x: Any) -> bool:
    is_fp = getattr(x, "is_floating_point", None)  # torch tensors
    if callable(is_fp):
        return bool(is_fp())
    return np.dtype(x.dtype) in FLOAT_DTYPES


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _astype(x: Any, dtype: Any) -> Any:
    """A new array of ``x``'s values as ``dtype``: numpy arrays through the numpy
    backend's cast, others (cupy) by ``astype``."""
    if isinstance(x, np.ndarray):
        out = np.empty(x.shape, dtype=dtype)
        NUMPY.cast_into(out, np.ascontiguousarray(x))
        return out
    return x.astype(dtype)


def _cast(x: Any, dtype_name: str) -> Any:
    """``x`` converted to ``dtype_name`` by its own library (a new array or tensor)."""
    if hasattr(x, "astype"):  # numpy, cupy
        if dtype_name == "bfloat16":
            if BFLOAT16 is None:
                raise DtypeError("Compression.bf16 on arrays needs ml_dtypes: "
                                 "pip install 'mpitrain[bf16]'")
            return _astype(x, BFLOAT16)
        return _astype(x, np.dtype(dtype_name))
    import torch

    return x.to(getattr(torch, dtype_name))


class Compressor:
    """The compressor interface (also the base class of the built-in ones).

    Attributes:
        casts: :meth:`decompress` only converts the reduced value back to the dtype of
            the value given to :meth:`compress` (the built-in casts); the optimizers
            then store a reduced gradient with one converting copy into the gradient
            instead of a new array and a copy. False for others (the default).
    """

    casts = False

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return the value to send and the context :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Undo :meth:`compress` on the reduced value."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send gradients as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return ``tensor`` itself (so an in-place allreduce writes into it)."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Return ``tensor`` itself."""
        return tensor


class _CastCompressor(Compressor):
    """Cast floating-point values to ``wire_dtype`` for the trip, and back."""

    wire_dtype = ""
    casts = True

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        """Cast floating-point ``tensor`` to the wire dtype; the context is its dtype."""
        if not _is_floating(tensor) or _dtype_name(tensor) == cls.wire_dtype:
            return tensor, None
        return _cast(tensor, cls.wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Cast back to the original dtype (no-op when nothing was cast)."""
        if ctx is None:
            return tensor
        return _astype(tensor, ctx) if hasattr(tensor, "astype") else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point gradients as float16 (half the bytes, ~3 decimal digits)."""

    wire_dtype = "float16"


class BF16Compressor(_CastCompressor):
    """Send floating-point gradients as bfloat16 (float32's range, ~2 decimal digits)."""

    wire_dtype = "bfloat16"


class Compression:
    """The built-in compressors, named as in Horovod: ``none``, ``fp16``, ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
