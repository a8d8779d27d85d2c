"""The numpy/cupy DistributedOptimizer: wraps any optimizer of the trainer protocol.

See :mod:`mpitrain.trainer.optimizers` for the protocol and
:mod:`mpitrain.parallel.reducer` for how gradients are averaged.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..backends import NUMPY
from ..communicator import Communicator
from ..errors import UnsupportedError
from ..ops import ReduceOp, parse_op
from ..parallel.compression import Compression
from ..parallel.reducer import DistributedOptimizerBase, GradientReducer, Reduction, Submitted


class ArrayBridge:
    """Gradients are arrays in ``param.grad`` (numpy or cupy), reduced as they are."""

    def start(self, reduction: Reduction, name: str, params: Sequence[Any]) -> Submitted:
        """Allreduce each ``param.grad`` (created as zeros of ``param.data``'s shape when
        missing; device arrays are produced on the current stream)."""
        for p in params:
            if p.grad is None:
                p.grad = np.zeros_like(p.data)  # cupy arrays: cupy zeros (__array_function__)
        return reduction.allreduce(name, list(params), [p.grad for p in params],
                                   view=lambda value: value, stream=lambda value: None)

    def nbytes(self, param: Any) -> int:
        """``param.data``'s size in bytes (its gradient's)."""
        return int(param.data.nbytes)

    def store(self, param: Any, value: Any) -> None:
        """Copy ``value`` into ``param.grad`` (keeping the array, converting to its dtype)
        unless it is that array."""
        grad = param.grad
        if value is grad:
            return
        if isinstance(grad, np.ndarray) and value.dtype != grad.dtype:
            NUMPY.cast_into(grad, value)  # float16/bfloat16 in the compiled converter
        else:
            grad[...] = value


class DistributedOptimizer(DistributedOptimizerBase):
    """Average gradients over ranks before each ``step()`` of the wrapped optimizer.

    Args:
        optimizer: an optimizer of the trainer protocol (``.params`` with
            ``.data``/``.grad``, ``step()``, ``zero_grad()``), e.g. :class:`SGD`.
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
        backward_passes_per_step: backward passes accumulated into ``.grad`` locally
            before one allreduce.
        op: ``mt.Average`` (default), ``mt.Sum``, ... (``Adasum`` raises
            :class:`~mpitrain.UnsupportedError`: only ``mpitrain.torch`` has the Adasum
            optimizer).
        gradient_predivide_factor: Horovod's split of the averaging (``op=Average`` only).
        groups: ``None``, a group count, or lists of parameters allreduced together.
        comm: the communicator (default: that of :func:`mpitrain.init`).

    Call :meth:`grad_ready` with each parameter as soon as its gradient is computed
    (last layer first) to overlap the allreduces with the rest of the backward pass;
    ``step()`` starts whatever was not started and waits for all of them. Where the
    async engine's thread has no core of its own, final gradients wait until 8 MiB of
    them are ready (``optimizer.reducer.batch_bytes``, ``MPITRAIN_GRAD_BATCH_BYTES``).
    """

    def __init__(self, optimizer: Any, compression: Any = Compression.none,
                 backward_passes_per_step: int = 1, op: Any = ReduceOp.AVERAGE,
                 gradient_predivide_factor: float = 1.0, groups: Any = None,
                 comm: Communicator | None = None) -> None:
        if parse_op(op) is ReduceOp.ADASUM:
            raise UnsupportedError("trainer.DistributedOptimizer does not support op=Adasum; "
                                   "use mpitrain.torch.DistributedOptimizer(op=hvd.Adasum), "
                                   "or op=Average")
        self.optimizer = optimizer
        named = [(getattr(p, "name", None) or f"param.{i}", p)
                 for i, p in enumerate(optimizer.params)]
        self.reducer = GradientReducer(
            named, ArrayBridge(), comm=comm, compression=compression, op=op,
            backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=gradient_predivide_factor, groups=groups,
            host=all(isinstance(p.data, np.ndarray) for p in optimizer.params))

    @property
    def params(self) -> list[Any]:
        """The wrapped optimizer's parameters."""
        return list(self.optimizer.params)

    def grad_ready(self, param: Any) -> None:
        """Tell the optimizer ``param.grad`` is computed for this backward pass.

        On the ``backward_passes_per_step``-th call since the last step the gradient's
        allreduce starts at once, in the background.
        """
        self.reducer.grad_ready(param)

    def step(self) -> Any:
        """Average the gradients (unless in :meth:`skip_synchronize`), then step."""
        self._before_step()
        return self.optimizer.step()

    def zero_grad(self) -> None:
        """The wrapped optimizer's ``zero_grad()``; refused while allreduces are pending."""
        self._check_zero_grad()
        self.optimizer.zero_grad()
