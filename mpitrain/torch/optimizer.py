"""``hvd.DistributedOptimizer``: averages gradients while backward is still running.

A wrapper *holding* the user's optimizer (composition, not Horovod's dynamic
subclass of the wrapped optimizer's class): ``step()``, ``zero_grad()``,
``param_groups``, ``state``, ``defaults``, ``state_dict()``, ``load_state_dict()`` and
every other attribute reach the wrapped optimizer. The wrapper is itself a
``torch.optim.Optimizer`` (whose ``__init__`` it does not run: it has no parameters of
its own), so LR schedulers and ``torch.amp.GradScaler`` accept it; they read and write
the wrapped optimizer's ``param_groups``, so a schedule changes the learning rate that
the wrapped optimizer uses.

Each parameter gets a ``register_post_accumulate_grad_hook``: when autograd has
accumulated its gradient, the hook tells the :class:`~mpitrain.parallel.reducer.GradientReducer`,
which starts the in-place allreduce of ``p.grad`` at once (after
``backward_passes_per_step`` passes), while backward goes on with earlier layers.
``step()`` waits for all of them. Where that overlap cannot pay (CPU tensors on one
node, no core to spare beyond ``torch.get_num_threads()``: see
:func:`~mpitrain.parallel.reducer.grad_batch_bytes`, ``MPITRAIN_GRAD_BATCH_BYTES``),
final gradients wait until 8 MiB of them are ready and start together. With
``op=Adasum`` the hook steps the parameter's group locally
instead and starts the Adasum of its change (:class:`AdasumBridge`).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import torch

from ..errors import ArgumentError, UnsupportedError
from ..ops import ReduceOp, parse_op
from ..parallel.broadcast import broadcast_arrays, broadcast_tree
from ..parallel.compression import Compression
from ..parallel.reducer import DistributedOptimizerBase, GradientReducer, Reduction, Submitted
from .checkpoint import TENSORS
from .eager import eager
from .process_sets import ProcessSet, communicator, global_process_set, set_rank
from .sparse import prepare_sparse_allreduce, start_sparse_allreduce
from .tensors import as_buffer, host_copy, producer_stream, to_device_of


class TensorBridge:
    """Gradients are ``p.grad`` tensors: dense ones are allreduced (sparse ones densified
    first with ``sparse_as_dense``), sparse ones allgathered as in Horovod
    (:func:`~mpitrain.torch.sparse.start_sparse_allreduce`). ``sparse_only``: the
    optimizer takes sparse gradients only (``SparseAdam``)."""

    def __init__(self, sparse_as_dense: bool, sparse_only: bool = False) -> None:
        self.sparse_as_dense = sparse_as_dense
        self.sparse_only = sparse_only

    def start(self, reduction: Reduction, name: str, params: Sequence[torch.Tensor]) -> Submitted:
        """Start the reduction of the gradients of ``params``."""
        grads = [self.grad(p) for p in params]
        if not any(g.is_sparse for g in grads):
            return reduction.allreduce(name, list(params), grads, as_buffer, producer_stream)
        if len(params) > 1:
            raise ArgumentError("sparse gradients cannot be in a group; pass "
                                "sparse_as_dense=True or leave them out of groups")
        if reduction.op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise ArgumentError(f"sparse gradients support op=Sum/Average, not "
                                f"{reduction.op!r}; pass sparse_as_dense=True for other ops")
        prepared = prepare_sparse_allreduce(grads[0], reduction.op, reduction.comm.rank)
        handles, finish = start_sparse_allreduce(reduction.comm, prepared, name)
        return Submitted(list(params), handles, lambda: [finish()])

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        """``p.grad`` (zeros if missing), as a dense contiguous tensor where required."""
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        g = param.grad
        if g.is_sparse:
            return g.to_dense() if self.sparse_as_dense else g
        return g if g.is_contiguous() else g.contiguous()

    def nbytes(self, param: torch.Tensor) -> int:
        """``param``'s size in bytes (its gradient's)."""
        return param.numel() * param.element_size()

    def store(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Store the averaged gradient in ``p.grad``, as ``p``'s dtype (in place when
        layouts agree: one converting copy). A sparse gradient reduced as dense
        (``sparse_as_dense``) is stored dense, for dense optimizers such as Adam, unless
        the optimizer takes sparse gradients only: then it is made sparse again (as
        Horovod does for every optimizer)."""
        g = param.grad
        if value is g:
            return
        if self.sparse_only and g is not None and g.is_sparse and not value.is_sparse:
            value = value.to_sparse()
        if g is None or g.is_sparse or value.is_sparse:
            param.grad = value if value.dtype == param.dtype else value.to(param.dtype)
        else:
            g.copy_(value)


