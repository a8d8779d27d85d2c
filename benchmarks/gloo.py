"""torch.distributed in the benchmarks: its gloo backend side by side with mpitrain and
MPI, mpitrain's own backend (``mpitrain.torch.distributed``) reached the way
torch.distributed users reach it, and the :mod:`.torch_mpi` baseline.

Only used when torch is installed (``pip install torch==2.13.0``, the CPU wheel).
:func:`init` starts a gloo process group over the ranks of the MPI job (rank 0 picks a
free TCP port and broadcasts it), :func:`groups` the groups a run needs (gloo's, one of
mpitrain's backend, one of the baseline's), :class:`OnGroup` binds torch.distributed's
calls to one of them, :func:`tensor` wraps a numpy buffer without a copy, and
:func:`reduce_op` maps the harness's op names. gloo reduces no unsigned type wider
than 8 bits (the tensor wrapping takes none), and torch.distributed no product,
minimum or maximum of complex numbers (:func:`reduce_op`): those columns print
``N/A``. The ``torch-mpi`` column's group wraps buffers by its own rule (:func:`wrapper`).
"""

from __future__ import annotations

import functools
import importlib.util
import socket
from typing import Any, Callable

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


def groups(world: MPI.Intracomm, over_gloo: bool, over_mpitrain: bool,
           over_mpi: bool = False) -> dict[str, Any]:
    """The torch.distributed groups a run needs (collective over ``world``): ``gloo``
    (the default group, :func:`init`), ``mpitrain`` (a group of mpitrain's backend) and
    ``pympi`` (a group of the :mod:`.torch_mpi` baseline): each a new group beside the
    default one, or the default group when it is the first."""
    found: dict[str, Any] = {}
    if over_gloo:
        found["gloo"] = init(world).group.WORLD
    wanted = [name for name, on in (("mpitrain", over_mpitrain), ("pympi", over_mpi)) if on]
    if wanted:
        import torch.distributed as dist

        import mpitrain.torch  # noqa: F401  (registers the backend and mpitrain://)

        from . import torch_mpi

        torch_mpi.register()
        for name in wanted:
            if dist.is_initialized():
                found[name] = dist.new_group(backend=name)
            else:
                dist.init_process_group(name, init_method="mpitrain://")
                found[name] = dist.group.WORLD
    return found


class OnGroup:
    """torch.distributed with every function bound to one process group: ``OnGroup(g)
    .all_reduce(t)`` is ``dist.all_reduce(t, group=g)``; a function torch does not have
    raises ``AttributeError``, as the module does. ``tensor(arr)`` wraps a buffer for
    the group's backend (``None`` where it does not take its dtype)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self._wrap = wrapper(dist.get_backend(group))

    def tensor(self, arr: Array) -> Any:
        """A torch tensor sharing ``arr``'s memory for this group's backend, or ``None``."""
        return self._wrap(arr)

    def __getattr__(self, name: str) -> Any:
        return functools.partial(getattr(self._dist, name), group=self.group)


def finish() -> None:
    """Tear down every process group of :func:`init` and :func:`groups`."""
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


def wrapper(backend: str) -> Callable[[Array], Any]:
    """How the columns of a group of ``backend`` wrap their buffers: :func:`tensor`, or
    the :mod:`.torch_mpi` baseline's own rule."""
    if backend == "pympi":
        from . import torch_mpi

        return torch_mpi.tensor
    return tensor


def reduce_op(op: str, dtype: np.dtype[Any]) -> Any:
    """torch.distributed's reduction for the harness's ``op`` (``avg`` reduces as
    ``sum``) on ``dtype``, or ``None`` where torch.distributed refuses it (``PRODUCT``,
    ``MIN`` and ``MAX`` of complex numbers): that column prints ``N/A``."""
    import torch.distributed as dist

    reduction = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
                 "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
                 "max": dist.ReduceOp.MAX}[op]
    if dtype.kind == "c" and not dist.supports_complex(reduction):
        return None
    return reduction
