"""Durable, pickle-free training checkpoints, in a format other tools read.

A checkpoint is one safetensors file, ``DIR/ckpt-000000042.safetensors`` for step 42,
written and parsed by the ``safetensors`` library. What mpitrain adds on top:

* **The state's layout.** Every array of the state is a tensor named after its place
  in it (``model.layer1.weight``, ``optimizer.state.0.momentum``); the rest (dicts,
  lists, tuples, numbers, strings) is JSON in the header's ``__metadata__`` under
  ``mpitrain`` (:class:`_Encoder`, :class:`_Decoder`; docs/checkpoint-format.md).
  Arrays of a dtype safetensors lacks (complex128, strings, dates) are stored as their
  bytes (``U8``), their dtype and shape in the JSON.
* **A checksum**, ``__metadata__["mpitrain.crc32"]``: the CRC-32 of every byte of the
  file but its own 8 hex digits, so that any change after the write is detected.
* **Atomic, durable writes.** Rank 0 writes a temporary file in the target directory,
  ``fsync``\\ s it, renames it over the final name and ``fsync``\\ s the directory:
  a crash leaves the old or the new checkpoint, never a torn one. Temporary files of
  killed writers are removed when a directory is opened for saving or resuming. The
  other ranks wait for rank 0 and raise its error if it failed.
* **Per-rank state** (each rank's random generators), gathered to rank 0 and stored
  per rank, so a run resumed with the same rank count continues bit-identically.
* **Resuming** (:func:`load_latest`) from the newest intact checkpoint, skipping
  damaged ones with a warning; checkpoints of the earlier ``.npz`` format still load.

Reading trusts nothing in the file: the library checks the safetensors structure
(header length, header JSON, every tensor's dtype, shape and offsets against the
file's size) before it allocates anything, then mpitrain checks the checksum and its
JSON (nesting bounded before parsing, every reference checked); nothing is unpickled.
A damaged or foreign file raises :class:`DamagedCheckpointError` naming the file and
the problem. A file is read whole, so a load needs about twice its size of memory.

::

    ckpt = checkpoint.save(dir, {"params": ..., "optimizer": opt.state_dict(),
                                 "sampler": sampler.state_dict(), "epoch": e},
                           step=step, per_rank=checkpoint.capture_rng(gen))
    c = checkpoint.load_latest(dir, rank=comm.rank)   # None if there is none
    checkpoint.restore_rng(c.rank_state, gen)
"""

from __future__ import annotations

import ast
import io
import json
import logging
import math
import os
import random
import re
import socket
import struct
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, Callable

import numpy as np
import safetensors
import safetensors.numpy

from .communicator import Communicator
from .dtypes import BFLOAT16
from .errors import CheckpointError, DamagedCheckpointError
from .session import default_communicator, is_initialized

FORMAT = "mpitrain-checkpoint"
VERSION = 2
"""The format version of the JSON metadata that :func:`save` writes (1: ``.npz`` files)."""
MAX_DEPTH = 100
"""How deeply the JSON of a checkpoint may nest (dicts, lists; a tuple counts twice)."""

_SUFFIX = ".safetensors"
_NAME = re.compile(r"^ckpt-(\d+)\.(?:safetensors|npz)$")

# The header's __metadata__ (string values only): the checksum and the JSON skeleton.
_RESERVED, _CRC_KEY, _META_KEY = "__metadata__", "mpitrain.crc32", "mpitrain"
_CRC_FIELD = b'"mpitrain.crc32":"'  # in the header's text, followed by the 8 hex digits
_CHECKSUM_DIGITS = 8
_CHECKSUM_HEX = re.compile(rb"^[0-9a-f]{8}$")
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\](){}]")
_MAX_DIMS = 64

# safetensors' dtype codes and the numpy dtypes mpitrain stores as themselves (all
# little-endian); BF16 only where ml_dtypes provides numpy's bfloat16.
_DTYPES: dict[str, np.dtype[Any]] = {
    code: np.dtype(descr) for code, descr in (
        ("BOOL", "|b1"), ("U8", "|u1"), ("I8", "|i1"), ("U16", "<u2"), ("I16", "<i2"),
        ("F16", "<f2"), ("U32", "<u4"), ("I32", "<i4"), ("F32", "<f4"), ("C64", "<c8"),
        ("U64", "<u8"), ("I64", "<i8"), ("F64", "<f8"))}
if BFLOAT16 is not None:
    _DTYPES["BF16"] = BFLOAT16
_NATIVE = frozenset(_DTYPES.values())

# Temporary files are named after the writing process,
# ``.tmp-ckpt-PID@HOST.XXXXXX.safetensors`` (``.npz`` before), so that a later process can
# tell an abandoned one from one being written now.
_TMP_PREFIX = ".tmp-ckpt-"
_TMP_OWNER = re.compile(r"^\.tmp-ckpt-(\d+)@(.+)\.[a-z0-9_]+\.(?:safetensors|npz)$")
_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"
_STARTED = time.time()  # before any save of this process: saves need this module

