"""The compiled parts of mpitrain (everything else is in pyproject.toml).

A build (``pip install .``, ``pip wheel .``, ``python setup.py build_ext --inplace``)
compiles the async engine's core (the modules in ``COMPILED``) to C extensions with
mypyc, and builds the host gather/scatter extension (``HOSTCOPY``). ``MPITRAIN_COMPILE``
says how hard to try:

* unset: compile; if that fails (no working C compiler, no mypy), print one line that
  says so and build the pure-Python package, whose engine runs the same sources and
  whose host copies go through numpy;
* ``1``: compile, and fail the build if that fails (``make`` sets it);
* ``0``: build the pure-Python package without trying.
"""

import hashlib
import os
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

COMPILED = ["mpitrain/engine/request.py", "mpitrain/engine/fusion.py",
            "mpitrain/engine/negotiation.py", "mpitrain/engine/engine.py"]
MANIFEST = "_compiled.py"
"""Beside the compiled engine: the SHA-256 of each source in ``COMPILED``, which the
package checks at import so that an extension older than its source is never run."""
HOSTCOPY = Path("mpitrain/backends/_hostcopy.c")
MODE = os.environ.get("MPITRAIN_COMPILE", "")
METADATA_ONLY = {"egg_info", "dist_info", "sdist"}
"""Commands that only describe the package (pip's first steps): they skip mypyc."""
MYPYC_CONFIG = """\
[mypy]
ignore_missing_imports = True
check_untyped_defs = True
[mypy-torch.*,matplotlib.*]
follow_imports = skip
"""
"""mypy's settings for the compile (not pyproject's, which are the lint's). Modules the
engine core imports import torch and matplotlib (inside functions); the core uses
neither, so mypy need not read them (where they are installed, reading them made most
of the compile's time, for the same C)."""


def fall_back(reason: str, engine_only: bool = False) -> None:
    """Say, in one line of the build log, what the package is built without and why."""
    if engine_only:
        print(f"mpitrain: building without the compiled engine core ({reason}); the "
              f"engine runs its sources", file=sys.stderr, flush=True)
    else:
        print(f"mpitrain: building the pure-Python package ({reason}); the engine runs "
              f"its sources and host copies go through numpy", file=sys.stderr, flush=True)


def hostcopy_extension() -> Extension:
    """The ``HOSTCOPY`` extension; it knows the digest of its source, which
    mpitrain/backends/hostcopy.py checks."""
    digest = hashlib.sha256(HOSTCOPY.read_bytes()).hexdigest()
    return Extension("mpitrain.backends._hostcopy", [str(HOSTCOPY)],
                     define_macros=[("SOURCE_SHA256", f'"{digest}"')],
                     extra_compile_args=["-O3"])


class BuildCompiled(build_ext):
    """build_ext that adds mypyc's engine extensions, writes their manifest beside
    them, and falls back to no extensions at all when compiling fails (unless
    ``MPITRAIN_COMPILE=1``)."""

    def finalize_options(self) -> None:
        """Put mypyc's extensions first (mypyc type-checks and writes C here, so only
        a build pays for it, not reading the metadata), and compile even what an earlier
        build left in build/: this build's compiler (or its absence) decides."""
        modules = self.distribution.ext_modules
        if (modules and not set(self.distribution.commands) <= METADATA_ONLY
                and not any(e.name.startswith("mpitrain.engine.") for e in modules)):
            modules[:0] = engine_extensions()
        self.force = True
        super().finalize_options()

    def run(self) -> None:
        """Build every extension, or (compiling failed) none: an in-place build leaves
        the source tree as it was."""
        in_place = self.inplace
        manifest = Path(self.get_ext_fullpath("mpitrain.engine.engine")).with_name(MANIFEST)
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError) as exc:
            if MODE == "1":
                raise
            self.inplace = False  # what this build wrote: in build/
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            if not in_place:
                manifest.unlink(missing_ok=True)  # a copy of a stale one from the sources
            self.extensions = []
            fall_back(f"compiling failed: {exc}" + (
                "; extensions built in place before are left as they are" if in_place else ""))
            return
        if any(e.name.startswith("mpitrain.engine.") for e in self.extensions):
            digests = {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest()
                       for p in COMPILED}
            manifest.write_text('"""Written by setup.py when it compiled these engine '
                                'modules: their sources\' SHA-256."""\n\nSOURCES = '
                                + repr(digests) + "\n", encoding="utf-8")


def engine_extensions() -> list[Extension]:
    """mypyc's extensions for ``COMPILED`` (none, said in the log, without mypy or when
    mypyc fails, unless ``MPITRAIN_COMPILE=1``)."""
    try:
        from mypyc.build import mypycify
    except ImportError:
        if MODE == "1":
            raise SystemExit("MPITRAIN_COMPILE=1 needs mypy (pip install mypy) to compile "
                             "the engine core") from None
        fall_back("mypy, which compiles it, is not installed", engine_only=True)
        return []
    try:  # the shared library goes into the package (group name), beside the modules
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp, "mypyc.ini")
            config.write_text(MYPYC_CONFIG, encoding="utf-8")
            return mypycify(["--config-file", str(config), *COMPILED], opt_level="3",
                            group_name="mpitrain.engine.core")
    except SystemExit:  # mypy's errors are above in the log
        if MODE == "1":
            raise
        fall_back("mypyc cannot compile it: see mypy's errors above", engine_only=True)
        return []


if MODE not in ("", "0", "1"):
    raise SystemExit(f"MPITRAIN_COMPILE={MODE!r}: use 1 (compile or fail), 0 (pure Python) "
                     "or leave it unset (compile if a C compiler works)")
setup(ext_modules=[] if MODE == "0" else [hostcopy_extension()],
      cmdclass={"build_ext": BuildCompiled})
