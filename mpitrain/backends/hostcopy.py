"""One-call gather and scatter between a flat host buffer and many arrays, and
16-bit float reductions at memory speed.

The numpy backend packs a fusion bucket's arrays into flat buffers and copies results
back out of them (:meth:`~.numpy_backend.NumpyBackend.pack_into`,
:meth:`~.numpy_backend.NumpyBackend.unpack_from`, ``scatter``). With numpy that is one
call per array for the scatter and about half a microsecond per array inside
``concatenate`` for the gather: for arrays of 10 KiB, more than the copy itself. The C
extension ``_hostcopy`` (``_hostcopy.c`` beside this file, built with the compiled
engine core by ``pip install``, ``pip wheel`` and ``make``: setup.py) copies every array
of the list with one ``memmove`` each, in one call.

:func:`gather` and :func:`scatter` return ``False`` without copying when the extension
is not built, or when the buffers cannot be copied byte for byte (one is not
C-contiguous, has another item format or none, a destination is read-only, the sizes
do not add up); the caller then copies with numpy. Importing refuses an extension
built from another version of ``_hostcopy.c`` (as :mod:`mpitrain.engine` does for its
compiled modules), so an edit is never silently ignored.

numpy computes float16 arithmetic one element at a time (about ten times slower than
float32 of the same length) and ml_dtypes' bfloat16 is no faster. :func:`reduce16` and
:func:`scale16` reduce and scale float16 and bfloat16 arrays in the extension: blocks
converted to float32 (F16C where the processor has it), combined and scaled there, and
rounded back to nearest even; a sum without a factor is bit for bit numpy's (both
compute in float32 and round once), except which NaN's payload a NaN + NaN keeps. A
factor is applied in float32 before the one rounding (numpy rounds the factor to
float16 first and rounds twice). They return ``False`` without writing when the
extension is not built or the arrays do not qualify (not C-contiguous, dtypes or
lengths that differ, a read-only destination); the caller then uses numpy.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .._builds import check_source
from ..dtypes import BFLOAT16
from ..ops import ReduceOp

SOURCE = Path(__file__).with_name("_hostcopy.c")


def _load() -> ModuleType | None:
    """The built extension, checked against its source; ``None`` if it is not built."""
    try:
        from . import _hostcopy  # type: ignore[attr-defined]
    except ImportError:
        return None
    check(_hostcopy.SOURCE_SHA256)
    return _hostcopy


def check(built_from: str) -> None:
    """Raise ImportError if ``built_from`` (the SHA-256 the extension was built from) is
    not that of the source beside this module (when there is one: a source checkout)."""
    check_source("mpitrain.backends", "_hostcopy extension", SOURCE, built_from,
                 f"delete {SOURCE.parent}/_hostcopy*.so to copy with numpy")


def _unavailable(flat: Any, parts: Any) -> bool:
    """Stands in for the extension's functions when it is not built: copies nothing."""
    return False


_EXTENSION = _load()

gather = _unavailable if _EXTENSION is None else _EXTENSION.gather
"""``gather(flat, parts) -> bool``: ``flat``'s bytes = the parts' bytes, one after the
other (``False``, copying nothing, if that cannot be done byte for byte)."""

scatter = _unavailable if _EXTENSION is None else _EXTENSION.scatter
"""``scatter(flat, parts) -> bool``: each part's bytes = its range of ``flat``'s bytes
(``False``, copying nothing, if that cannot be done byte for byte)."""


_KIND = {np.dtype(np.float16): 0} | ({BFLOAT16: 1} if BFLOAT16 is not None else {})
"""The extension's ``KIND_*`` code of each 16-bit float dtype."""
_OP = {ReduceOp.SUM: 0, ReduceOp.AVERAGE: 0, ReduceOp.PRODUCT: 1, ReduceOp.MIN: 2,
       ReduceOp.MAX: 3}
"""The extension's ``OP_*`` code of each elementwise reduction (Average adds)."""


def reduce16(dst: Any, a: Any, b: Any, op: ReduceOp, factor: float = 1.0) -> bool:
    """``dst = (a <op> b) * factor`` for float16 or bfloat16 numpy arrays of one dtype and
    length (``dst`` may be ``a`` or ``b``); ``False``, writing nothing, where the
    extension cannot do it (then use numpy)."""
    kind = _KIND.get(dst.dtype)
    if (_EXTENSION is None or kind is None or a.dtype != dst.dtype
            or b.dtype != dst.dtype):
        return False
    return bool(_EXTENSION.reduce16(dst.view(np.uint16), a.view(np.uint16),
                                    b.view(np.uint16), kind, _OP[op], factor))


def scale16(dst: Any, src: Any, factor: float) -> bool:
    """``dst = src * factor`` for float16 or bfloat16 numpy arrays of one dtype and
    length (``dst`` may be ``src``); ``False``, writing nothing, where the extension cannot
    do it (then use numpy)."""
    kind = _KIND.get(dst.dtype)
    if _EXTENSION is None or kind is None or src.dtype != dst.dtype:
        return False
    return bool(_EXTENSION.scale16(dst.view(np.uint16), src.view(np.uint16), kind, factor))


def convert16(dst: Any, src: Any) -> bool:
    """``dst = src`` between float32 and float16 or bfloat16 numpy arrays of one length
    (rounded to nearest even, as numpy's and ml_dtypes' casts); ``False``, writing
    nothing, where the extension cannot do it (then use numpy, about ten times slower
    for float16)."""
    f32 = np.dtype(np.float32)
    if dst.dtype == f32:
        kind, half, wide = _KIND.get(src.dtype), src, dst
    elif src.dtype == f32:
        kind, half, wide = _KIND.get(dst.dtype), dst, src
    else:
        return False
    if _EXTENSION is None or kind is None:
        return False
    return bool(_EXTENSION.convert16(dst if wide is dst else half.view(np.uint16),
                                     src if wide is src else half.view(np.uint16), kind))


def compiled() -> bool:
    """True if the C extension is built (else every copy goes through numpy)."""
    return _EXTENSION is not None


__all__ = ["check", "compiled", "convert16", "gather", "reduce16", "scale16", "scatter"]