log = logging.getLogger("mpitrain")

__all__ = ["MAX_DEPTH", "Checkpoint", "CheckpointError", "DamagedCheckpointError",
           "capture_rng", "latest", "list_checkpoints", "load", "load_latest", "path_for",
           "remove_temp_files", "restore_rng", "save"]


# -- the public API -----------------------------------------------------------------
def path_for(directory: str, step: int) -> str:
    """The file name of the checkpoint of ``step`` in ``directory``."""
    return os.path.join(directory, f"ckpt-{step:09d}{_SUFFIX}")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint in ``directory``, oldest first (``.npz``
    files of the earlier format included; of one step, the ``.npz`` file comes first)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for entry in os.listdir(directory):
        match = _NAME.match(entry)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, entry)))
    return sorted(found)


def latest(directory: str) -> str | None:
    """The path of the newest checkpoint in ``directory``, or ``None`` if there is none.

    The file is not read: to resume, use :func:`load_latest`, which skips damaged ones.
    """
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save(directory: str, state: Any, step: int, per_rank: Any = None,
         comm: Communicator | None = None, keep: int = 2) -> str:
    """Write a checkpoint of ``state`` at ``step`` (collective over ``comm``).

    Args:
        directory: where checkpoints live (created if missing); must be the same path
            on every rank, and readable by every rank that will load it.
        state: nested dicts/lists/tuples of numpy arrays, numbers, strings and None;
            taken from rank 0.
        step: the step number, part of the file name
            (``ckpt-000000042.safetensors``).
        per_rank: optional state that differs by rank (e.g. :func:`capture_rng`);
            gathered to rank 0 and stored for every rank.
        comm: the communicator (default: that of :func:`mpitrain.init` if initialised,
            else this process alone).
        keep: how many of the newest checkpoints to keep (0: all).

    Returns:
        The checkpoint's path (on every rank).

    Raises:
        CheckpointError: on every rank, if rank 0 could not encode or write the state.
    """
    comm = _communicator(comm)
    rank = comm.rank if comm is not None else 0
    gathered = comm.allgather_object(per_rank) if comm is not None else [per_rank]
    final = path_for(directory, step)
    error = None
    if rank == 0:
        try:
            meta, arrays = _encode(state, gathered if per_rank is not None else None, step)
            os.makedirs(directory, exist_ok=True)
            remove_temp_files(directory)
            _write_atomically(final, lambda f: _write_safetensors(f, arrays, meta))
            _remove_old(directory, keep)
        except (OSError, CheckpointError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if comm is not None:
        error = comm.broadcast_object(error, root=0)  # also the barrier
    if error is not None:
        raise CheckpointError(f"rank {rank}: rank 0 could not write checkpoint {final}: {error}")
    return final


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: the file it was read from.
        step: the step it was saved at.
        state: the saved state (arrays as numpy arrays).
        ranks: how many ranks saved per-rank state (0 if none).
        rank_state: the requested rank's per-rank state, or ``None``.
    """

    path: str
    step: int
    state: Any
    ranks: int
    rank_state: Any


def load(path: str, rank: int | None = None) -> Checkpoint:
    """Read a checkpoint without unpickling anything.

    Args:
        path: a file written by :func:`save` (to resume, see :func:`load_latest`); a
            name ending in ``.npz`` is read as a checkpoint of the earlier format.
        rank: whose per-rank state to return in ``rank_state``; a rank the checkpoint
            has no state for (a different rank count) raises.

    Raises:
        DamagedCheckpointError: the file is truncated or corrupted (its checksum, sizes
            or structure do not match), or is not an mpitrain checkpoint (another
            tool's safetensors file, another zip or npz file, object arrays); the
            message names the file and the problem.
        CheckpointError: the file is a checkpoint of another format version, holds
            bfloat16 arrays without ml_dtypes installed, or has no per-rank state for
            ``rank``.
        OSError: the file cannot be opened.
    """
    return _read(path).checkpoint(rank)


def load_latest(directory: str, rank: int | None = None) -> Checkpoint | None:
    """Read the newest intact checkpoint of ``directory``, to resume from it.

    A damaged newest checkpoint (see :func:`load`) is skipped with a warning (logger
    ``mpitrain``) that names it and the problem, and the next older one is tried.
    Temporary files left by killed saves are removed first.

    Args:
        directory: the directory given to :func:`save`.
        rank: whose per-rank state to return (as in :func:`load`).

    Returns:
        The checkpoint, or ``None`` if the directory holds none that is intact (with a
        warning if it holds damaged ones).

    Raises:
        CheckpointError: an intact checkpoint cannot be used (see :func:`load`).
    """
    remove_temp_files(directory)
    found = [path for _, path in reversed(list_checkpoints(directory))]
    for i, path in enumerate(found):
        try:
            contents = _read(path)
        except DamagedCheckpointError as exc:
            instead = f"trying {found[i + 1]}" if i + 1 < len(found) else "no older one"
            log.warning("mpitrain checkpoint: skipping %s: %s; %s", path, exc, instead)
            continue
        return contents.checkpoint(rank)
    if found:
        log.warning("mpitrain checkpoint: no intact checkpoint in %s (%d damaged: %s); "
                    "starting as if there were none", directory, len(found), ", ".join(found))
    return None


def remove_temp_files(directory: str) -> list[str]:
    """Remove the temporary files that killed saves left in ``directory``.

    Done by :func:`save` and :func:`load_latest`. Only files that no running save can
    be writing are removed: those named after a process of this host that has ended,
    and others last written before this process started. A file that cannot be
    removed (read-only directory) is left, with a warning.

    Returns:
        The paths removed.
    """
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for entry in sorted(entries):
        if not entry.startswith(_TMP_PREFIX) or not _abandoned(directory, entry):
            continue
        path = os.path.join(directory, entry)
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue  # another process removed it first
        except OSError as exc:
            log.warning("mpitrain checkpoint: cannot remove %s, the temporary file of an "
                        "interrupted save: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        log.info("mpitrain checkpoint: removed %d temporary file(s) of interrupted saves: %s",
                 len(removed), ", ".join(removed))
    return removed


# -- random generators ----------------------------------------------------------------
def capture_rng(generator: np.random.Generator | None = None) -> dict[str, Any]:
    """This process's random states: Python's, numpy's global one, ``generator``'s, and
    torch's CPU (and CUDA) generators when torch is imported."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state()}
    if generator is not None:
        state["generator"] = generator.bit_generator.state
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state().numpy()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [s.numpy() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any], generator: np.random.Generator | None = None) -> None:
    """Restore the states of :func:`capture_rng` (and ``generator``'s, if saved)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if generator is not None:
        if "generator" not in state:
            raise CheckpointError("restore_rng got a generator, but the checkpoint saved none; "
                                  "pass the generator to capture_rng() when saving")
        generator.bit_generator.state = state["generator"]
    if "torch" in state:
        import torch

        torch.set_rng_state(torch.from_numpy(np.array(state["torch"])))
        if "torch_cuda" in state:
            torch.cuda.set_rng_state_all([torch.from_numpy(np.array(s))
                                          for s in state["torch_cuda"]])


# -- state <-> (JSON skeleton, arrays) ------------------------------------------------
class _Encoder:
    """Splits a state into a JSON skeleton and arrays named after their place in it."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray[Any, Any]] = {}  # name: little-endian, C order

    def encode(self, value: Any, where: str, name: str) -> Any:
        """The JSON of ``value``, found at ``where`` (for messages) and named ``name``
        (dot-joined keys and indices, the names its arrays are stored under)."""
        if isinstance(value, np.generic):
            return {"__scalar__": self._array(np.asarray(value), where, name)}
        if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
            value = value.get()  # cupy: saved from host memory
        if isinstance(value, np.ndarray):
            return {"__array__": self._array(value, where, name)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{where}[{i}]", _join(name, i))
                                  for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]", _join(name, i)) for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{where}.{k}", _join(name, k))
                        for k, v in value.items()}
            return {"__items__": [[self.encode(k, f"{where} key", _join(name, k)),
                                   self.encode(v, f"{where}.{k}", _join(name, k))]
                                  for k, v in value.items()]}
        raise CheckpointError(f"checkpoint: {where} is a {type(value).__name__}; a checkpoint "
                              "holds only arrays, numbers, strings, None and dicts/lists/"
                              "tuples of them (convert tensors with .numpy())")

    def _array(self, arr: np.ndarray[Any, Any], where: str, name: str) -> dict[str, Any]:
        if arr.dtype.hasobject:
            raise CheckpointError(f"checkpoint: {where} is an array of Python objects, which "
                                  "cannot be stored without pickle; store a numeric array")
        key = self._unique(name or "state")
        little = arr.dtype.newbyteorder("<")
        if little in _NATIVE:
            self.arrays[key] = np.asarray(arr, dtype=little, order="C")
            return {"key": key}
        if arr.dtype.names is not None or arr.dtype.itemsize == 0:
            raise CheckpointError(f"checkpoint: {where} is an array of dtype {arr.dtype}, which "
                                  "a checkpoint cannot store; store each field of a structured "
                                  "array as an array of its own, and strings as str")
        # a dtype safetensors lacks (complex128, strings, dates): its bytes, as U8
        self.arrays[key] = np.asarray(arr, order="C").reshape(-1).view(np.uint8)
        return {"key": key, "dtype": arr.dtype.str, "shape": list(arr.shape)}

    def _unique(self, name: str) -> str:
        """``name``, or ``name#2``, ``name#3``, ... if it is taken (``{"a.b": x, "a": {"b":
        y}}`` names both arrays ``a.b``) or reserved."""
        key, n = name, 1
        while key in self.arrays or key == _RESERVED:
            n += 1
            key = f"{name}#{n}"
        return key


