"""The ``torch-mpi`` baseline: a torch.distributed backend written in Python that hands
every call straight to MPI's own collective (mpi4py on host tensors, no checks, no
engine, nothing in flight).

Official torch wheels have no MPI backend, so this is the least any backend written in
Python can cost: torch's dispatch of a collective to a Python process group, the
tensor-to-buffer views, and the MPI call. The collectives benchmark runs it beside
``torch-mpitrain`` (mpitrain's backend through the same torch.distributed calls) and
``mpi`` (the same MPI call from mpi4py directly): ``mpi`` over ``torch-mpi`` is what
torch's dispatch costs, ``torch-mpi`` over ``torch-mpitrain`` what mpitrain's backend
costs beyond it. It supports what the benchmark calls (``all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``, ``barrier``) on
contiguous CPU tensors of the dtypes MPI reduces (not float16, not bfloat16).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from mpitrain.torch.distributed import group_communicator

BACKEND = "pympi"
"""The backend's name in torch (``"mpi"`` is torch's own, absent from its wheels)."""
_OPS = ((dist.ReduceOp.SUM, MPI.SUM), (dist.ReduceOp.PRODUCT, MPI.PROD),
        (dist.ReduceOp.MIN, MPI.MIN), (dist.ReduceOp.MAX, MPI.MAX))
"""torch's reductions and MPI's (torch's options hold a ``ReduceOp`` that compares equal
to these but does not hash like them)."""


def _buffer(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """The numpy view of a contiguous CPU tensor."""
    if t.dtype in (torch.float16, torch.bfloat16) or not t.is_contiguous():
        raise TypeError(f"the {BACKEND} baseline takes contiguous tensors of a dtype MPI "
                        f"reduces, got {t.dtype}")
    return t.detach().numpy()


def _op(opts: Any) -> Any:
    """MPI's reduction for torch's (``SUM``, ``PRODUCT``, ``MIN``, ``MAX``)."""
    op = next((mpi for theirs, mpi in _OPS if opts.reduceOp == theirs), None)
    if op is None:
        raise ValueError(f"the {BACKEND} baseline reduces with SUM, PRODUCT, MIN or MAX, "
                         f"not {opts.reduceOp}")
    return op


class Done(dist.Work):
    """A call that completed before it returned (MPI's calls block)."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout: Any = None) -> bool:
        """Nothing to wait for."""
        return True

    def is_completed(self) -> bool:
        """Always."""
        return True

    def result(self) -> list[torch.Tensor]:
        """The output tensors."""
        return self._outputs

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A completed future of the outputs."""
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(self._outputs)
        return future


class ProcessGroupMpi(dist.ProcessGroup):
    """MPI's own collectives behind torch.distributed's calls, on a Dup of ``comm``."""

    def __init__(self, comm: MPI.Intracomm, owned: bool = False) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self.comm = comm.Dup()
        self._owned: MPI.Intracomm | None = comm if owned else None

    def shutdown(self) -> None:
        """Free the duplicate, and the group's own communicator (``destroy_process_group``)."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        if self._owned is not None:
            self._owned.Free()
            self._owned = None

    def getBackendName(self) -> str:
        """``"pympi"``."""
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Done:
        """``MPI_Allreduce`` in place on each tensor."""
        op = _op(opts)
        for t in tensors:
            self.comm.Allreduce(MPI.IN_PLACE, _buffer(t), op=op)
        return Done(tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Done:
        """``MPI_Allgather`` of ``input`` into ``output``."""
        self.comm.Allgather(_buffer(input), _buffer(output))
        return Done([output])

    _allgather_base = all_gather_single  # (torch < 2.12)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Done:
        """``MPI_Reduce_scatter_block`` of ``input`` into ``output``."""
        self.comm.Reduce_scatter_block(_buffer(input), _buffer(output), op=_op(opts))
        return Done([output])

    _reduce_scatter_base = reduce_scatter_single  # (torch < 2.12)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Done:
        """``MPI_Bcast`` of each tensor from ``opts.rootRank``."""
        for t in tensors:
            self.comm.Bcast(_buffer(t), root=opts.rootRank)
        return Done(tensors)

    def barrier(self, opts: Any = None) -> Done:
        """``MPI_Barrier``."""
        self.comm.Barrier()
        return Done([])


def _create(options: Any, backend_options: Any = None) -> ProcessGroupMpi:
    """torch's creator of the backend: a group over the communicator that mpitrain's
    backend would use."""
    return ProcessGroupMpi(*group_communicator(options))


def register() -> None:
    """Register the backend with torch (once per process)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def tensor(arr: np.ndarray[Any, Any]) -> torch.Tensor | None:
    """A tensor sharing ``arr``'s memory, or ``None`` for the dtypes this baseline does not
    take (16-bit floats)."""
    if arr.dtype.itemsize == 2 and arr.dtype.kind not in "iu":
        return None
    return torch.from_numpy(arr)
