"""The check that keeps mpitrain's compiled parts in step with their sources.

A build of the package (``pip install``, ``pip wheel``, ``make``: see setup.py) compiles
the async engine's core with mypyc and builds the host copy extension. Each build
records the SHA-256 of the source it was made from (the engine's in a manifest module,
the extension inside itself); on import, :func:`check_source` compares it with the
source beside the build, so that an edit since the last build is never silently
ignored.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

REBUILD = "rebuild it (make, or MPITRAIN_COMPILE=1 python setup.py build_ext --inplace)"
"""How to bring a compiled part up to date (said by every stale-build error)."""


def source_digest(source: Path) -> str:
    """The SHA-256 of ``source``'s bytes, in hex (what setup.py records)."""
    return hashlib.sha256(source.read_bytes()).hexdigest()


def check_source(package: str, what: str, source: Path, built_from: str | None,
                 instead: str) -> None:
    """Raise ImportError if ``source`` exists (a source checkout) and ``built_from``, the
    digest the compiled ``what`` was built from, is not its digest.

    ``instead``: the other way out, said after :data:`REBUILD` (e.g. which ``.so`` files
    to delete to run without the build).
    """
    if source.exists() and source_digest(source) != built_from:
        raise ImportError(f"{package}: the compiled {what} was built from another version "
                          f"of {source}; {REBUILD} or {instead}")