def _join(name: str, part: Any) -> str:
    return f"{name}.{part}" if name else str(part)


class _Decoder:
    """Rebuilds the state from the JSON skeleton and the arrays of file ``path``,
    checking every reference (the skeleton of a file without checksum may be damaged)."""

    def __init__(self, path: str, arrays: dict[str, np.ndarray[Any, Any]]) -> None:
        self.path = path
        self.arrays = arrays

    def decode(self, value: Any, where: str) -> Any:
        if isinstance(value, list):
            return [self.decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if not isinstance(value, dict):
            return value
        if "__array__" in value or "__scalar__" in value:
            arr = self._array(value.get("__array__") or value.get("__scalar__"), where)
            return arr[()] if "__scalar__" in value else arr
        if "__tuple__" in value:
            items = value["__tuple__"]
            if not isinstance(items, list):
                raise self._bad(where, f"a tuple's items are a {type(items).__name__}")
            return tuple(self.decode(v, f"{where}[{i}]") for i, v in enumerate(items))
        if "__items__" in value:
            return dict(self._item(pair, where) for pair in self._list(value["__items__"], where))
        return {k: self.decode(v, f"{where}.{k}") for k, v in value.items()}

    def _item(self, pair: Any, where: str) -> tuple[Any, Any]:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise self._bad(where, f"a dict item is {pair!r:.60}, not a [key, value] pair")
        key = _hashable(self.decode(pair[0], f"{where} key"))
        try:
            hash(key)
        except TypeError:
            raise self._bad(where, f"a dict key is a {type(key).__name__}") from None
        return key, self.decode(pair[1], f"{where}.{key}")

    def _list(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self._bad(where, f"a dict's items are a {type(value).__name__}")
        return value

    def _array(self, ref: Any, where: str) -> np.ndarray[Any, Any]:
        if not (isinstance(ref, dict) and isinstance(ref.get("key"), str)):
            raise self._bad(where, f"array reference {ref!r:.60} has no key")
        arr = self.arrays.get(ref["key"])
        if arr is None:
            raise self._bad(where, f"it names array {ref['key']!r:.40}, which the file lacks")
        kind = ref.get("dtype")
        if kind is None:
            return arr
        if kind != "bfloat16":
            return self._bytes_as(arr, kind, ref.get("shape"), where)
        if arr.dtype != np.uint16:  # .npz files: bfloat16 stored as uint16
            raise self._bad(where, f"array {ref['key']} of {arr.dtype} is marked {kind!r:.40}")
        if BFLOAT16 is None:
            raise CheckpointError(f"{self.path} holds bfloat16 arrays ({where}); "
                                  "pip install ml_dtypes to load it")
        return arr.view(BFLOAT16)

    def _bytes_as(self, raw: np.ndarray[Any, Any], descr: Any, shape: Any,
                  where: str) -> np.ndarray[Any, Any]:
        """The array of dtype ``descr`` and ``shape`` whose bytes ``raw`` holds."""
        if not (isinstance(descr, str) and len(descr) <= 40 and raw.dtype == np.uint8
                and raw.ndim == 1 and _is_shape(shape)):
            raise self._bad(where, f"array of {raw.dtype} {raw.shape} is marked dtype "
                                   f"{descr!r:.40}, shape {shape!r:.60}")
        try:
            dtype = np.dtype(descr)
        except (TypeError, ValueError):
            raise self._bad(where, f"{descr!r} is not a dtype") from None
        if (dtype.hasobject or dtype.names is not None or dtype.subdtype is not None
                or dtype.itemsize == 0 or math.prod(shape) * dtype.itemsize != raw.size):
            raise self._bad(where, f"{raw.size} bytes cannot hold an array of {descr!r} of "
                                   f"shape {tuple(shape)}")
        return raw.view(dtype).reshape(shape)

    def _bad(self, where: str, problem: str) -> DamagedCheckpointError:
        return _damaged(self.path, f"its metadata is inconsistent at {where}: {problem}")


def _is_shape(shape: Any) -> bool:
    """Whether ``shape`` (from JSON) is a list of array dimensions."""
    return (isinstance(shape, list) and len(shape) <= _MAX_DIMS
            and all(type(n) is int and 0 <= n < 1 << 63 for n in shape))


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _nested_deeper_than(skeleton: str, limit: int) -> bool:
    """Whether brackets nest more than ``limit`` levels deep in ``skeleton`` (a text
    with its string literals removed), found without parsing it: parsers recurse once
    per level, and Python's overflows its stack long before it runs out of memory."""
    depth = 0
    for bracket in _NOT_BRACKET.sub("", skeleton):
        depth += 1 if bracket in "([{" else -1
        if depth > limit:
            return True
    return False


# -- writing ------------------------------------------------------------------------
def _communicator(comm: Communicator | None) -> Communicator | None:
    if comm is None and is_initialized():
        return default_communicator()
    return comm


def _encode(state: Any, per_rank: list[Any] | None,
            step: int) -> tuple[str, dict[str, np.ndarray[Any, Any]]]:
    """The JSON metadata of a checkpoint, and its arrays by tensor name."""
    encoder = _Encoder()
    meta = {"format": FORMAT, "version": VERSION, "step": step,
            "state": encoder.encode(state, "state", ""),
            "per_rank": None if per_rank is None else
            [encoder.encode(s, f"per_rank[{r}]", f"per_rank.{r}") for r, s in enumerate(per_rank)]}
    text = json.dumps(meta)
    if _nested_deeper_than(_JSON_STRING.sub("", text), MAX_DEPTH):
        raise CheckpointError(f"checkpoint: the state nests more than {MAX_DEPTH} levels of "
                              "dicts and lists (a tuple counts twice), more than a checkpoint "
                              "can be loaded with; flatten it")
    return text, encoder.arrays


def _write_safetensors(f: BinaryIO, arrays: dict[str, np.ndarray[Any, Any]], meta: str) -> None:
    """Write the safetensors file of ``arrays`` with ``meta`` in its metadata, and its
    checksum: the library serializes it with 8 zeros for the checksum's digits, which
    are then replaced by the CRC-32 of every other byte."""
    try:
        data = safetensors.numpy.save(arrays, metadata={
            _CRC_KEY: "0" * _CHECKSUM_DIGITS, _META_KEY: meta})
    except safetensors.SafetensorError as exc:
        raise CheckpointError(f"checkpoint: safetensors cannot store the state: {exc}") from exc
    at = _checksum_at(data)
    if at is None:  # the library writes the metadata it is given: never happens
        raise CheckpointError("checkpoint: safetensors did not write the checksum's field")
    view = memoryview(data)
    f.write(view[:at])
    f.write(b"%08x" % _crc32_around(data, at))
    f.write(view[at + _CHECKSUM_DIGITS:])


def _write_atomically(final: str, write: Callable[[BinaryIO], None]) -> None:
    """Make ``final`` the file that ``write`` writes, atomically and durably."""
    directory = os.path.dirname(final) or "."
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{os.getpid()}@{_HOST}.", suffix=_SUFFIX,
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            mask = os.umask(0)
            os.umask(mask)
            os.fchmod(f.fileno(), 0o666 & ~mask)  # mkstemp's 0600, widened as open() would
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _remove_old(directory: str, keep: int) -> None:
    if keep > 0:
        for _, old in list_checkpoints(directory)[:-keep]:
            os.unlink(old)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):  # no such process (or no such pid)
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True


def _abandoned(directory: str, entry: str) -> bool:
    """Whether temporary file ``entry`` was left by a save that can no longer finish.

    A file named after a process of this host is abandoned when that process is gone
    (a recycled pid only keeps it longer). Any other one (another host's, or named the
    way older versions did) is abandoned when it was last written before this process
    started: a save is collective, so another rank of this job writes only after every
    rank has started (and imported this module), and a write in progress keeps moving
    the time. What can be removed wrongly is only the file of a writer on another host
    that has not written since this process started, yet is still alive: another job
    saving to the same directory, or a clock of that host's file server that runs
    behind this host's.
    """
    owner = _TMP_OWNER.match(entry)
    if owner and owner.group(2) == _HOST:
        return not _alive(int(owner.group(1)))
    try:
        return os.stat(os.path.join(directory, entry)).st_mtime < _STARTED
    except OSError:
        return False


# -- reading: check everything before trusting it -----------------------------------
@dataclass
class _Contents:
    """What a checkpoint file holds, decoded and checked."""

    path: str
    step: int
    state: Any
    per_rank: list[Any] | None

    def checkpoint(self, rank: int | None) -> Checkpoint:
        """The :class:`Checkpoint` with ``rank``'s per-rank state."""
        ranks = len(self.per_rank) if self.per_rank is not None else 0
        rank_state = None
        if rank is not None and self.per_rank is not None:
            if not 0 <= rank < ranks:
                raise CheckpointError(f"rank {rank}: {self.path} holds per-rank state of "
                                      f"{ranks} ranks; resume with {ranks} ranks to continue "
                                      "bit-identically, or load with rank=None to skip "
                                      "per-rank state")
            rank_state = self.per_rank[rank]
        return Checkpoint(self.path, self.step, self.state, ranks, rank_state)


def _damaged(path: str, problem: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(f"{path} is damaged or not an mpitrain checkpoint: {problem}; "
                                  "resume from an older one (checkpoint.load_latest(directory) "
                                  "skips damaged files)")


def _read(path: str) -> _Contents:
    """Every check, then the contents of checkpoint ``path`` (``.npz``: the earlier
    format; any other name: safetensors)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise _damaged(path, "the file is empty (0 bytes): truncated, or never written")
    if path.endswith(".npz"):
        meta, arrays = _read_npz(path, data)
    else:
        meta, arrays = _read_safetensors(path, data)
    decoder = _Decoder(path, arrays)
    per_rank = meta["per_rank"]
    return _Contents(path, meta["step"], decoder.decode(meta["state"], "state"),
                     None if per_rank is None else
                     [decoder.decode(s, f"per_rank[{r}]") for r, s in enumerate(per_rank)])


def _read_safetensors(path: str,
                      data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray[Any, Any]]]:
    """The metadata and arrays of safetensors checkpoint ``data``: the library checks
    and parses the format, then the checksum is checked, then mpitrain's metadata."""
    try:
        tensors = safetensors.deserialize(data)
    except safetensors.SafetensorError as exc:
        raise _damaged(path, f"safetensors cannot read it ({exc}): truncated, or not a "
                             "safetensors file") from None
    at = _checksum_at(data)
    if at is None:
        raise _damaged(path, f"its header holds no {_CRC_KEY!r} checksum, or several: "
                             "another tool's safetensors file")
    _check_crc32(path, data, at)
    # the library returns the tensors, not the metadata: read it from the header,
    # which the library has checked to be JSON of the safetensors layout
    header = _json(path, data[8:8 + int.from_bytes(data[:8], "little")], "header", MAX_DEPTH)
    metadata = header.get(_RESERVED) if isinstance(header, dict) else None
    text = metadata.get(_META_KEY) if isinstance(metadata, dict) else None
    if not isinstance(text, str):
        raise _damaged(path, f"its header holds no {_META_KEY!r} metadata")
    meta = _meta(path, _json(path, text.encode("utf-8"), "metadata", MAX_DEPTH), VERSION)
    return meta, {name: _tensor(path, name, info) for name, info in tensors}


def _tensor(path: str, name: str, info: dict[str, Any]) -> np.ndarray[Any, Any]:
    """Tensor ``name`` as the library returns it (its bytes, checked against its dtype
    and shape), as a numpy array that shares those bytes."""
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None and info["dtype"] == "BF16":
        raise CheckpointError(f"{path} holds bfloat16 arrays ({name!r:.40}); pip install "
                              "ml_dtypes to load it")
    if dtype is None:
        raise _damaged(path, f"tensor {name!r:.40} has the dtype {info['dtype']!r:.20}; "
                             f"mpitrain writes {', '.join(_DTYPES)}")
    return np.frombuffer(info["data"], dtype).reshape(info["shape"])


def _checksum_at(data: bytes) -> int | None:
    """Where the checksum's 8 hex digits start in safetensors file ``data``, if its
    header holds the checksum's field exactly once (``None`` if not).

    The library orders the metadata as it likes, so the digits have no fixed place.
    In the header's JSON text this byte sequence can only be that field: the quotes of
    a string that contains it are escaped.
    """
    end = 8 + int.from_bytes(data[:8], "little")
    at = data.find(_CRC_FIELD, 8, end)
    if at < 0 or data.find(_CRC_FIELD, at + 1, end) >= 0:
        return None
    return at + len(_CRC_FIELD)


def _crc32_around(data: bytes, at: int) -> int:
    """The CRC-32 of every byte of ``data`` but the checksum's digits at ``at``."""
    view = memoryview(data)
    return zlib.crc32(view[at + _CHECKSUM_DIGITS:], zlib.crc32(view[:at]))


def _check_crc32(path: str, data: bytes, at: int) -> None:
    """Compare the checksum (8 hex digits at ``at``) with the CRC-32 of every other byte."""
    digits = data[at:at + _CHECKSUM_DIGITS]
    if not _CHECKSUM_HEX.match(digits):
        raise _damaged(path, f"its checksum {digits!r:.30} is not 8 hex digits")
    crc = _crc32_around(data, at)
    if crc != int(digits, 16):
        raise _damaged(path, f"its contents do not match their CRC-32 (stored "
                             f"{digits.decode()}, computed {crc:08x}): the file changed "
                             "after it was written")


def _json(path: str, text: bytes, what: str, depth: int) -> Any:
    """The JSON ``text`` (the file's ``what``), once its nesting is found within ``depth``."""
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _damaged(path, f"its {what} is not UTF-8 text ({exc})") from None
    if _nested_deeper_than(_JSON_STRING.sub("", decoded), depth):
        raise _damaged(path, f"its {what} nests more than {depth} levels deep")
    try:
        return json.loads(decoded)
    except ValueError as exc:
        raise _damaged(path, f"its {what} is not valid JSON ({exc})") from None


def _meta(path: str, meta: Any, version: int) -> dict[str, Any]:
    """The checked metadata: an mpitrain checkpoint's of format ``version``."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _damaged(path, f"its metadata is not an mpitrain checkpoint's (format "
                             f"{found!r:.60}, expected {FORMAT!r})")
    if meta.get("version") != version:
        raise CheckpointError(f"{path}: unknown format {meta.get('format')!r} version "
                              f"{meta.get('version')!r:.20}; expected {FORMAT!r} {version} "
                              "(written by another version of mpitrain?)")
    step, per_rank = meta.get("step"), meta.get("per_rank")
    if type(step) is not int or "state" not in meta or not (per_rank is None
                                                             or isinstance(per_rank, list)):
        raise _damaged(path, f"its metadata lacks a step, state or per-rank list (step "
                             f"{step!r:.20}, per_rank a {type(per_rank).__name__})")
    return meta


# -- the earlier format, read only: .npz archives --------------------------------------
# A zip of .npy entries a0, a1, ... and __meta__ (the JSON, as bytes), with a CRC-32 of
# every byte but its own 8 hex digits in the zip comment ("mpitrain-crc32:XXXXXXXX"), or
# without a comment in the oldest. The zip directory and .npy headers are checked here
# against the file's size before anything is allocated.
_NPZ_VERSION = 1
_META = "__meta__"
_CHECKSUM_TAG = b"mpitrain-crc32:"
_END_RECORD = struct.Struct("<4s4H2LH")  # zip end-of-central-directory record, 22 bytes
_END_SIGNATURE = b"PK\x05\x06"
_NPY_MAGIC = b"\x93NUMPY"
_NPY_HEADER_MAX = 10000  # what np.load accepts without allow_pickle
_NPY_VERSIONS = {(1, 0): ("<H", "latin1"), (2, 0): ("<I", "latin1"), (3, 0): ("<I", "utf8")}
_NPY_HEADER_DEPTH = 32  # of brackets in a .npy header (structured dtypes nest)
_PY_STRING = re.compile(r"'[^'\\]*(?:\\.[^'\\]*)*'|\"[^\"\\]*(?:\\.[^\"\\]*)*\"", re.DOTALL)
_NPY_HEADER_SKELETON = re.compile(r"[\s{}\[\](),:'0-9A-Za-z_]*")  # strings replaced by ''
_CHUNK = 1 << 20


def _read_npz(path: str, data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray[Any, Any]]]:
    """The metadata and arrays of ``.npz`` checkpoint ``data``."""
    declared = _verify_end(path, data)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = _entries(path, archive, len(data), declared)
            if _META not in entries:
                names = ", ".join(sorted(entries)[:5]) or "none"
                raise _damaged(path, f"it has no {_META} entry (arrays: {names}): "
                                     "another npz or zip file")
            raw = _read_array(path, archive, _META, entries[_META])
            if raw.dtype != np.uint8 or raw.ndim != 1:
                raise _damaged(path, f"its {_META} entry is {raw.dtype} of shape "
                                     f"{raw.shape}, not bytes")
            meta = _meta(path, _json(path, raw.tobytes(), "metadata", MAX_DEPTH),
                         _NPZ_VERSION)
            arrays = {key: _read_array(path, archive, key, info)
                      for key, info in entries.items() if key != _META}
    except (CheckpointError, MemoryError):
        raise
    except Exception as exc:  # anything else a damaged zip or .npy header can raise
        raise _damaged(path, f"its zip structure is unreadable ({type(exc).__name__}: "
                             f"{exc})") from exc
    return meta, arrays


def _verify_end(path: str, data: bytes) -> int:
    """Check the zip end record, and the checksum of the whole file if it has one.

    Returns:
        The number of entries the end record declares (0xFFFF: see the zip64 record).
    """
    size = len(data)
    if size < _END_RECORD.size:
        raise _damaged(path, f"the file is {size} bytes long, shorter than the "
                             f"{_END_RECORD.size}-byte end record of any zip archive: "
                             "truncated, or never written")
    record = len(_CHECKSUM_TAG) + _CHECKSUM_DIGITS
    tail = data[-_END_RECORD.size - record:]
    entries = _end_record(tail[-_END_RECORD.size:], 0)
    if entries is not None:
        pass  # no zip comment: written before checksums (the text of a comment cannot
        # hold an end record, so a file with a checksum never looks like this)
    elif (entries := _end_record(tail, record)) is not None:
        comment = tail[-record:]
        if not comment.startswith(_CHECKSUM_TAG):
            raise _damaged(path, f"its checksum record (zip comment {comment!r}) is damaged")
        _check_crc32(path, data, size - _CHECKSUM_DIGITS)
    else:
        raise _damaged(path, f"it does not end with a zip end record ({size} bytes, last "
                             f"{tail[-8:].hex()}): truncated, or not a checkpoint")
    return entries


def _end_record(data: bytes, comment: int) -> int | None:
    """The number of entries of the zip end record that ``data`` starts with, if its
    comment is ``comment`` bytes long and takes the rest of ``data`` (``None`` if not)."""
    if len(data) != _END_RECORD.size + comment:
        return None
    signature, disk, first_disk, on_disk, entries, _, _, length = _END_RECORD.unpack_from(data)
    if signature != _END_SIGNATURE or length != comment:
        return None
    if disk or first_disk or on_disk != entries:  # a checkpoint is one zip "disk"
        return None
    return int(entries)


def _entries(path: str, archive: zipfile.ZipFile, size: int,
             declared: int) -> dict[str, zipfile.ZipInfo]:
    """The archive's arrays by name, once their declared sizes are checked against the
    file's: together they cannot claim more bytes than the file has."""
    listed = archive.infolist()
    if declared not in (len(listed), 0xFFFF):
        raise _damaged(path, f"its end record declares {declared} entries, its central "
                             f"directory lists {len(listed)}")
    entries, total = {}, 0
    for info in listed:
        name = info.filename
        if not name.endswith(".npy"):
            raise _damaged(path, f"it holds an entry {name!r:.60}; a checkpoint holds only "
                                 ".npy arrays")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise _damaged(path, f"entry {name!r:.60} is compressed (method "
                                 f"{info.compress_type}); checkpoints store arrays as they are")
        if info.header_offset + info.file_size > size:
            raise _damaged(path, f"entry {name!r:.60} declares {info.file_size} bytes at offset "
                                 f"{info.header_offset}, past the end of the {size}-byte file: "
                                 "truncated")
        total += info.file_size
        entries[name[:-len(".npy")]] = info
    if total > size:
        raise _damaged(path, f"its entries declare {total} bytes in all, more than the file's "
                             f"{size}")
    return entries


def _read_array(path: str, archive: zipfile.ZipFile, key: str,
                info: zipfile.ZipInfo) -> np.ndarray[Any, Any]:
    """Array ``key``, allocated only once its header agrees with its entry's size."""
    with archive.open(info) as member:
        dtype, shape, fortran, header = _npy_header(path, key, member, info.file_size)
        count = math.prod(shape)
        if count * dtype.itemsize != info.file_size - header:
            raise _damaged(path, f"array {key!r:.40} declares shape {shape} of {dtype} "
                                 f"({count * dtype.itemsize} bytes), but its entry holds "
                                 f"{info.file_size - header} bytes of data")
        flat = np.empty(count, dtype)
        data = flat.view(np.uint8) if flat.nbytes else np.empty(0, np.uint8)
        done = 0
        while done < data.size:
            chunk = member.read(min(_CHUNK, data.size - done))
            if not chunk:
                raise _damaged(path, f"array {key!r:.40} ends after {done} of its "
                                     f"{data.size} bytes")
            data[done:done + len(chunk)] = np.frombuffer(chunk, np.uint8)
            done += len(chunk)
        if member.read(1):  # also makes zipfile check the entry's CRC-32
            raise _damaged(path, f"array {key!r:.40} has data past its declared shape")
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def _npy_header(path: str, key: str, member: IO[bytes],
                size: int) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """The dtype, shape, order and header length of a ``.npy`` entry (numpy's format:
    magic, version, header length, then a Python dict literal)."""
    magic = member.read(len(_NPY_MAGIC) + 2)
    version = tuple(magic[len(_NPY_MAGIC):])
    if not magic.startswith(_NPY_MAGIC) or version not in _NPY_VERSIONS:
        raise _damaged(path, f"array {key!r:.40} does not start with a .npy header "
                             f"(got {magic.hex()})")
    length_format, encoding = _NPY_VERSIONS[version]
    start = len(magic) + struct.calcsize(length_format)
    (length,) = struct.unpack(length_format, member.read(struct.calcsize(length_format)))
    if length > _NPY_HEADER_MAX or start + length > size:
        raise _damaged(path, f"array {key!r:.40} declares a {length}-byte .npy header in a "
                             f"{size}-byte entry (at most {_NPY_HEADER_MAX})")
    text = member.read(length).decode(encoding)
    skeleton = _PY_STRING.sub("''", text)
    if (not _NPY_HEADER_SKELETON.fullmatch(skeleton)
            or _nested_deeper_than(skeleton, _NPY_HEADER_DEPTH)):
        # what ast.literal_eval may overflow on: operators ("-" * 9999 + "1"), deep nesting
        raise _damaged(path, f"array {key!r:.40} has a .npy header {text!r:.80}")
    header = ast.literal_eval(text)  # literals only, as np.load parses it
    if not (isinstance(header, dict) and set(header) == {"descr", "fortran_order", "shape"}):
        raise _damaged(path, f"array {key!r:.40} has a .npy header {text!r:.80}")
    shape, fortran = header["shape"], header["fortran_order"]
    if not (isinstance(shape, tuple) and len(shape) <= 64 and isinstance(fortran, bool)
            and all(type(n) is int and 0 <= n < 1 << 63 for n in shape)):
        raise _damaged(path, f"array {key!r:.40} has the shape {shape!r:.80} and fortran_order "
                             f"{fortran!r:.20}")
    dtype = np.lib.format.descr_to_dtype(header["descr"])
    if dtype.hasobject:
        raise _damaged(path, f"array {key!r:.40} holds Python objects ({dtype}), which cannot "
                             "be loaded without pickle; a checkpoint holds only numeric arrays")
    if dtype.subdtype is not None or (dtype.itemsize == 0 and dtype.kind != "V"):
        # (np.empty would make an S0 or U0 array of S1 or U1, with bytes the size check
        # did not count)
        raise _damaged(path, f"array {key!r:.40} has the dtype {header['descr']!r:.40}, "
                             "which numpy never writes for a whole array")
    return dtype, shape, fortran, start + length
