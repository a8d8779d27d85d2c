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


def why_not_compiled(engine: bool, hostcopy: bool, package_dir: Path) -> str:
    """Why this process runs without compiled parts, and how to build them; ``""`` when
    the engine core (``engine``) and the host copy extension (``hostcopy``) are both
    compiled.

    ``package_dir``: the directory of the imported ``mpitrain`` package. When a
    ``setup.py`` sits beside it, the program imported a source tree that was not built
    in place (a script saved in the clone's root does); otherwise an installation that
    was built without them (no C compiler at install time, or ``MPITRAIN_COMPILE=0``).
    """
    missing = [what for what, built in (("engine core", engine),
                                         ("host copy extension", hostcopy)) if not built]
    if not missing:
        return ""
    what = " and the ".join(missing)
    root = package_dir.parent
    if (root / "setup.py").exists():
        return (f"the {what} of the source tree {root} {'is' if len(missing) == 1 else 'are'}"
                f" not built: run `make` there (or `cd {root} && MPITRAIN_COMPILE=1 python "
                "setup.py build_ext --inplace`), or run your script from another directory "
                "to use the installed mpitrain")
    return (f"this installation of mpitrain ({package_dir}) was built without the {what} "
            "(no C compiler at install time, or MPITRAIN_COMPILE=0): install a C compiler "
            "and reinstall from the source with `MPITRAIN_COMPILE=1 pip install "
            "--force-reinstall --no-deps .` (docs/install.md, \"The compiled core\")")
