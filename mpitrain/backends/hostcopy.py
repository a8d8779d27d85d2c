"""One-call gather and scatter between a flat host buffer and many arrays.

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
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from .._builds import check_source

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


def compiled() -> bool:
    """True if the C extension is built (else every copy goes through numpy)."""
    return _EXTENSION is not None


__all__ = ["check", "compiled", "gather", "scatter"]
