"""Does the MPI library in this process accept device (CUDA) pointers?

Asked once per process, in this order:

1. ``MPITRAIN_CUDA_AWARE=0/1`` (a communicator's setting, :mod:`mpitrain.config`) decides
   outright.
2. The loaded ``libmpi`` is asked through ctypes: ``MPIX_Query_cuda_support()``
   (Open MPI's CUDA extension, MPICH 4) or ``MPIX_GPU_query_support(CUDA, &flag)``
   (MPICH 4.1+). A library without either symbol is not an error.
3. For Open MPI without the symbol, ``ompi_info --parsable --all`` is read for
   ``mpi_built_with_cuda_support`` (Open MPI 4) or ``opal_built_with_cuda_support``
   (Open MPI 5); the ``ompi_info`` next to the loaded library is preferred.
4. Otherwise: not CUDA-aware (the safe answer: device buffers are staged).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

_MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's enum value for CUDA in MPIX_GPU_query_support
_OMPI_INFO_FLAG = re.compile(r"^mca:\w+:base:param:(?:mpi|opal)_built_with_cuda_support:"
                             r"value:(true|false)$", re.MULTILINE)


@dataclass(frozen=True)
class Detection:
    """The answer and how it was found."""

    aware: bool | None
    """True/False, or None when the method could not tell."""
    how: str
    """Which method answered (shown in benchmark headers)."""


def loaded_libmpi() -> list[str]:
    """Paths of the ``libmpi`` shared libraries mapped into this process (Linux)."""
    from mpi4py import MPI  # noqa: F401 - loads the MPI library

    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libmpi."))


def query_library(path: str) -> Detection:
    """Ask the library at ``path`` through its MPIX query functions, if it has them."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return Detection(None, f"cannot open {path}: {exc}")
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype, query.argtypes = ctypes.c_int, []
        return Detection(bool(query()), f"MPIX_Query_cuda_support() in {path}")
    gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        flag = ctypes.c_int(0)
        gpu_query.restype = ctypes.c_int
        gpu_query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        if gpu_query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
            return Detection(bool(flag.value), f"MPIX_GPU_query_support() in {path}")
    return Detection(None, f"no MPIX CUDA query in {path}")


def parse_ompi_info(text: str) -> bool | None:
    """The ``*_built_with_cuda_support`` value of ``ompi_info --parsable --all`` output."""
    match = _OMPI_INFO_FLAG.search(text)
    return None if match is None else match.group(1) == "true"


def query_ompi_info(libmpi: str | None) -> Detection:
    """Read Open MPI's build flag from ``ompi_info`` (the one beside ``libmpi`` first)."""
    candidates = []
    if libmpi:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(libmpi)), "bin",
                                       "ompi_info"))
    found = shutil.which("ompi_info")
    if found:
        candidates.append(found)
    for exe in candidates:
        if not os.access(exe, os.X_OK):
            continue
        try:
            done = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True,
                                  timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        aware = parse_ompi_info(done.stdout)
        if aware is not None:
            return Detection(aware, f"{exe} --parsable --all")
    return Detection(None, "no ompi_info answered")


def detect() -> Detection:
    """Find out, from the library itself, whether MPI accepts device pointers."""
    from mpi4py import MPI

    libraries = loaded_libmpi()
    for path in libraries:
        found = query_library(path)
        if found.aware is not None:
            return found
    if "Open MPI" in MPI.Get_library_version():
        found = query_ompi_info(libraries[0] if libraries else None)
        if found.aware is not None:
            return found
    return Detection(False, "no query answered; assuming host memory only")


@functools.cache
def detected() -> Detection:
    """:func:`detect`, run once per process."""
    return detect()


def decision(forced: bool | None) -> Detection:
    """The answer in force: ``forced`` (a communicator's ``MPITRAIN_CUDA_AWARE``) if not
    ``None``, else what :func:`detected` found."""
    if forced is not None:
        return Detection(forced, f"MPITRAIN_CUDA_AWARE={int(forced)}")
    return detected()


def mpi_accepts_device_pointers(forced: bool | None) -> bool:
    """True if device buffers may be handed to MPI directly (``forced``: as for
    :func:`decision`)."""
    return bool(decision(forced).aware)