class AdasumBridge:
    """Horovod's Adasum optimizer: when a group's gradients are final, the wrapped
    optimizer steps those parameters only, on this rank; what the step changed (the
    delta) is what the ranks combine with Adasum. Not averaged, not scaled by the rank
    count: Adasum itself weighs the ranks' steps. Storing the combined delta sets the
    parameter to its value before the step plus that delta."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.starts: dict[int, torch.Tensor] = {}

    def start(self, reduction: Reduction, name: str, params: Sequence[torch.Tensor]) -> Submitted:
        """Step ``params`` locally, leave their deltas in them, start the Adasum."""
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise ArgumentError("op=Adasum needs dense gradients; pass sparse_as_dense=True")
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            for p in params:
                self.starts[id(p)] = p.detach().clone()
            self._step_only(params)
            for p in params:
                p.sub_(self.starts[id(p)])
        # mpitrain reduces Adasum on the host: a device delta goes as a host copy
        return reduction.allreduce(name, list(params), [host_copy(p.detach()) for p in params],
                                   as_buffer, producer_stream)

    def nbytes(self, param: torch.Tensor) -> int:
        """``param``'s size in bytes (its delta's)."""
        return param.numel() * param.element_size()

    def store(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """``param = start + value`` (``value`` may be a host copy of a device delta)."""
        start = self.starts.pop(id(param))
        with torch.no_grad():
            param.copy_(start.add_(to_device_of(start, value)))

    def _step_only(self, params: Sequence[torch.Tensor]) -> None:
        """``optimizer.step()`` on ``params`` alone (the other parameters are hidden)."""
        keep = {id(p) for p in params}
        groups = self.optimizer.param_groups
        stashed = [g["params"] for g in groups]
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
        try:
            self.optimizer.step()
        finally:
            for g, ps in zip(groups, stashed):
                g["params"] = ps


class DistributedOptimizer(DistributedOptimizerBase, torch.optim.Optimizer):
    """Horovod's ``DistributedOptimizer``: average gradients over ranks before ``step()``.

    Args:
        optimizer: any ``torch.optim`` optimizer (or one with ``param_groups``).
        named_parameters: ``model.named_parameters()``; names the allreduces (else
            ``allreduce.noname.<group>.<index>``). Every optimized parameter must be named.
        compression: ``Compression.none``, ``.fp16`` or ``.bf16``.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: ``Average`` (default), ``Sum`` or ``Adasum``. With ``Adasum`` over several
            ranks, as in Horovod, each rank steps its optimizer on its own gradients
            and the ranks combine the parameters' changes with Adasum (no averaging,
            no scaling by the rank count); ``synchronize()`` then does nothing and
            ``skip_synchronize()`` raises.
        gradient_predivide_factor: ``1/f`` before the sum, ``f/size`` after it.
        groups: ``None``, a group count, or lists of parameters allreduced together.
        sparse_as_dense: allreduce sparse gradients as dense tensors (else they are
            allgathered, as in Horovod).
        process_set: the ranks that average together (default: every rank). On a rank
            outside the set, as in Horovod, the optimizer is the wrapped one: nothing is
            reduced there and ``step()`` steps on the local gradients.
    """

    def __init__(self, optimizer: Any, named_parameters: Iterable[Any] | None = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 op: Any = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                 groups: Any = None, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set) -> None:
        self.optimizer = optimizer
        self._process_set = process_set
        # the names are checked first: a bad list is an error before (and without) init
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(p, tuple) or len(p) != 2 for p in named):
                raise ArgumentError("named_parameters should be a sequence of tuples (name, "
                                    "parameter), usually produced by model.named_parameters()")
            self._named: list[tuple[str, torch.Tensor]] | None = named
        else:
            self._named = None
        self._names()
        self._bystander = isinstance(process_set, ProcessSet) and process_set.included() is False
        comm = communicator(global_process_set if self._bystander else process_set)
        self._options = dict(compression=compression,
                             backward_passes_per_step=backward_passes_per_step, op=op,
                             gradient_predivide_factor=gradient_predivide_factor,
                             groups=None if self._bystander else groups)
        self._adasum = parse_op(op) is ReduceOp.ADASUM and comm.size > 1 and not self._bystander
        self._bridge: TensorBridge | AdasumBridge = \
            AdasumBridge(optimizer) if self._adasum else \
            TensorBridge(sparse_as_dense, isinstance(optimizer, torch.optim.SparseAdam))
        self._hooked: set[int] = set()
        self._build()

    def rebind(self) -> None:
        """Rebuild the gradient reducer over the optimizer's process set's communicator as
        it is now (an elastic reset replaces the global set's); allreduces in flight on the
        old one are dropped."""
        self._build()

    def _names(self) -> dict[int, str]:
        """The allreduce name of each optimized parameter (by ``id``): its name in
        ``named_parameters``, else ``allreduce.noname.<group>.<index>``.

        Raises:
            ArgumentError: a name or a parameter appears twice in ``named_parameters``,
                or an optimized parameter is not in it.
        """
        groups = self.optimizer.param_groups
        if self._named is None:
            return {id(p): f"allreduce.noname.{i}.{j}"
                    for i, group in enumerate(groups) for j, p in enumerate(group["params"])}
        names: dict[int, str] = {}
        seen: set[str] = set()
        for name, p in self._named:
            if id(p) in names or name in seen:
                raise ArgumentError(f"Parameter names in named_parameters must be unique; "
                                    f"found a duplicate: {name}")
            names[id(p)] = name
            seen.add(name)
        unnamed = sum(1 for group in groups for p in group["params"] if id(p) not in names)
        if unnamed:
            raise ArgumentError(f"named_parameters was specified, but {unnamed} optimized "
                                "parameter(s) are not named; pass model.named_parameters() of "
                                "the whole model")
        return names

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Each optimized parameter's allreduce name (Horovod's attribute)."""
        names = self._names()
        return {p: names[id(p)] for group in self.optimizer.param_groups
                for p in group["params"]}

    def _build(self) -> None:
        """(Re)build the reducer over the optimizer's parameters and hook new ones (none
        on a rank outside the process set: its reducer has nothing to reduce)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        names = self._names()
        updated = [] if self._bystander else [(names[id(p)], p) for p in params
                                              if p.requires_grad]
        # the global set's communicator changes in a reset
        comm = communicator(global_process_set if self._bystander else self._process_set)
        host = all(p.device.type == "cpu" for _, p in updated)
        threads = torch.get_num_threads()
        self.reducer = GradientReducer(updated, self._bridge, comm=comm, host=host,
                                       compute_threads=threads, **self._options)
        # A compiled step() breaks its graph at the averaging and runs it eagerly (.eager)
        self.reducer.synchronize = eager(self.reducer.synchronize)  # type: ignore[method-assign]
        me = weakref.ref(self)
        for _, p in updated:
            if id(p) not in self._hooked:
                p.register_post_accumulate_grad_hook(_hook(me))
                self._hooked.add(id(p))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (the same list)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state``."""
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer and hook its parameters."""
        if self.reducer.accumulating:
            raise ArgumentError("add_param_group() between backward() and step(); call it "
                                "after step()")
        self.optimizer.add_param_group(group)
        self._build()

    def step(self, closure: Any = None) -> Any:
        """Wait for the averaged gradients (unless in ``skip_synchronize()``), then step.

        With Adasum: step the parameters not stepped yet, wait for the combined deltas
        and apply them (``closure`` is called first)."""
        if self._adasum:
            loss = closure() if closure is not None else None
            self.reducer.synchronize()
            return loss
        self._before_step()
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    @eager
    def synchronize(self) -> None:
        """Wait for every gradient allreduce and store the averaged gradients (with
        Adasum: nothing, as in Horovod; ``step()`` does it all)."""
        if not self._adasum:
            super().synchronize()

    def skip_synchronize(self) -> Any:
        """See :meth:`DistributedOptimizerBase.skip_synchronize`; refused with Adasum."""
        if self._adasum:
            raise UnsupportedError("skip_synchronize() is not supported with op=Adasum (as in "
                                   "Horovod): the optimizer steps inside step(); drop it")
        return super().skip_synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; refused while allreduces are pending."""
        self._check_zero_grad()
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _hook(owner: weakref.ref[DistributedOptimizer]) -> Any:
    def hook(param: torch.Tensor) -> None:
        optimizer = owner()
        if optimizer is not None:  # an optimizer that was dropped leaves its hooks idle
            optimizer.reducer.grad_ready(param)
    return hook


@eager
def broadcast_parameters(params: Any, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite parameters (or any tensors) with the root's, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()``, or a list of
            tensors or ``(name, tensor)`` pairs.
        root_rank: the rank whose values every rank receives (a global rank, a member
            of ``process_set``).
        process_set: the ranks that receive (default: every rank).
    """
    comm = communicator(process_set)
    root = set_rank(process_set, root_rank, "broadcast_parameters")
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ArgumentError(f"invalid params of type: {type(params).__name__}; pass "
                            "model.state_dict() or model.named_parameters()")
    named = []
    for i, (name, tensor) in enumerate(items):
        if not isinstance(tensor, torch.Tensor):
            raise ArgumentError(f"broadcast_parameters: {name or i!r} is a "
                                f"{type(tensor).__name__}, not a tensor")
        named.append((f"param.{name if name is not None else i}", as_buffer(tensor)))
    broadcast_arrays(named, root=root, comm=comm)


@eager
def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank the root's optimizer state and hyper-parameters.

    Works for any optimizer with ``state_dict()``/``load_state_dict()``, also when the
    other ranks' state is still empty (state created lazily on the first step): the
    parameters are not stepped. Where this rank's state is empty, parameters that
    require a gradient and have none get a zero gradient, as after Horovod's call;
    parameters that need no gradient keep ``grad=None``. ``root_rank`` is a global
    rank, a member of ``process_set`` (default: every rank).
    """
    comm = communicator(process_set)
    root = set_rank(process_set, root_rank, "broadcast_optimizer_state")
    if not optimizer.state:  # as Horovod, whose state initialisation leaves zero gradients
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    state = broadcast_tree(optimizer.state_dict(), root=root, comm=comm, kind=TENSORS,
                           name="optimizer")
    if comm.rank != root:
        optimizer.load_state_dict(state)
