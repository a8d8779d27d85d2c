"""Framework-neutral data-parallel training on numpy (or cupy) arrays.

Typical loop under ``mpitrain-run -np N python train.py``::

    import mpitrain as mt
    from mpitrain import trainer

    mt.init()
    opt = trainer.DistributedOptimizer(trainer.SGD(model.params, lr=0.1))
    trainer.broadcast_parameters(model.params, root_rank=0)
    trainer.broadcast_optimizer_state(opt, root_rank=0)
    sampler = trainer.DistributedSampler(len(dataset), seed=42)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in batches(dataset, sampler.indices()):
            opt.zero_grad()
            model.backward(batch, on_grad=opt.grad_ready)   # fills p.grad, last layer first
            opt.step()                                      # waits for the averaged gradients
"""

from __future__ import annotations

from ..ops import Adasum
from ..parallel.broadcast import (
    allgather_object,
    broadcast_arrays,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    broadcast_tree,
)
from ..parallel.compression import Compression, Compressor
from ..parallel.reducer import GradientReducer
from .data import DistributedSampler
from .distributed import DistributedOptimizer
from .metrics import Metrics, average_metrics
from .optimizers import SGD, Adam, GradParameter, Optimizer, Parameter

__all__ = [
    "SGD", "Adam", "Adasum", "Compression", "Compressor", "DistributedOptimizer",
    "DistributedSampler", "GradParameter", "GradientReducer", "Metrics", "Optimizer",
    "Parameter", "allgather_object", "average_metrics", "broadcast_arrays",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "broadcast_tree",
]
