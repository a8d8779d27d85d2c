"""Horovod's ``horovod.torch`` API over mpitrain: ``import mpitrain.torch as hvd``.

A Horovod training script runs after changing its import line::

    import mpitrain.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Differences from Horovod (docs/horovod-notes.md has the details): the optimizer
wrapper is a ``torch.optim.Optimizer`` that holds the user's optimizer (not a subclass
of its class), Adasum runs on CPU tensors only (see docs/adasum.md), and ``join`` is for the
synchronous case (every rank has finished its collectives). Process sets
(``hvd.ProcessSet``, ``hvd.add_process_set``, ``process_set=``) run collectives over a
subset of the ranks on a communicator of their own (:mod:`.process_sets`).

Importing it also registers the ``torch.distributed`` backend ``"mpitrain"``
(:mod:`.distributed`): ``dist.init_process_group("mpitrain")`` under ``mpirun`` gives DDP,
FSDP and every ``torch.distributed`` collective mpitrain's collectives.
"""

from __future__ import annotations

from ..parallel.compression import Compression, Compressor
from . import distributed, elastic
from .checkpoint import load_checkpoint, load_latest_checkpoint, save_checkpoint
from .mpi_ops import *  # noqa: F403  (the names of mpi_ops.__all__)
from .mpi_ops import __all__ as _ops_names
from .optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from .sync_batch_norm import SyncBatchNorm

distributed.register()

__all__ = [
    *_ops_names, "Compression", "Compressor", "DistributedOptimizer", "broadcast_optimizer_state",
    "elastic",
    "broadcast_parameters", "load_checkpoint", "load_latest_checkpoint", "save_checkpoint",
    "SyncBatchNorm",
]
