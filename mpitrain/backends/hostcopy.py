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
rounded back to nearest even; sums, products and scalings in one pass of eight elements
at a time in registers where the processor has F16C (float16) or AVX2 (bfloat16). The
results are bit for bit numpy's (both compute in float32 and round once per operation;
a factor is first rounded as numpy rounds a Python float: to float16 for float16, to
float32 for bfloat16), except which NaN's payload a NaN + NaN keeps. They return
``False`` without writing when the extension is not built or the arrays do not qualify
(not C-contiguous, dtypes or lengths that differ, a read-only destination); the caller
then uses numpy.
:func:`convert16` casts between float32 and float16/bfloat16 likewise (numpy's float16
cast is about as slow as its arithmetic): the numpy backend's ``cast_into`` and the
``fp16``/``bf16`` gradient compressors use it.

:func:`read_peer` reads another process's memory with Linux's ``process_vm_readv``
(cross-memory attach), for the single-copy collectives
(:mod:`mpitrain.algorithms.single_copy`); :mod:`mpitrain.comm.shm` probes whether the
ranks may.

:func:`counters` passes the shared-memory barrier of the small calls
(:meth:`mpitrain.comm.shm.SharedMemory.agree`) in one call: publish the fingerprint,
arrive, spin a bounded number of tests and compare: through the interpreter those
steps cost more than the wait for the other ranks (docs/benchmarks.md, "A compiled
barrier").

:func:`doorbell` is where the async engine's progress thread sleeps: woken by a
submission, it stays off the GIL a little longer, so that a caller that submits and
then waits runs the cycle on its own thread undisturbed (:mod:`mpitrain.engine`).
"""

from __future__ import annotations

import threading
import time
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


def _factor(dtype: Any, factor: float) -> float:
    """``factor`` as numpy multiplies an array of ``dtype`` by a Python float: rounded to
    float16 for float16; as float32 for bfloat16 (ml_dtypes computes in float32)."""
    return float(np.float16(factor) if dtype == np.float16 else np.float32(factor))


def reduces16(dtype: Any) -> bool:
    """True where :func:`reduce16` reduces arrays of ``dtype`` (the extension is built
    and ``dtype`` is float16 or bfloat16)."""
    return _EXTENSION is not None and dtype in _KIND


def reduce16(dst: Any, a: Any, b: Any, op: ReduceOp, factor: float = 1.0) -> bool:
    """``dst = (a <op> b) * factor`` for float16 or bfloat16 numpy arrays of one dtype and
    length (``dst`` may be ``a`` or ``b``), rounded as numpy's reduce then multiply by a
    Python float; ``False``, writing nothing, where the
    extension cannot do it (then use numpy)."""
    kind = _KIND.get(dst.dtype)
    if (_EXTENSION is None or kind is None or a.dtype != dst.dtype
            or b.dtype != dst.dtype):
        return False
    return bool(_EXTENSION.reduce16(dst.view(np.uint16), a.view(np.uint16),
                                    b.view(np.uint16), kind, _OP[op],
                                    _factor(dst.dtype, factor)))


def scale16(dst: Any, src: Any, factor: float) -> bool:
    """``dst = src * factor`` for float16 or bfloat16 numpy arrays of one dtype and
    length (``dst`` may be ``src``); ``False``, writing nothing, where the extension cannot
    do it (then use numpy)."""
    kind = _KIND.get(dst.dtype)
    if _EXTENSION is None or kind is None or src.dtype != dst.dtype:
        return False
    return bool(_EXTENSION.scale16(dst.view(np.uint16), src.view(np.uint16), kind,
                                   _factor(dst.dtype, factor)))


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


def address(arr: Any) -> int:
    """The address of a numpy array's first byte."""
    return int(arr.__array_interface__["data"][0])


def read_peer(pid: int, local: Any, remote: int) -> None:
    """Copy ``local.nbytes`` bytes of process ``pid`` at address ``remote`` into the
    C-contiguous numpy array ``local`` (any dtype).

    Raises:
        OSError: the kernel refused (another user, Yama's ptrace_scope, a container
            without CAP_SYS_PTRACE, a bad address), or the extension is not built.
    """
    if _EXTENSION is None:
        raise OSError("the _hostcopy extension, which reads other processes' memory, is "
                      "not built")
    _EXTENSION.vm_read(pid, local.reshape(-1).view(np.uint8), remote)


def yama_scope() -> int:
    """Yama's ``kernel.yama.ptrace_scope`` (0 where Yama is absent)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def allow_peers() -> bool:
    """Under Yama's ptrace_scope 1, let this user's other processes read this one's
    memory (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``); True if that took effect."""
    return _EXTENSION is not None and bool(_EXTENSION.allow_peers())


def counters(words: Any, rank: int, size: int) -> Any:
    """The extension's barrier over the shared window's counters and fingerprints
    (``words``: a writable buffer of ``3 * size`` int64 words; :mod:`mpitrain.comm.shm`),
    or ``None`` where the extension is not built (the window's own Python code then
    passes the barrier).

    Its ``agree(t, fingerprint, polls)`` publishes ``fingerprint`` for barrier ``t``,
    arrives and tests up to ``1 + polls`` times whether every rank has, in one call:
    1 if every rank has and published the same fingerprint, 0 if one differs, -1 if
    some rank has not arrived yet (the caller waits, then compares).
    """
    return None if _EXTENSION is None else _EXTENSION.Counters(words, rank, size)


class _Doorbell:
    """The doorbell of :func:`doorbell` where the extension is not built: the same
    rules, but the sleeper takes the GIL back as soon as it is woken."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rung = self._urgent = self._taken = False

    def ring(self, settle: bool) -> None:
        with self._cond:
            self._rung, self._taken = True, False
            self._urgent = self._urgent or not settle
            self._cond.notify()

    def taken(self) -> None:
        with self._cond:
            self._taken = True

    def sleep(self, timeout: float, settle_s: float) -> bool:
        end = None if timeout < 0 else time.monotonic() + timeout
        with self._cond:
            try:
                while True:
                    while not self._rung:
                        left = None if end is None else end - time.monotonic()
                        if left is not None and left <= 0:
                            return False
                        self._cond.wait(left)
                    self._rung = False
                    if self._urgent or settle_s <= 0:
                        return True
                    self._cond.release()
                    try:
                        time.sleep(settle_s)
                    finally:
                        self._cond.acquire()
                    if self._urgent or not self._taken:
                        return True
            finally:
                self._urgent = False


def doorbell() -> Any:
    """Where the async engine's progress thread sleeps (:mod:`mpitrain.engine`).

    ``ring(settle)`` wakes the sleeper, or makes its next sleep return at once;
    ``settle`` marks a submission, which its caller may run itself by waiting for it.
    ``taken()`` says that a caller took all the work rung for so far.
    ``sleep(timeout, settle_s)`` waits for a ring (``timeout < 0``: for ever; ``False``
    after a timeout); woken by rings that all asked to settle, it waits ``settle_s``
    more and, if a caller has taken all the work rung for by then, sleeps on; a ring
    without ``settle`` wakes it for good. The extension's sleep holds no GIL until it
    knows there is work, so a caller that submits and then runs the cycle itself keeps
    the GIL meanwhile (Linux; elsewhere, and without the extension, a Python condition
    variable with the same rules).
    """
    bell = None if _EXTENSION is None else getattr(_EXTENSION, "Doorbell", None)
    return _Doorbell() if bell is None else bell()


def compiled() -> bool:
    """True if the C extension is built (else every copy goes through numpy)."""
    return _EXTENSION is not None


__all__ = ["address", "allow_peers", "check", "compiled", "convert16", "counters", "doorbell",
           "gather", "read_peer", "reduce16", "scale16", "scatter", "yama_scope"]
