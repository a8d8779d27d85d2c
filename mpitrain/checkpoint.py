"""Durable, pickle-free training checkpoints.

A checkpoint is one ``.npz`` file: every array of the saved state is an entry, and
the rest of the state (dicts, lists, tuples, numbers, strings; the layout) is JSON
stored in the entry ``__meta__``. Loading uses ``allow_pickle=False``, so a file can
never run code; a file holding an object array is refused.

Writing is atomic and durable: rank 0 writes a temporary file in the target
directory, ``fsync``\\ s it, renames it over the final name and ``fsync``\\ s the
directory, so a crash leaves either the old or the new checkpoint, never a torn
one. Temporary files left by a crashed writer are removed by the next save. The
other ranks wait for rank 0 and raise its error if it failed.

Per-rank state (each rank's random generators) is gathered to rank 0 and stored per
rank, so a run resumed with the same rank count continues bit-identically::

    ckpt = checkpoint.save(dir, {"params": ..., "optimizer": opt.state_dict(),
                                 "sampler": sampler.state_dict(), "epoch": e},
                           step=step, per_rank=checkpoint.capture_rng(gen))
    c = checkpoint.load(checkpoint.latest(dir), rank=comm.rank)
    checkpoint.restore_rng(c.rank_state, gen)
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from .communicator import Communicator
from .dtypes import BFLOAT16
from .errors import CheckpointError
from .session import default_communicator, is_initialized

FORMAT = "mpitrain-checkpoint"
VERSION = 1
_META = "__meta__"
_NAME = re.compile(r"^ckpt-(\d+)\.npz$")
_TMP_PREFIX = ".tmp-ckpt-"

__all__ = ["Checkpoint", "CheckpointError", "capture_rng", "latest", "load", "restore_rng",
           "save"]


# -- state <-> (JSON skeleton, arrays) ------------------------------------------------
class _Encoder:
    """Splits a state into a JSON skeleton and named arrays."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray[Any, Any]] = {}

    def encode(self, value: Any, where: str) -> Any:
        if isinstance(value, np.generic):
            return {"__scalar__": self._array(np.asarray(value), where)}
        if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
            value = value.get()  # cupy: saved from host memory
        if isinstance(value, np.ndarray):
            return {"__array__": self._array(value, where)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
            return {"__items__": [[self.encode(k, f"{where} key"), self.encode(v, f"{where}.{k}")]
                                  for k, v in value.items()]}
        raise CheckpointError(f"checkpoint: {where} is a {type(value).__name__}; a checkpoint "
                              "holds only arrays, numbers, strings, None and dicts/lists/"
                              "tuples of them (convert tensors with .numpy())")

    def _array(self, arr: np.ndarray[Any, Any], where: str) -> dict[str, Any]:
        if arr.dtype.hasobject:
            raise CheckpointError(f"checkpoint: {where} is an array of Python objects, which "
                                  "cannot be stored without pickle; store a numeric array")
        key = f"a{len(self.arrays)}"
        if BFLOAT16 is not None and arr.dtype == BFLOAT16:
            self.arrays[key] = np.ascontiguousarray(arr).view(np.uint16)
            return {"key": key, "dtype": "bfloat16"}
        self.arrays[key] = arr
        return {"key": key}


def _decode(value: Any, arrays: dict[str, np.ndarray[Any, Any]]) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "__array__" in value or "__scalar__" in value:
        ref = value.get("__array__") or value["__scalar__"]
        arr = arrays[ref["key"]]
        if ref.get("dtype") == "bfloat16":
            if BFLOAT16 is None:
                raise CheckpointError("checkpoint holds bfloat16 arrays; pip install ml_dtypes")
            arr = arr.view(BFLOAT16)
        return arr[()] if "__scalar__" in value else arr
    if "__tuple__" in value:
        return tuple(_decode(v, arrays) for v in value["__tuple__"])
    if "__items__" in value:
        return {_hashable(_decode(k, arrays)): _decode(v, arrays) for k, v in value["__items__"]}
    return {k: _decode(v, arrays) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# -- files ------------------------------------------------------------------------------
def path_for(directory: str, step: int) -> str:
    """The file name of the checkpoint of ``step`` in ``directory``."""
    return os.path.join(directory, f"ckpt-{step:09d}.npz")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for entry in os.listdir(directory):
        match = _NAME.match(entry)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, entry)))
    return sorted(found)


