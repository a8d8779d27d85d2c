"""Sparse allreduce: an allgather of every rank's indices and values.

A sparse COO tensor's sum over ranks is the tensor whose entries are every rank's
entries together (duplicates add up when coalesced), so it takes two allgathers and
no reduction: the ``rows`` of indices (one per non-zero, ``sparse_dim`` wide) and the
``values`` (one per non-zero, the dense dims trailing). Each rank's rows start with a
two-row header, its sparse sizes and its non-zero count, so that every rank can split
the gathered rows by rank and check that all ranks' tensors have the same shape
(the engine already checks that the dense dims agree). ``Average`` divides the values
by the rank count (integers truncated toward zero, as Horovod scales them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..communicator import Communicator
from ..errors import ArgumentError
from ..ops import ReduceOp, parse_op
from .tensors import as_buffer, from_buffer

_HEADER_ROWS = 2
SPARSE_OPS = (ReduceOp.SUM, ReduceOp.AVERAGE)
"""The reductions of sparse tensors: their entries together (an allgather), averaged."""


def _sparse_input(tensor: Any, op: Any, where: int) -> tuple[torch.Tensor, ReduceOp]:
    """``tensor`` coalesced and ``op`` parsed, or :class:`ArgumentError`."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        kind = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ArgumentError(f"rank {where}: sparse_allreduce needs a sparse COO tensor, got "
                            f"{kind}; use allreduce for dense tensors")
    if tensor.sparse_dim() < 1:
        raise ArgumentError(f"rank {where}: sparse_allreduce needs at least one sparse "
                            "dimension; use allreduce on tensor.to_dense()")
    rop = parse_op(op)
    if rop not in SPARSE_OPS:
        raise ArgumentError(f"rank {where}: sparse_allreduce supports op=Sum and op=Average, "
                            f"not {rop!r}; densify the tensor for other ops")
    return tensor.coalesce(), rop


def sparse_part_names(name: str | None) -> tuple[str | None, str | None]:
    """The names of a sparse allreduce's two allgathers: ``f"{name}.indices"`` and
    ``f"{name}.values"`` (``None``: both unnamed)."""
    if name is None:
        return None, None
    return f"{name}.indices", f"{name}.values"


@dataclass(frozen=True)
class SparseInput:
    """A sparse allreduce's checked input: the two buffers to allgather and what the
    result is built from."""

    rows: Any  # the header and the indices, one row per non-zero
    values: Any
    sizes: list[int]  # the sparse sizes
    tensor: torch.Tensor  # coalesced
    op: ReduceOp


def prepare_sparse_allreduce(tensor: Any, op: Any, where: int) -> SparseInput:
    """Check ``tensor`` (a sparse COO tensor) and ``op`` (``Sum`` or ``Average``) on rank
    ``where`` and make the buffers of its two allgathers.

    Raises:
        ArgumentError: ``tensor`` is not sparse COO, or ``op`` is not Sum/Average.
        DtypeError: the indices or values cannot be sent (device, dtype).
    """
    t, rop = _sparse_input(tensor, op, where)
    sparse_dim, nnz = t.sparse_dim(), t.values().shape[0]
    sizes = list(t.shape[:sparse_dim])
    header = torch.zeros(_HEADER_ROWS, sparse_dim, dtype=torch.int64, device=t.device)
    header[0] = torch.tensor(sizes, dtype=torch.int64)
    header[1, 0] = nnz
    rows = torch.cat([header, t.indices().t().to(torch.int64)]).contiguous()
    return SparseInput(as_buffer(rows), as_buffer(t.values().contiguous()), sizes, t, rop)


def start_sparse_allreduce(comm: Communicator, prepared: SparseInput, name: str | None
                           ) -> tuple[list[Any], Callable[[], torch.Tensor]]:
    """Submit the allgathers of a sparse allreduce of a prepared input on ``comm``.

    Args:
        comm: the communicator (every rank must make the same call).
        prepared: :func:`prepare_sparse_allreduce`'s result; the tensor's shape must be
            the same on every rank.
        name: names the two allgathers (:func:`sparse_part_names`).

    Returns:
        The engine handles, and a function that waits for them and returns the
        coalesced sparse result.

    Raises:
        ArgumentError: ranks' shapes disagree (on every rank, when waited for).
    """
    t, rop, sizes = prepared.tensor, prepared.op, prepared.sizes
    rows_name, values_name = sparse_part_names(name)
    rows_handle = comm.allgather_async(prepared.rows, name=rows_name)
    values_handle = comm.allgather_async(prepared.values, name=values_name)

    def finish() -> torch.Tensor:
        gathered = from_buffer(rows_handle.wait())
        values = from_buffer(values_handle.wait())
        pieces, at = [], 0
        for r in range(comm.size):
            theirs = gathered[at].tolist()
            if theirs != sizes:
                raise ArgumentError(f"rank {comm.rank}: sparse_allreduce {name or ''} needs the "
                                    f"same shape on every rank, but rank {r} has sparse sizes "
                                    f"{theirs} and rank {comm.rank} {sizes}; pass tensors of "
                                    "one shape")
            count = int(gathered[at + 1, 0])
            pieces.append(gathered[at + _HEADER_ROWS:at + _HEADER_ROWS + count])
            at += _HEADER_ROWS + count
        if rop is ReduceOp.AVERAGE:
            if values.is_floating_point() or values.is_complex():
                values = values / comm.size
            else:
                values = torch.div(values, comm.size, rounding_mode="trunc")
        indices = torch.cat(pieces).t()
        # every rank's indices came from a valid tensor of this shape (checked above)
        return torch.sparse_coo_tensor(indices, values, t.shape, dtype=t.dtype,
                                       check_invariants=False).coalesce()
    return [rows_handle, values_handle], finish


__all__ = ["SPARSE_OPS", "SparseInput", "prepare_sparse_allreduce", "sparse_part_names",
           "start_sparse_allreduce"]
