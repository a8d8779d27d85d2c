"""torch.distributed's gloo backend, side by side with mpitrain and MPI.

Only used when ``--impl`` names ``gloo`` and torch is installed
(``pip install torch==2.13.0``, the CPU wheel). :func:`init` starts a gloo process
group over the ranks of the MPI job (rank 0 picks a free TCP port and broadcasts it),
:func:`tensor` wraps a numpy buffer without a copy, and :func:`reduce_op` maps the
harness's op names. gloo reduces neither unsigned types wider than 8 bits nor
Min/Max of complex numbers: those columns print ``N/A``.
"""

from __future__ import annotations

import importlib.util
import socket
from typing import Any

import numpy as np
from mpi4py import MPI

from .hooks import Array


def available() -> bool:
    """True if torch (and so torch.distributed) can be imported."""
    return importlib.util.find_spec("torch") is not None


def init(world: MPI.Intracomm) -> Any:
    """Start a gloo process group over ``world``'s ranks (collective); returns the module.

    The group lives until :func:`finish`.
    """
    import torch.distributed as dist

    address = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            address = (socket.gethostname(), s.getsockname()[1])
    host, port = world.bcast(address, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())
    return dist


def finish() -> None:
    """Tear down the process group of :func:`init`."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def tensor(arr: Array) -> Any:
    """A torch tensor sharing ``arr``'s memory, or ``None`` if gloo cannot reduce its dtype."""
    import torch

    if arr.dtype.kind == "u" and arr.dtype.itemsize > 1:
        return None
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def reduce_op(op: str) -> Any:
    """gloo's reduction for the harness's ``op`` (``avg`` reduces as ``sum``)."""
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