def latest(directory: str) -> str | None:
    """The path of the newest checkpoint in ``directory``, or ``None`` if there is none."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def _write_atomically(final: str, payload: bytes) -> None:
    directory = os.path.dirname(final) or "."
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            mask = os.umask(0)
            os.umask(mask)
            os.fchmod(f.fileno(), 0o666 & ~mask)  # mkstemp's 0600, widened as open() would
            f.write(payload)
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


def _remove_stale(directory: str, keep: int) -> None:
    for entry in os.listdir(directory):
        if entry.startswith(_TMP_PREFIX):
            os.unlink(os.path.join(directory, entry))
    if keep > 0:
        for _, old in list_checkpoints(directory)[:-keep]:
            os.unlink(old)


def _encode_file(state: Any, per_rank: list[Any] | None, step: int) -> bytes:
    encoder = _Encoder()
    meta = {"format": FORMAT, "version": VERSION, "step": step,
            "state": encoder.encode(state, "state"),
            "per_rank": None if per_rank is None else
            [encoder.encode(s, f"per_rank[{r}]") for r, s in enumerate(per_rank)]}
    text = json.dumps(meta).encode("utf-8")
    buf = io.BytesIO()
    entries = {**encoder.arrays, _META: np.frombuffer(text, dtype=np.uint8)}
    np.savez(buf, **entries)  # type: ignore[arg-type]  # (stubs confuse ** with allow_pickle)
    return buf.getvalue()


def _communicator(comm: Communicator | None) -> Communicator | None:
    if comm is None and is_initialized():
        return default_communicator()
    return comm


def save(directory: str, state: Any, step: int, per_rank: Any = None,
         comm: Communicator | None = None, keep: int = 2) -> str:
    """Write a checkpoint of ``state`` at ``step`` (collective over ``comm``).

    Args:
        directory: where checkpoints live (created if missing); must be the same path
            on every rank, and readable by every rank that will load it.
        state: nested dicts/lists/tuples of numpy arrays, numbers, strings and None;
            taken from rank 0.
        step: the step number, part of the file name (``ckpt-000000042.npz``).
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
            payload = _encode_file(state, gathered if per_rank is not None else None, step)
            os.makedirs(directory, exist_ok=True)
            _remove_stale(directory, 0)
            _write_atomically(final, payload)
            _remove_stale(directory, keep)
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
        path: a file written by :func:`save` (see :func:`latest`).
        rank: whose per-rank state to return in ``rank_state``; a rank the checkpoint
            has no state for (a different rank count) raises.

    Raises:
        CheckpointError: the file is not an mpitrain checkpoint, holds object arrays,
            or has no per-rank state for ``rank``.
    """
    try:
        with np.load(path, allow_pickle=False) as z:
            if _META not in z.files:
                raise CheckpointError(f"{path} is not an mpitrain checkpoint (no {_META})")
            meta = json.loads(bytes(z[_META]).decode("utf-8"))
            arrays = {k: z[k] for k in z.files if k != _META}
    except ValueError as exc:  # object arrays refuse to load without pickle
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path} cannot be loaded without pickle ({exc}); a checkpoint "
                              "must hold only numeric arrays") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: unknown format {meta.get('format')!r} version "
                              f"{meta.get('version')!r}; expected {FORMAT!r} {VERSION}")
    per_rank = meta["per_rank"]
    ranks = len(per_rank) if per_rank is not None else 0
    rank_state = None
    if rank is not None and per_rank is not None:
        if not 0 <= rank < ranks:
            raise CheckpointError(f"rank {rank}: {path} holds per-rank state of {ranks} ranks; "
                                  f"resume with {ranks} ranks to continue bit-identically, or "
                                  "load with rank=None to skip per-rank state")
        rank_state = _decode(per_rank[rank], arrays)
    return Checkpoint(path, int(meta["step"]), _decode(meta["state"], arrays), ranks,
                      rank_state)


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
