"""Horovod's ``horovod.torch`` operations on torch tensors, over mpitrain.

Every collective goes through the async engine of the default communicator
(:func:`mpitrain.init`): operations are matched across ranks by name (unnamed ones
by order of submission), ranks whose calls disagree (shapes, dtypes, ops) get a
:class:`~mpitrain.MismatchError` (a ``RuntimeError``) on every rank, and local misuse
is a ``ValueError``/``TypeError`` raised at once. Tensors reach the comm layer as
zero-copy views (:mod:`.tensors`), so in-place operations write into the tensor's own
memory.

Async calls return an integer handle, as in Horovod: :func:`poll` tests it,
:func:`synchronize` waits and returns the output tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import numpy as np
import torch
from mpi4py import MPI

from .. import session, timeline
from ..communicator import Communicator
from ..errors import ArgumentError, CommunicationError, MismatchError
from ..ops import ReduceOp, parse_op
from ..parallel.compression import Compression
from ..parallel.pending import HandleTable, Pending
from ..parallel.refusal import agreed, refusing
from . import process_sets as _sets
from .eager import eager_functions
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sparse import prepare_sparse_allreduce, sparse_part_names, start_sparse_allreduce
from .tensors import (
    as_buffer,
    device_of,
    from_buffer,
    host_copy,
    host_view,
    producer_stream,
    require_tensor,
    to_device_of,
)

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

HorovodInternalError = CommunicationError
"""What Horovod raises when a collective fails across ranks: mpitrain's
:class:`~mpitrain.CommunicationError` (mismatches, stalls), a ``RuntimeError``."""

_T = TypeVar("_T")

# -- initialisation and identity ----------------------------------------------------
@dataclass
class _Control:
    """The adapter's own duplicate communicator (alltoall, join) and its owner."""

    owner: Communicator
    comm: MPI.Intracomm


_control_comm: _Control | None = None


