"""The optimizer protocol of the numpy trainer, and SGD and Adam implementing it.

The protocol is small, so any optimizer can be wrapped by
:class:`~mpitrain.trainer.DistributedOptimizer`:

* ``optimizer.params``: a list of parameters; a parameter has ``.data`` (an array)
  and ``.grad`` (an array of the same shape, or ``None`` before the first backward);
  an optional ``.name`` (unique) names its allreduce;
* ``optimizer.step()``: update every ``.data`` from its ``.grad``;
* ``optimizer.zero_grad()``: reset the gradients;
* ``optimizer.state_dict()`` / ``optimizer.load_state_dict(state)``: a nested dict of
  arrays and plain values (for :func:`~mpitrain.trainer.broadcast_optimizer_state`
  and :mod:`mpitrain.checkpoint`).

Arrays may be numpy or cupy: the updates below use only array arithmetic (and
``np.zeros_like``, which cupy arrays answer with cupy arrays).
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import ArgumentError


@runtime_checkable
class GradParameter(Protocol):
    """What the trainer needs from a parameter."""

    data: Any
    grad: Any


@runtime_checkable
class Optimizer(Protocol):
    """What :class:`~mpitrain.trainer.DistributedOptimizer` needs from an optimizer."""

    params: Sequence[Any]

    def step(self) -> Any:
        """Apply one update from the gradients."""

    def zero_grad(self) -> None:
        """Reset the gradients."""

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state as a nested dict of arrays and plain values."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""


class Parameter:
    """A trainable array and its gradient.

    Args:
        data: the array (numpy or cupy); updated in place by the optimizers.
        name: unique name; names the parameter's allreduce and checkpoint entry.
    """

    def __init__(self, data: Any, name: str | None = None) -> None:
        self.data = data
        self.grad: Any = None
        self.name = name

    def __repr__(self) -> str:
        return f"Parameter({self.name or '?'}, shape={tuple(self.data.shape)}, " \
               f"dtype={self.data.dtype})"


class _BaseOptimizer:
    """State handling shared by :class:`SGD` and :class:`Adam`."""

    slots: tuple[str, ...] = ()  # per-parameter state arrays

    def __init__(self, params: Iterable[Any], **hyper: float) -> None:
        self.params = list(params)
        if not self.params:
            raise ArgumentError(f"{type(self).__name__} got an empty parameter list")
        for name, value in hyper.items():
            if value < 0:
                raise ArgumentError(f"{type(self).__name__}: {name}={value} must be >= 0")
        self.hyper = dict(hyper)
        self.steps = 0
        self.state = [{slot: np.zeros_like(p.data) for slot in self.slots} for p in self.params]

    def zero_grad(self) -> None:
        """Set every gradient to zero (keeping the arrays, so views stay valid)."""
        for p in self.params:
            if p.grad is not None:
                p.grad[...] = 0

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters, step count and per-parameter state (the arrays themselves)."""
        return {"hyper": dict(self.hyper), "steps": self.steps,
                "state": [dict(s) for s in self.state]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy ``state`` (from :meth:`state_dict`) into this optimizer."""
        slots = state["state"]
        if len(slots) != len(self.params):
            raise ArgumentError(f"{type(self).__name__}.load_state_dict: the state has "
                                f"{len(slots)} parameters, this optimizer {len(self.params)}")
        self.hyper.update(state["hyper"])
        self.steps = int(state["steps"])
        for mine, theirs, p in zip(self.state, slots, self.params):
            for slot in self.slots:
                if tuple(theirs[slot].shape) != tuple(p.data.shape):
                    raise ArgumentError(
                        f"{type(self).__name__}.load_state_dict: {slot} of {p!r} has shape "
                        f"{tuple(theirs[slot].shape)}, want {tuple(p.data.shape)}")
                mine[slot][...] = theirs[slot]

    def _gradients(self) -> Iterable[tuple[Any, Any, dict[str, Any]]]:
        """(parameter, gradient with weight decay, state) for parameters with gradients."""
        decay = self.hyper.get("weight_decay", 0.0)
        for p, slots in zip(self.params, self.state):
            if p.grad is None:
                continue
            yield p, (p.grad + decay * p.data if decay else p.grad), slots


class SGD(_BaseOptimizer):
    """Stochastic gradient descent with optional momentum (PyTorch's update rule).

    ``buf = momentum * buf + g`` (``buf`` starts at zero), then
    ``p -= lr * (g + momentum * buf if nesterov else buf)``.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        self.slots = ("momentum_buffer",) if momentum else ()
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.nesterov = nesterov
        if nesterov and not momentum:
            raise ArgumentError("SGD: nesterov=True needs momentum > 0")

    def step(self) -> None:
        """Update every parameter that has a gradient."""
        lr, momentum = self.hyper["lr"], self.hyper["momentum"]
        for p, g, slots in self._gradients():
            if momentum:
                buf = slots["momentum_buffer"]  # starts at zero, so step 1 gives buf = g
                buf *= momentum
                buf += g
                g = g + momentum * buf if self.nesterov else buf
            p.data -= lr * g
        self.steps += 1


class Adam(_BaseOptimizer):
    """Adam (Kingma & Ba) with PyTorch's bias correction and epsilon placement."""

    slots = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                         weight_decay=weight_decay)

    def step(self) -> None:
        """Update every parameter that has a gradient."""
        lr, b1, b2, eps = (self.hyper[k] for k in ("lr", "beta1", "beta2", "eps"))
        self.steps += 1
        correction1 = 1 - b1 ** self.steps
        correction2_sqrt = (1 - b2 ** self.steps) ** 0.5
        for p, g, slots in self._gradients():
            m, v = slots["exp_avg"], slots["exp_avg_sq"]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p.data -= (lr / correction1) * m / (v ** 0.5 / correction2_sqrt + eps)
