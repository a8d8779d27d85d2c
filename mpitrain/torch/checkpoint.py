"""Checkpoints of torch models and optimizers through :mod:`mpitrain.checkpoint`.

Tensors become numpy arrays for the file and tensors again on load (model and
optimizer ``state_dict``\\ s, including bfloat16); the file stays pickle-free, and
other tools read the model's tensors from it by their ``state_dict`` names prefixed
with ``model.`` (``safetensors.torch.load_file``; docs/checkpoint-format.md). The
random states of Python, numpy and torch (CPU, and CUDA when in use) are saved per
rank, so a run resumed at the same rank count continues bit-identically.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import checkpoint, session
from ..parallel.broadcast import ArrayKind
from .tensors import as_buffer, from_buffer

TENSORS = ArrayKind(
    is_array=lambda x: isinstance(x, torch.Tensor),
    buffer=as_buffer,
    # a root's CUDA tensor is received into one on this rank's current CUDA device
    empty=lambda shape, dtype, memory: torch.empty(shape, dtype=getattr(torch, dtype),
                                                   device=memory),
    memory=lambda x: str(x.device.type),
)
"""Torch tensors as the leaves of :func:`mpitrain.parallel.broadcast.broadcast_tree`."""


def to_numpy(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a numpy array (host copy for device tensors)."""
    if isinstance(tree, torch.Tensor):
        return as_buffer(tree.detach().cpu())
    if isinstance(tree, dict):
        return {k: to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_numpy(v) for v in tree)
    return tree


def to_tensors(tree: Any) -> Any:
    """``tree`` with every numpy array replaced by a tensor sharing its memory."""
    if isinstance(tree, np.ndarray):
        return from_buffer(tree)
    if isinstance(tree, dict):
        return {k: to_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_tensors(v) for v in tree)
    return tree


def save_checkpoint(directory: str, step: int, model: torch.nn.Module,
                    optimizer: Any = None, extra: Any = None,
                    generator: np.random.Generator | None = None, keep: int = 2) -> str:
    """Save model, optimizer, ``extra`` (plain values/arrays) and every rank's RNG state.

    Collective over the default communicator (rank 0 writes); returns the path.
    """
    state = {"model": to_numpy(model.state_dict()),
             "optimizer": to_numpy(optimizer.state_dict()) if optimizer is not None else None,
             "extra": extra}
    return checkpoint.save(directory, state, step, per_rank=checkpoint.capture_rng(generator),
                           keep=keep)


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: Any = None,
                    generator: np.random.Generator | None = None,
                    rank: int | None = None) -> checkpoint.Checkpoint:
    """Restore model, optimizer and this rank's RNG state from ``path``.

    Args:
        rank: whose RNG state to restore (default: this process's rank, when
            mpitrain is initialised); the rank count must match the saving run's.

    Returns:
        The :class:`~mpitrain.checkpoint.Checkpoint` (``state["extra"]`` is ``extra``).
    """
    ckpt = checkpoint.load(path, rank=_this_rank(rank))
    _restore(ckpt, model, optimizer, generator)
    return ckpt


def load_latest_checkpoint(directory: str, model: torch.nn.Module, optimizer: Any = None,
                           generator: np.random.Generator | None = None,
                           rank: int | None = None) -> checkpoint.Checkpoint | None:
    """Like :func:`load_checkpoint`, from the newest intact checkpoint in ``directory``
    (:func:`mpitrain.checkpoint.load_latest`: damaged ones are skipped with a warning).

    Returns:
        The checkpoint, or ``None`` (nothing restored) if ``directory`` has none intact.
    """
    ckpt = checkpoint.load_latest(directory, rank=_this_rank(rank))
    if ckpt is not None:
        _restore(ckpt, model, optimizer, generator)
    return ckpt


def _this_rank(rank: int | None) -> int | None:
    if rank is None and session.is_initialized():
        return session.rank()
    return rank


def _restore(ckpt: checkpoint.Checkpoint, model: torch.nn.Module, optimizer: Any,
             generator: np.random.Generator | None) -> None:
    model.load_state_dict(to_tensors(ckpt.state["model"]))
    if optimizer is not None:
        optimizer.load_state_dict(to_tensors(ckpt.state["optimizer"]))
    if ckpt.rank_state is not None:
        checkpoint.restore_rng(ckpt.rank_state, generator)