def init(comm: MPI.Intracomm | Sequence[int] | None = None,
         process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialise mpitrain; idempotent (later calls only register new ``process_sets``).

    Args:
        comm: the ranks of the global set: ``MPI.COMM_WORLD`` (default), another
            communicator, or a list of ranks of ``MPI.COMM_WORLD`` (call ``init`` on
            every rank; on ranks outside the list every collective raises).
        process_sets: :class:`ProcessSet` objects to register, in order (collective,
            as :func:`add_process_set`); ``"dynamic"`` is accepted (sets can always be
            added and removed).
    """
    _sets.initialize(comm)
    _sets.register(process_sets)


def shutdown() -> None:
    """Finish the engine and release mpitrain's communicators; :func:`init` may follow."""
    global _control_comm
    _table.clear()
    _sets.clear()
    if _control_comm is not None:
        _control_comm.comm.Free()
        _control_comm = None
    session.shutdown()


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return session.is_initialized() or _sets.outside()


def size() -> int:
    """Number of ranks."""
    return _comm().size


def rank() -> int:
    """This process's rank."""
    return _comm().rank


def local_size() -> int:
    """Number of ranks on this node."""
    return _comm().local_size


def local_rank() -> int:
    """This process's rank among the ranks of its node."""
    return _comm().local_rank


def cross_size() -> int:
    """Number of nodes (ranks sharing this local rank)."""
    return _comm().cross_size


def cross_rank() -> int:
    """This node's index (rank among the ranks sharing this local rank)."""
    return _comm().cross_rank


def mpi_threads_supported() -> bool:
    """True if MPI runs with ``MPI_THREAD_MULTIPLE`` (the engine needs it)."""
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def mpi_enabled() -> bool:
    """Always True: mpitrain runs over MPI."""
    return True


def mpi_built() -> bool:
    """Always True: mpitrain runs over MPI."""
    return True


def gloo_enabled() -> bool:
    """Always False: there is no Gloo controller."""
    return False


def gloo_built() -> bool:
    """Always False: there is no Gloo controller."""
    return False


def nccl_built() -> int:
    """0: the operations behave as those of a Horovod built without NCCL, whatever
    carries a CUDA tensor's bytes (CUDA IPC or NCCL inside a node, docs/gpu.md). A
    Horovod built with NCCL answers its version and then changes what some operations
    compute (``op=Adasum`` on GPUs averages within each node first), so scripts and
    Horovod's tests read this flag as that semantics: mpitrain's Adasum is over every
    rank."""
    return 0


def ddl_built() -> bool:
    """Always False: there is no IBM DDL support."""
    return False


def ccl_built() -> bool:
    """Always False: there is no oneCCL support."""
    return False


def rocm_built() -> bool:
    """Always False: ROCm tensors are not supported."""
    return False


def cuda_built() -> bool:
    """True if CUDA tensors work here: torch sees a GPU and mpitrain's GPU backend
    (CuPy) can be imported. False on CPU-only machines (use CPU tensors there)."""
    if not torch.cuda.is_available():
        return False
    try:
        from ..backends import cupy_backend  # noqa: F401  (imports CuPy)
    except ImportError:
        return False
    return True


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write the engine's timeline (Chrome trace) to ``file_path`` from now on.

    Call it on every rank; rank 0 writes. ``mark_cycles`` is accepted for Horovod
    compatibility: mpitrain's timeline has no cycle markers.
    """
    timeline.start_timeline(file_path)


def stop_timeline() -> None:
    """Flush and close the timeline started by :func:`start_timeline` or
    ``MPITRAIN_TIMELINE``/``HOROVOD_TIMELINE``."""
    timeline.stop_timeline()


def _comm(process_set: ProcessSet | None = None) -> Communicator:
    """The communicator of ``process_set`` (default: the global set); raises on a rank
    outside the set."""
    return _sets.communicator(process_set)


def _now(process_set: ProcessSet | None, start: Callable[..., Pending], *args: Any) -> Any:
    """``start(*args).wait()``: an operation its caller waits for at once, so its
    submissions need not wake the engine's thread (:meth:`Communicator.waited`; the
    torch.distributed backend's blocking calls go the same way)."""
    with _comm(process_set).waited():
        pending = start(*args)
    return pending.wait()


def _control(process_set: ProcessSet | None = None) -> MPI.Intracomm:
    """The adapter's duplicate communicator (of ``process_set``'s, default the global
    set's), created (collectively) on first use."""
    global _control_comm
    if process_set is not None and process_set.process_set_id != 0:
        return _sets.control(process_set)
    owner = _comm()
    if _control_comm is None or _control_comm.owner is not owner:
        _control_comm = _Control(owner, owner.mpi_comm.Dup())
    return _control_comm.comm


# -- handles --------------------------------------------------------------------------
_table = HandleTable(lambda: rank())


def _register(pending: Pending) -> int:
    """Keep an operation in flight for :func:`synchronize`; its handle. (The blocking
    calls wait on their :class:`Pending` itself: no handle.)"""
    return _table.register(pending)


def poll(handle: int) -> bool:
    """True once the operation of ``handle`` is done (never blocks); True after
    :func:`synchronize` too."""
    return _table.poll(handle)


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output tensor.

    A handle that was already synchronized returns the same output again, as long as
    the output is still referenced elsewhere (for the last 1024 handles); else
    ``None``, which is what Horovod returns for such a handle.

    Raises:
        ArgumentError: ``handle`` was never returned by an async call here.
        CommunicationError: the operation failed across ranks (``HorovodInternalError``).
    """
    return _table.synchronize(handle)


def _reduce_op(op: Any, average: bool | None) -> ReduceOp:
    """Horovod's ``op``/``average`` rule: ``average`` is the deprecated spelling."""
    if op is not None and average is not None:
        raise ArgumentError("The op parameter supersedes average; pass only one of them")
    if op is None:
        op = Sum if average is False else Average
    return parse_op(op)


# -- local errors end the collective on every rank ---------------------------------
# Every operation prepares its submissions inside ``refusing`` (mpitrain.parallel.refusal);
# the blocking exchanges (alltoall, broadcast_object) share each rank's outcome with
# ``agreed``. Not announced: errors about the process set itself (not an
# ``hvd.ProcessSet``, not registered, or without this rank): such a rank does not know
# which ranks, and so which engine and which counter, the collective belongs to, and
# the members of the set are not waiting for a rank outside it.
_refusing = refusing


def _agreed(comm: Communicator, exchange: Callable[[Any], list[Any]], what: str,
            prepare: Callable[[], tuple[_T, Any]]) -> tuple[_T, list[Any]]:
    """:func:`~mpitrain.parallel.refusal.agreed` with this rank's number."""
    return agreed(comm, exchange, rank(), what, prepare)


# -- allreduce ------------------------------------------------------------------------
def _scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``tensor`` in place and return it, as Horovod scales on the CPU:
    integers in float64, truncated toward zero; float16 in float32, rounded once."""
    if factor == 1.0:
        return tensor
    if tensor.dtype == torch.float16:
        return tensor.copy_(tensor.to(torch.float32) * factor)
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.mul_(factor)
    return tensor.copy_(torch.trunc(tensor.to(torch.float64) * factor))


def _engine_scales(tensor: torch.Tensor) -> bool:
    """True for the dtypes whose scaling the engine does as Horovod does."""
    return (tensor.is_floating_point() and tensor.dtype != torch.float16) or tensor.is_complex()


class _Scaling(NamedTuple):
    """Who scales an allreduce: the engine (``op``, ``prescale``, ``postscale``) or,
    with integer tensors, the adapter (``before``/``after`` the reduction)."""

    op: ReduceOp
    prescale: float
    postscale: float
    before: float = 1.0
    after: float = 1.0

    def source(self, tensor: torch.Tensor, inplace: bool) -> torch.Tensor:
        """The contiguous tensor to submit, prescaled by the adapter where it scales."""
        if self.before == 1.0:
            return tensor if tensor.is_contiguous() else tensor.contiguous()
        if inplace and tensor.is_contiguous():
            return _scale_(tensor, self.before)
        return _scale_(tensor.clone(memory_format=torch.contiguous_format), self.before)


def _scaling(tensors: Sequence[torch.Tensor], op: ReduceOp, prescale: float,
             postscale: float, ranks: int) -> _Scaling:
    """With an integer or float16 tensor among ``tensors`` the adapter scales (prescale
    before the reduction; postscale, and Average's ``1/size``, after it) as
    :func:`_scale_` does (Average over ``ranks`` ranks); the engine then only reduces.
    Otherwise the engine scales."""
    for tensor in tensors:
        require_tensor(tensor)
    try:  # the engine's rule (anything float() takes), checked here: the adapter may scale
        prescale, postscale = float(prescale), float(postscale)
    except (TypeError, ValueError):
        raise ArgumentError(f"rank {rank()}: prescale_factor and postscale_factor must be "
                            f"numbers, got {prescale!r} and {postscale!r}") from None
    if (op is not Average and prescale == 1.0 and postscale == 1.0) or \
            all(_engine_scales(t) for t in tensors):
        return _Scaling(op, prescale, postscale)
    after = postscale / ranks if op is Average else postscale
    return _Scaling(Sum if op is Average else op, 1.0, 1.0, prescale, after)


def _allreduce_start(tensor: torch.Tensor, output: torch.Tensor | None, name: str | None,
                     op: Any, prescale: float, postscale: float,
                     process_set: ProcessSet | None, average: bool | None = None) -> Pending:
    """Submit an allreduce of ``tensor`` (in place when ``output`` is given); ``op`` and
    ``average`` are parsed here, with the other arguments, under :func:`_refusing`."""
    comm = _comm(process_set)
    with _refusing(comm, "allreduce", name):
        how = _scaling([tensor], _reduce_op(op, average), prescale, postscale, comm.size)
        work = _on_host_for_adasum(how, how.source(tensor, inplace=output is not None))
        buffer = as_buffer(work)
        stream = producer_stream(work)
    if output is not None:  # in place
        handle = comm.allreduce_async_(buffer, how.op, name=name,
                                       prescale_factor=how.prescale, postscale_factor=how.postscale,
                                       stream=stream)

        def finish() -> torch.Tensor:
            handle.wait()
            if work is not tensor:
                tensor.copy_(work)
            return _scale_(tensor, how.after)
        return Pending([handle], finish)
    handle = comm.allreduce_async(buffer, how.op, name=name,
                                  prescale_factor=how.prescale, postscale_factor=how.postscale,
                                  stream=stream)
    return Pending([handle], lambda: _scale_(_on_device_of(tensor, from_buffer(handle.wait())),
                                             how.after))


def _on_host_for_adasum(how: _Scaling, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a host copy of a device tensor for op=Adasum, which mpitrain
    reduces on the host only (the result is copied back by the caller)."""
    return host_copy(tensor) if how.op is Adasum else tensor


def _on_device_of(like: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` on ``like``'s device (a host result of a device tensor's Adasum)."""
    return to_device_of(like, result) if device_of(result) is None else result


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce into a new tensor; returns a handle for :func:`synchronize`."""
    return _register(_allreduce_start(tensor, None, name, op, prescale_factor,
                                      postscale_factor, process_set, average))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce of ``tensor``; returns a handle."""
    return _register(_allreduce_start(tensor, tensor, name, op, prescale_factor,
                                      postscale_factor, process_set, average))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Allreduce ``tensor`` in place and return it (not differentiable)."""
    return _now(process_set, _allreduce_start, tensor, tensor, name, op, prescale_factor,
                postscale_factor, process_set, average)


class _Untracked:
    """The ``ctx`` of an autograd function's ``forward`` run outside autograd (:func:`_apply`):
    what the forwards record on it is never read, so it keeps nothing (one object serves
    every call, on every thread)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        """Forget it: no backward will read it."""

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        """Nothing to mark: no graph is recorded."""


_UNTRACKED = _Untracked()


def _apply(function: Any, *args: Any) -> Any:
    """``function.apply(*args)`` where autograd records the call (grad mode on and a tensor
    argument that requires grad); elsewhere ``function``'s ``forward`` alone, which
    computes the same outputs without autograd's per-call bookkeeping (a blocking
    collective of a tensor that needs no gradient is most calls)."""
    if torch.is_grad_enabled():
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                return function.apply(*args)
    return function.forward(_UNTRACKED, *args)


def _linear(op: ReduceOp, what: str) -> None:
    if op not in (Sum, Average):
        raise ArgumentError(f"the gradient of {what} is defined for op=Sum and op=Average, not "
                            f"{op!r}; detach the tensor or use Sum/Average")


class _Allreduce(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce (same op and scaling) of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                prescale: float, postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return _now(process_set, _allreduce_start, tensor, None, name, op, prescale, postscale,
                    process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, prescale, postscale, process_set = ctx.args
        _linear(op, "allreduce")
        reduced = _now(process_set, _allreduce_start, grad.contiguous(), None, None, op, prescale,
                       postscale, process_set)
        return reduced, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (of ``process_set``) into a new tensor
    (differentiable).

    Args:
        tensor: any tensor; stays unchanged.
        average: deprecated Horovod spelling of ``op`` (True: Average, False: Sum).
        name: names the operation so ranks may submit in different orders.
        compression: ``Compression.none``/``fp16``/``bf16``, applied around the reduction.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``, ``Adasum``
            (float tensors on the CPU, power-of-two rank counts; not differentiable).
        prescale_factor, postscale_factor: multiply before / after the reduction.
            Integer tensors are scaled as Horovod scales them: in float64, truncated
            toward zero (also Average's division by the rank count); float16 in
            float32; other floating-point tensors in their own dtype. (mpitrain's
            numpy/cupy API rounds integers toward minus infinity instead.)
        process_set: the ranks that reduce together (default: every rank); only its
            members may call (elsewhere it raises at once).
    """
    with _refusing(_comm(process_set), "allreduce", name):
        rop = _reduce_op(op, average)
        compressed, ctx = compression.compress(require_tensor(tensor))
    summed = _apply(_Allreduce, compressed, name, rop, prescale_factor, postscale_factor,
                    process_set)
    return compression.decompress(summed, ctx)


def _grouped_start(tensors: Sequence[torch.Tensor], inplace: bool, name: str | None,
                   op: Any, prescale: float, postscale: float,
                   process_set: ProcessSet | None, average: bool | None = None) -> Pending:
    """Submit one fused allreduce of ``tensors`` (``op``/``average`` parsed here)."""
    comm = _comm(process_set)
    with _refusing(comm, "grouped_allreduce", name):
        group = list(tensors)
        how = _scaling(group, _reduce_op(op, average), prescale, postscale, comm.size)
        work = [_on_host_for_adasum(how, how.source(t, inplace)) for t in group]
        buffers = [as_buffer(w) for w in work]
        stream = producer_stream(work[0]) if work else None
    if not inplace:
        handle = comm.grouped_allreduce_async(buffers, how.op, name=name,
                                              prescale_factor=how.prescale,
                                              postscale_factor=how.postscale, stream=stream)
        return Pending([handle], lambda: [_scale_(_on_device_of(t, from_buffer(r)), how.after)
                                          for t, r in zip(group, handle.wait())])
    handle = comm.grouped_allreduce_async_(buffers, how.op, name=name, prescale_factor=how.prescale,
                                           postscale_factor=how.postscale, stream=stream)

    def finish() -> list[torch.Tensor]:
        handle.wait()
        for t, w in zip(group, work):
            if w is not t:
                t.copy_(w)
            _scale_(t, how.after)
        return group
    return Pending([handle], finish)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start one fused allreduce of every tensor into new tensors; returns a handle."""
    return _register(_grouped_start(tensors, False, name, op, prescale_factor,
                                    postscale_factor, process_set, average))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start one fused in-place allreduce of every tensor; returns a handle."""
    return _register(_grouped_start(tensors, True, name, op, prescale_factor,
                                    postscale_factor, process_set, average))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce every tensor in place, fused; returns the tensors."""
    return _now(process_set, _grouped_start, tensors, True, name, op, prescale_factor,
                postscale_factor, process_set, average)


class _GroupedAllreduce(torch.autograd.Function):
    """Fused allreduce of several tensors; the gradients are allreduced the same way."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_now(process_set, _grouped_start, tensors, False, name, op, prescale,
                          postscale, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, prescale, postscale, process_set = ctx.args
        _linear(op, "grouped_allreduce")
        reduced = _now(process_set, _grouped_start, [g.contiguous() for g in grads], False, None,
                       op, prescale, postscale, process_set)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce every tensor in one fused operation into new tensors (differentiable)."""
    with _refusing(_comm(process_set), "grouped_allreduce", name):
        rop = _reduce_op(op, average)
        packed = [compression.compress(require_tensor(t)) for t in tensors]
    if not packed:
        return []
    reduced = _apply(_GroupedAllreduce, name, rop, prescale_factor, postscale_factor,
                     process_set, *[c for c, _ in packed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]


# -- sparse allreduce -------------------------------------------------------------------
class SparseHandle(int):
    """The handle of :func:`sparse_allreduce_async`: an integer handle like the others
    (:func:`poll`, :func:`synchronize`), and callable, as Horovod's: ``handle()`` is
    ``synchronize(handle)``."""

    __slots__ = ()

    def __call__(self) -> Any:
        return synchronize(self)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None,
                           op: Any = Average,
                           process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce of a sparse COO tensor: every rank's indices and values are
    allgathered (:mod:`.sparse`); returns a :class:`SparseHandle` whose
    :func:`synchronize` (or call, as in Horovod) gives the coalesced sparse sum, its
    values divided by the rank count for ``op=Average``.

    The shape must be the same on every rank; the non-zeros may differ. Only ``Sum``
    and ``Average`` are supported (an ``ArgumentError`` at once otherwise).
    """
    comm = _comm(process_set)
    with _refusing(comm, "allgather", *sparse_part_names(name)):
        prepared = prepare_sparse_allreduce(tensor, op, comm.rank)
    handles, finish = start_sparse_allreduce(comm, prepared, name)
    return SparseHandle(_register(Pending(handles, finish)))


# -- allgather, broadcast, reducescatter ----------------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather (concatenation along dim 0); returns a handle."""
    return _register(_allgather_start(tensor, name, process_set))


def _allgather_start(tensor: torch.Tensor, name: str | None,
                     process_set: ProcessSet | None) -> Pending:
    """Submit an allgather of ``tensor``; its output is the gathered tensor."""
    comm = _comm(process_set)
    with _refusing(comm, "allgather", name):
        buffer = as_buffer(tensor)
    handle = comm.allgather_async(buffer, name=name, stream=producer_stream(tensor))
    return Pending([handle], lambda: from_buffer(handle.wait()))


class _Allgather(torch.autograd.Function):
    """Allgather; the gradient of a rank's rows is the average over ranks of theirs
    (Horovod's definition: each rank's loss counts as a share of one mean loss)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        gathered = _now(process_set, _allgather_start, tensor, name, process_set)  # checks it
        ctx.shape, ctx.process_set = tensor.shape, process_set  # on every rank first
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        averaged = _now(ctx.process_set, _allreduce_start, grad.contiguous(), None, None, Average,
                        1.0, 1.0, ctx.process_set)
        mine = ctx.shape[0] if len(ctx.shape) else 1
        comm = _comm(ctx.process_set)
        offset = sum(comm.allgather_object(mine)[:comm.rank])
        return averaged.narrow(0, offset, mine).reshape(ctx.shape), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (which may differ by rank), in
    rank order (of the ranks of ``process_set``).

    Differentiable, as in Horovod: the gradient of this rank's rows is the average of
    every rank's gradient for them.
    """
    return _apply(_Allgather, tensor, name, process_set)


def _broadcast_start(tensor: torch.Tensor, root_rank: int, name: str | None,
                     inplace: bool, process_set: ProcessSet | None) -> Pending:
    """Submit a broadcast of the root's ``tensor`` (into ``tensor`` itself if ``inplace``,
    else into a new one, the output)."""
    comm = _comm(process_set)
    with _refusing(comm, "broadcast", name):
        require_tensor(tensor)
        root = _sets.set_rank(process_set, root_rank, "broadcast")
        work = tensor if not inplace or tensor.is_contiguous() else tensor.contiguous()
        buffer = as_buffer(work)
    stream = producer_stream(work)
    if not inplace:
        handle = comm.broadcast_async(buffer, root, name=name, stream=stream)
        return Pending([handle], lambda: from_buffer(handle.wait()))
    handle = comm.broadcast_async_(buffer, root, name=name, stream=stream)

    def finish() -> torch.Tensor:
        handle.wait()
        if work is not tensor:
            tensor.copy_(work)
        return tensor
    return Pending([handle], finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast of the root's ``tensor`` into a new tensor; returns a handle.

    ``root_rank`` is a global rank (``hvd.rank()`` numbering), also with a
    ``process_set``, of which it must be a member. Differentiable, as in Horovod: the
    root's gradient is the average of every rank's, the others' zero.
    """
    return _register(_broadcast_start(tensor, root_rank, name, False, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place broadcast of the root's ``tensor``; returns a handle."""
    return _register(_broadcast_start(tensor, root_rank, name, True, process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with the root's and return it (not differentiable)."""
    return _now(process_set, _broadcast_start, tensor, root_rank, name, True, process_set)


class _Broadcast(torch.autograd.Function):
    """Broadcast; the root's gradient is the sum of every rank's, the others get zeros."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> Any:
        ctx.root, ctx.process_set = root_rank, process_set
        return _now(process_set, _broadcast_start, tensor, root_rank, name, False, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        averaged = _now(ctx.process_set, _allreduce_start, grad.contiguous(), None, None, Average,
                        1.0, 1.0, ctx.process_set)
        mine = averaged if rank() == ctx.root else torch.zeros_like(averaged)
        return mine, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return the root's ``tensor`` on every rank, as a new tensor (differentiable).

    ``root_rank`` is a global rank (``hvd.rank()`` numbering), also with a
    ``process_set``, of which it must be a member. Differentiable, as in Horovod: the
    root's gradient is the average of every rank's, the others' zero.
    """
    return _apply(_Broadcast, tensor, root_rank, name, process_set)


def _gradient_scale(op: ReduceOp, prescale: float, postscale: float, ranks: int) -> float:
    """The factor of a reduce-scatter's gradient, as Horovod defines it: the gathered
    gradient times the scaling factors, and times the rank count for ``Sum`` (each rank's
    loss counts as a share of one mean loss, as for :func:`allgather`)."""
    return prescale * postscale * (ranks if op is Sum else 1)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> int:
    """Start a reduce-scatter; the handle's output is this rank's block of dim 0.

    Integer tensors are scaled (factors, Average's ``1/size``) in float64 and truncated
    toward zero, as Horovod does.
    """
    return _register(_reducescatter_start(tensor, name, op, prescale_factor,
                                          postscale_factor, process_set))


def _reducescatter_start(tensor: torch.Tensor, name: str | None, op: Any, prescale: float,
                         postscale: float, process_set: ProcessSet | None) -> Pending:
    """Submit a reduce-scatter of ``tensor``; its output is this rank's block."""
    comm = _comm(process_set)
    with _refusing(comm, "reduce_scatter", name):
        source, how = _reducescatter_source(comm, tensor, op, prescale, postscale)
    return _submit_reducescatter(comm, source, how, name)


def _reducescatter_source(comm: Communicator, tensor: torch.Tensor, op: Any,
                          prescale: float, postscale: float
                          ) -> tuple[tuple[Any, Any], _Scaling]:
    """The buffer a reduce-scatter of ``tensor`` submits with the stream that produces
    it, and who scales it."""
    how = _scaling([tensor], parse_op(op), prescale, postscale, comm.size)
    work = how.source(tensor, inplace=False)
    return (as_buffer(work), producer_stream(work)), how


def _submit_reducescatter(comm: Communicator, source: tuple[Any, Any], how: _Scaling,
                          name: str | None) -> Pending:
    """Submit the reduce-scatter of a prepared ``(buffer, stream)``."""
    buffer, stream = source
    handle = comm.reduce_scatter_async(buffer, how.op, name=name,
                                       prescale_factor=how.prescale, postscale_factor=how.postscale,
                                       stream=stream)
    return Pending([handle], lambda: _scale_(from_buffer(handle.wait()), how.after))


class _Reducescatter(torch.autograd.Function):
    """Reduce-scatter; the gradient is the allgather of the blocks' gradients, scaled
    (:func:`_gradient_scale`)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                prescale: float, postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return _now(process_set, _reducescatter_start, tensor, name, op, prescale, postscale,
                    process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, prescale, postscale, process_set = ctx.args
        _linear(op, "reducescatter")
        gathered = _now(process_set, _allgather_start, grad.contiguous(), None, process_set)
        scale = _gradient_scale(op, prescale, postscale, _comm(process_set).size)
        return gathered * scale, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: Any = Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's block of dim 0 (differentiable).

    With ``d`` rows, the first ``d % size`` ranks get ``d // size + 1`` rows, the others
    ``d // size`` (Horovod's split; ``size`` and the order are those of
    ``process_set``'s ranks). ``op`` defaults to Average, as in Horovod. The gradient
    is Horovod's: the allgather of the blocks' gradients times the scaling factors, and
    times the rank count for ``Sum``.
    """
    with _refusing(_comm(process_set), "reduce_scatter", name):
        compressed, ctx = compression.compress(require_tensor(tensor))
        rop = parse_op(op)
    block = _apply(_Reducescatter, compressed, name, rop, prescale_factor, postscale_factor,
                   process_set)
    return compression.decompress(block, ctx)


# -- grouped allgather and reducescatter -------------------------------------------
def _member(name: str | None, index: int) -> str | None:
    """The name of a group's ``index``-th operation (``None`` stays unnamed)."""
    return None if name is None else f"{name}.{index}"


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather of every tensor; the handle's output is the list of results.

    The allgathers are submitted together (the engine runs them back to back); with
    ``name``, the i-th is named ``f"{name}.{i}"``.
    """
    comm = _comm(process_set)  # a rank outside the set raises, also for no tensors
    tensors = list(tensors)
    names = [_member(name, i) for i in range(len(tensors))]
    with _refusing(comm, "allgather", *names):  # no member is submitted unless all can be
        buffers = [as_buffer(t) for t in tensors]
    handles = [comm.allgather_async(b, name=n, stream=producer_stream(t))
               for b, n, t in zip(buffers, names, tensors)]
    return _register(Pending(handles, lambda: [from_buffer(h.wait()) for h in handles]))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather every tensor (dim 0 may differ by rank); differentiable, as
    :func:`allgather`."""
    _comm(process_set)
    return [allgather(t, _member(name, i), process_set) for i, t in enumerate(tensors)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> int:
    """Start a reduce-scatter of every tensor; the handle's output is the list of this
    rank's blocks (see :func:`reducescatter` for the split and the integer scaling)."""
    comm = _comm(process_set)
    tensors = list(tensors)
    names = [_member(name, i) for i in range(len(tensors))]
    with _refusing(comm, "reduce_scatter", *names):  # all members or none
        sources = [_reducescatter_source(comm, t, op, prescale_factor, postscale_factor)
                   for t in tensors]
    parts = [_submit_reducescatter(comm, source, how, n)
             for (source, how), n in zip(sources, names)]
    return _register(Pending([h for p in parts for h in p.handles],
                             lambda: [p.wait() for p in parts]))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce-scatter every tensor (differentiable, as :func:`reducescatter`)."""
    _comm(process_set)
    return [reducescatter(t, _member(name, i), compression, op, prescale_factor,
                          postscale_factor, process_set) for i, t in enumerate(tensors)]


# -- alltoall -------------------------------------------------------------------------
def _check_splits(tensor: torch.Tensor, splits: Any, n: int) -> np.ndarray[Any, Any]:
    """The rows ``tensor`` sends to each of ``n`` ranks."""
    if require_tensor(tensor).dim() == 0:
        raise ArgumentError(f"rank {rank()}: alltoall splits dim 0, but got a 0-d tensor; "
                            "pass tensor.reshape(1)")
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ArgumentError(f"rank {rank()}: alltoall without splits needs dim 0 ({rows}) "
                                f"divisible by the number of ranks ({n}); pass splits=")
        return np.full(n, rows // n, dtype=np.int64)
    counts = np.asarray(splits.cpu() if isinstance(splits, torch.Tensor) else splits)
    if counts.shape != (n,) or counts.dtype.kind not in "iu" or np.any(counts < 0) \
            or int(counts.sum()) != rows:
        raise ArgumentError(f"rank {rank()}: alltoall splits must be {n} non-negative integers "
                            f"summing to dim 0 ({rows}), got {counts.tolist()}")
    return counts.astype(np.int64)


def _alltoall(tensor: torch.Tensor, splits: Any,
              process_set: ProcessSet | None) -> tuple[torch.Tensor, torch.Tensor]:
    ctrl = _control(process_set)

    def prepare() -> tuple[tuple[np.ndarray[Any, Any], Any], tuple[str, tuple[int, ...]]]:
        counts = _check_splits(tensor, splits, ctrl.Get_size())
        source = tensor.detach().cpu().contiguous()  # the CPU tensor itself when it is one
        send = host_view(source).reshape(-1).view(np.uint8)
        return (counts, send), (str(tensor.dtype), tuple(tensor.shape[1:]))

    # the exchange of dtypes and trailing shapes carries a rank's error in their place
    (send_counts, send), kinds = _agreed(_comm(process_set), ctrl.allgather, "alltoall",
                                         prepare)
    trailing = tuple(tensor.shape[1:])
    if any(k != kinds[0] for k in kinds):
        bad = next(r for r, k in enumerate(kinds) if k != kinds[0])
        first = _sets.global_rank(process_set, 0)
        raise MismatchError(f"rank {rank()}: alltoall needs the same dtype and trailing shape "
                            f"on every rank, but rank {_sets.global_rank(process_set, bad)} "
                            f"sent {kinds[bad]} and rank {first} sent {kinds[0]}")
    recv_counts = np.empty_like(send_counts)
    ctrl.Alltoall(send_counts, recv_counts)
    output = torch.empty((int(recv_counts.sum()), *trailing), dtype=tensor.dtype)
    row_bytes = int(np.prod(trailing, dtype=np.int64)) * tensor.element_size()
    if row_bytes:
        row = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        try:
            ctrl.Alltoallv(
                [send, (send_counts, np.cumsum(send_counts) - send_counts), row],
                [host_view(output).reshape(-1).view(np.uint8),
                 (recv_counts, np.cumsum(recv_counts) - recv_counts), row])
        finally:
            row.Free()
    return output.to(tensor.device), torch.from_numpy(recv_counts.astype(np.int32))


class _Alltoall(torch.autograd.Function):
    """Alltoall; the gradient travels back by the alltoall with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, process_set: ProcessSet) -> Any:
        output, received = _alltoall(tensor, splits, process_set)
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:
        back, _ = _alltoall(grad.contiguous(), ctx.received, ctx.process_set)
        return back, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` (dim 0, in order) to rank ``i`` (the
    ``i``-th rank of ``process_set``).

    Args:
        tensor: rows to distribute; trailing dims and dtype must agree across ranks.
        splits: rows per destination rank (list or int tensor, summing to dim 0);
            ``None`` sends equal parts (dim 0 must then be divisible by the rank count).
        name: accepted for Horovod compatibility (the exchange is blocking).

    Returns:
        The received rows concatenated in rank order; with ``splits`` given, also an
        int32 tensor of the rows received from each rank (as Horovod does).
        Differentiable.
    """
    output, received = _apply(_Alltoall, tensor, splits, process_set)
    return output if splits is None else (output, received)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """:func:`alltoall` behind a handle: ``synchronize`` returns ``(output,
    received_splits)``, as Horovod's does.

    The exchange itself runs during this call (on the adapter's own communicator), so
    the handle is done at once; not differentiable.
    """
    done = _alltoall(tensor.detach(), splits, process_set)
    return _register(Pending([], lambda: done))


# -- synchronisation and objects ------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of ``process_set``) has called :func:`barrier`."""
    _comm(process_set).barrier()  # no argument but the set (see _refusing)


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Block until every rank (of ``process_set``) has joined; return the rank that
    joined last (a global rank, the same on every rank).

    Until then this rank takes part in the collectives the other ranks submit, as
    Horovod's joined ranks do: it contributes zeros to Sum and Average (which still
    divides by the full size), the op's identity to Min, Max and Product, and no rows
    to allgathers; a broadcast from a joined root fails with ``HorovodInternalError``.
    ``device`` is accepted for Horovod compatibility.
    """
    # ``device`` is not used: the set is the only argument that can be wrong (see
    # _refusing)
    return _sets.global_rank(process_set, _comm(process_set).join())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return the root's ``obj`` (any picklable object) on every rank; ``root_rank`` is
    a global rank, a member of ``process_set``.

    A ``root_rank`` that is not a member on one rank raises there and a
    ``MismatchError`` on the others (one small allgather first agrees on that).
    """
    comm = _comm(process_set)

    def prepare() -> tuple[int, None]:
        root = _sets.set_rank(process_set, root_rank, "broadcast_object")
        comm.check_root(root)
        return root, None

    root, _ = _agreed(comm, comm.allgather_object, "broadcast_object", prepare)
    return comm.broadcast_object(obj, root)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every rank's ``obj`` in rank order (of ``process_set``'s ranks)."""
    # an object that does not pickle fails on every rank inside the exchange; the set
    # is the only other argument (see _refusing)
    return _comm(process_set).allgather_object(obj)


__all__ = [
    "Adasum", "Average", "HorovodInternalError", "Max", "Min", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll",
    "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline",
    "synchronize",
]
# torch.compile breaks its graph at each of them instead of tracing into mpitrain (.eager).
eager_functions(globals(), __all__)
