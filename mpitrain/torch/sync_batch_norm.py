"""``hvd.SyncBatchNorm``: batch normalisation whose batch statistics span every rank.

In training mode each rank reduces its input to per-channel statistics: its element
count ``n``, mean ``m`` and sum of squared deviations ``m2`` (in float64, so one
rank's large mean does not swamp the variance). One allgather of the rows
``[n, channels, m..., m2...]`` gives every rank all of them, and each combines them
into the global mean and variance with Chan's pairwise formula (exact for any batch
sizes, zero included). The output is ``(x - mean) / sqrt(var + eps) * weight + bias``,
as torch's ``BatchNorm`` over the concatenated batch; running statistics are updated
as torch does, with the unbiased global variance.

Backward needs two more global sums per channel, ``sum(dy)`` and ``sum(dy * xhat)``:
one allreduce, then ``dx = weight * invstd / N * (N * dy - sum(dy) - xhat * sum(dy *
xhat))``. ``weight.grad``/``bias.grad`` are this rank's share (its own rows), so their
sum over ranks, which ``DistributedOptimizer`` takes, is the gradient over the whole
batch. In eval mode the layer is a plain ``BatchNorm`` over this rank's input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import ArgumentError, MismatchError
from .eager import eager
from .mpi_ops import Sum, allgather_async, allreduce_async, rank, synchronize


def _channel_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (channels, elements per channel)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _local_statistics(x: torch.Tensor) -> torch.Tensor:
    """This rank's row ``[n, channels, mean..., m2...]`` in float64 on the CPU; a
    0-d or 1-d input gives ``[0, -1]``, which every rank then refuses."""
    if x.dim() < 2:
        return torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    rows = _channel_rows(x.detach()).to(torch.float64)
    count = rows.shape[1]
    mean = rows.mean(dim=1) if count else torch.zeros(rows.shape[0], dtype=torch.float64)
    m2 = ((rows - mean[:, None]) ** 2).sum(dim=1)
    head = torch.tensor([float(count), float(x.shape[1])], dtype=torch.float64)
    return torch.cat([head, mean.cpu(), m2.cpu()])[None, :]


def _combine(rows: torch.Tensor, channels: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The global count, mean and sum of squared deviations from every rank's row.

    Raises:
        ArgumentError: on every rank alike, when a rank's input had the wrong number of
            channels or dimensions, or the ranks hold fewer than 2 values per channel.
    """
    for r, row in enumerate(rows):
        if int(row[1]) != channels:
            got = "fewer than 2 dimensions" if row[1] < 0 else f"{int(row[1])} channels"
            raise ArgumentError(f"rank {rank()}: SyncBatchNorm expects input (N, {channels}, "
                                f"...) on every rank, but rank {r}'s input has {got}; fix "
                                "that rank's input or num_features")
    counts = rows[:, 0]
    means, m2s = rows[:, 2:2 + channels], rows[:, 2 + channels:]
    total = int(counts.sum())
    if total < 2:
        raise ArgumentError(f"rank {rank()}: SyncBatchNorm in training needs more than 1 value "
                            f"per channel over all ranks, got {total}; use larger batches or "
                            "eval mode")
    mean = (counts[:, None] * means).sum(dim=0) / total
    m2 = (m2s + counts[:, None] * (means - mean) ** 2).sum(dim=0)
    return total, mean, m2


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise with the statistics of every rank's batch; backward allreduces the
    per-channel sums that the input gradient needs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, module: SyncBatchNorm,
                factor: float) -> torch.Tensor:
        channels = module.num_features
        try:
            rows = synchronize(allgather_async(_local_statistics(x)))
        except MismatchError as exc:  # rows of another width: another channel count
            raise ArgumentError(f"rank {rank()}: SyncBatchNorm expects input (N, {channels}, "
                                f"...) on every rank, but the ranks' inputs disagree ({exc}); "
                                "fix the inputs or num_features") from None
        total, mean, m2 = _combine(rows, channels)
        if module.training and module.running_mean is not None:
            running_mean, running_var = module.running_mean, module.running_var
            assert running_var is not None
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean), alpha=factor)
                running_var.mul_(1 - factor).add_((m2 / (total - 1)).to(running_var),
                                                  alpha=factor)
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        shape = [1, channels] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(m2 / total + module.eps)
        xhat = (x.to(compute) - mean.to(x.device, compute).view(shape)) \
            * invstd.to(x.device, compute).view(shape)
        scale = torch.ones(channels, dtype=compute, device=x.device) if weight is None \
            else weight.to(compute)
        out = xhat * scale.view(shape)
        if bias is not None:
            out = out + bias.to(compute).view(shape)
        ctx.save_for_backward(xhat, invstd, scale)
        ctx.total = total
        ctx.dtypes = (x.dtype, None if weight is None else weight.dtype,
                      None if bias is None else bias.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        xhat, invstd, scale = ctx.saved_tensors
        dtype, weight_dtype, bias_dtype = ctx.dtypes
        dy = grad.to(xhat.dtype)
        sum_dy = _channel_rows(dy).sum(dim=1)
        sum_dy_xhat = _channel_rows(dy * xhat).sum(dim=1)
        local = torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64).cpu()
        sums = synchronize(allreduce_async(local, op=Sum))
        channels = scale.shape[0]
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        total_dy = sums[:channels].to(xhat.device, xhat.dtype).view(shape)
        total_dy_xhat = sums[channels:].to(xhat.device, xhat.dtype).view(shape)
        factor = (scale * invstd.to(xhat.device, xhat.dtype) / ctx.total).view(shape)
        dx = factor * (ctx.total * dy - total_dy - xhat * total_dy_xhat)
        grad_weight = None if weight_dtype is None else sum_dy_xhat.to(weight_dtype)
        grad_bias = None if bias_dtype is None else sum_dy.to(bias_dtype)
        return dx.to(dtype), grad_weight, grad_bias, None, None


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``SyncBatchNorm``: batch normalisation over every rank's batch.

    A drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (input ``(N, C)``, ``(N, C, L)``,
    ``(N, C, H, W)``, ...): in training mode the mean and variance are those of all
    ranks' inputs together (batch sizes may differ by rank, zero included), and the
    running statistics are updated with them as ``BatchNorm`` would over the
    concatenated batch. Every rank must run the layer's forward and backward in the
    same order. ``weight.grad``/``bias.grad`` hold this rank's share; their sum over
    ranks is the whole batch's gradient. In eval mode it is a plain ``BatchNorm``.

    Args:
        num_features: the channel count ``C``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new statistics in the running ones; ``None`` for a
            cumulative average.
        affine: learn a per-channel ``weight`` and ``bias``.
        track_running_stats: keep running statistics (else eval mode uses the batch's).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ArgumentError(f"SyncBatchNorm expects an input of 2 or more dimensions "
                                f"(N, {self.num_features}, ...), got {input.dim()}")

    def _momentum_factor(self) -> float:
        """The weight of this batch in the running statistics (torch's rule)."""
        if not (self.training and self.track_running_stats):
            return 0.0
        tracked = self.num_batches_tracked
        assert tracked is not None
        tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(tracked)
        return float(self.momentum)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with the statistics of every rank's batch (training) or
        with the running statistics (eval)."""
        if not self.training:
            self._check_input_dim(input)
            use_batch = self.running_mean is None
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch, 0.0, self.eps)
        return self._synchronized(input)

    @eager  # torch.compile breaks its graph here: the layer communicates (.eager)
    def _synchronized(self, input: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self, self._momentum_factor())
        return output

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Return ``module`` with every ``BatchNorm*`` layer replaced by a
        :class:`SyncBatchNorm` holding the same parameters and running statistics."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child))
        return converted


__all__ = ["SyncBatchNorm"]
