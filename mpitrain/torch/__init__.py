"""Horovod's ``horovod.torch`` API over mpitrain: ``import mpitrain.torch as hvd``.

A Horovod training script runs after changing its import line::

    import mpitrain.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Differences from Horovod: the optimizer wrapper is a plain wrapper object (not a
subclass of the wrapped optimizer's class), Adasum runs on CPU tensors only (see
docs/adasum.md), process sets are not supported, and ``join`` is for the
synchronous case (every rank has finished its collectives).
"""

from __future__ import annotations

from ..trainer.compression import Compression, Compressor
from .checkpoint import load_checkpoint, load_latest_checkpoint, save_checkpoint
from .mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    cross_rank,
    cross_size,
    gloo_built,
    gloo_enabled,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    shutdown,
    size,
    synchronize,
)
from .optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "Max", "Min",
    "Product", "Sum", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "cross_rank", "cross_size",
    "gloo_built", "gloo_enabled", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "init", "is_initialized", "join",
    "load_checkpoint", "load_latest_checkpoint", "local_rank", "local_size", "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "save_checkpoint", "shutdown", "size", "synchronize",
]
