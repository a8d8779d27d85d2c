"""Make every rank start from the root's parameters and optimizer state.

:func:`broadcast_arrays` broadcasts named buffers in place, all in flight at once.
:func:`broadcast_tree` broadcasts a nested structure (dicts, lists, tuples) whose
leaves are arrays or plain values: the root sends the structure with its plain
values and each array's shape and dtype as one object, the other ranks allocate
the arrays, and the array bytes travel by :func:`broadcast_arrays`. An optimizer's
``state_dict()`` is such a structure, which is how
:func:`broadcast_optimizer_state` works for any optimizer, including one whose state
is created lazily and is still empty on the other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..communicator import Communicator
from ..errors import ArgumentError
from ..session import default_communicator


def resolve(comm: Communicator | None) -> Communicator:
    """``comm``, or the communicator of :func:`mpitrain.init` when ``None``."""
    return comm if comm is not None else default_communicator()


def broadcast_arrays(named: Sequence[tuple[str, Any]], root: int = 0,
                     comm: Communicator | None = None) -> None:
    """Overwrite each array with the root's, in place; all broadcasts in flight at once.

    Args:
        named: ``(name, array)`` pairs, the same names on every rank; names only
            identify the operations, so ranks may list them in different orders.
        root: the rank whose values every rank receives.
        comm: the communicator (default: that of :func:`mpitrain.init`).
    """
    comm = resolve(comm)
    handles = [comm.broadcast_async_(buf, root=root, name=f"broadcast.{name}")
               for name, buf in named]
    for handle in handles:
        handle.wait()


@dataclass(frozen=True)
class LeafSpec:
    """Placeholder for one array of a broadcast structure: its slot, shape, dtype, and
    the kind of memory it is in (``"cpu"``, ``"cuda"``: every rank receives it into the
    same kind, so that every rank's broadcast takes the same path)."""

    index: int
    shape: tuple[int, ...]
    dtype: str
    memory: str = "cpu"


@dataclass(frozen=True)
class ArrayKind:
    """How :func:`broadcast_tree` recognises, views and allocates one kind of array
    (``memory``: where an array lives, as :attr:`LeafSpec.memory` names it; ``empty``
    allocates one of that shape, dtype and memory on this rank)."""

    is_array: Callable[[Any], bool]
    buffer: Callable[[Any], Any]  # zero-copy array view that the comm layer accepts
    empty: Callable[[tuple[int, ...], str, str], Any]
    memory: Callable[[Any], str] = lambda x: "cpu"


NUMPY_ARRAYS = ArrayKind(
    is_array=lambda x: isinstance(x, np.ndarray),
    buffer=lambda x: x,
    empty=lambda shape, dtype, memory: np.empty(shape, np.dtype(dtype)),  # "bfloat16": ml_dtypes
)


def _split(tree: Any, kind: ArrayKind, leaves: list[Any]) -> Any:
    """``tree`` with every array replaced by a :class:`LeafSpec` (arrays go to ``leaves``)."""
    if kind.is_array(tree):
        leaves.append(tree)
        return LeafSpec(len(leaves) - 1, tuple(int(d) for d in tree.shape),
                        str(tree.dtype).removeprefix("torch."), kind.memory(tree))
    if isinstance(tree, Mapping):
        return {k: _split(v, kind, leaves) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_split(v, kind, leaves) for v in tree)
    return tree


def _join(skeleton: Any, leaves: list[Any]) -> Any:
    if isinstance(skeleton, LeafSpec):
        return leaves[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _join(v, leaves) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_join(v, leaves) for v in skeleton)
    return skeleton


def _specs(skeleton: Any) -> Iterable[LeafSpec]:
    if isinstance(skeleton, LeafSpec):
        yield skeleton
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            yield from _specs(v)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            yield from _specs(v)


def broadcast_tree(tree: Any, root: int = 0, comm: Communicator | None = None,
                   kind: ArrayKind = NUMPY_ARRAYS, name: str = "tree") -> Any:
    """Return the root's ``tree`` on every rank (collective).

    Args:
        tree: nested dicts/lists/tuples of arrays and picklable plain values. Only the
            root's structure matters; other ranks may pass anything (even ``None``).
        root: the rank whose tree every rank receives.
        comm: the communicator (default: that of :func:`mpitrain.init`).
        kind: which arrays are leaves and how to allocate them (numpy by default).
        name: prefix of the broadcast operations' names.

    Returns:
        On the root, ``tree`` itself; elsewhere a new structure with new arrays.
    """
    comm = resolve(comm)
    leaves: list[Any] = []
    skeleton = _split(tree, kind, leaves) if comm.rank == root else None
    skeleton = comm.broadcast_object(skeleton, root=root)
    if comm.rank != root:
        leaves = [kind.empty(spec.shape, spec.dtype, spec.memory) for spec in _specs(skeleton)]
    broadcast_arrays([(f"{name}.{i}", kind.buffer(leaf)) for i, leaf in enumerate(leaves)],
                     root=root, comm=comm)
    return tree if comm.rank == root else _join(skeleton, leaves)


def _named_arrays(params: Any) -> list[tuple[str, Any]]:
    """``(name, array)`` pairs from a dict, a list of pairs, or a list of parameters."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = []
        for i, entry in enumerate(params):
            if isinstance(entry, tuple) and len(entry) == 2:
                items.append(entry)
            else:
                items.append((getattr(entry, "name", None) or f"param.{i}", entry))
    named = []
    for name, value in items:
        is_array = isinstance(value, np.ndarray) or hasattr(value, "__cuda_array_interface__")
        array = value if is_array else getattr(value, "data", value)  # ndarray.data: bytes
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            raise ArgumentError(f"broadcast_parameters: {name!r} is a "
                                f"{type(value).__name__}, not an array or a parameter "
                                "with a .data array")
        named.append((str(name), array))
    return named


def broadcast_parameters(params: Any, root_rank: int = 0,
                         comm: Communicator | None = None) -> None:
    """Overwrite every parameter with the root's value, in place (collective).

    Args:
        params: a dict ``name -> array or parameter``, a list of ``(name, array or
            parameter)`` pairs, or a list of parameters (objects with ``.data``).
        root_rank: the rank whose parameters every rank receives.
        comm: the communicator (default: that of :func:`mpitrain.init`).
    """
    broadcast_arrays(_named_arrays(params), root=root_rank, comm=comm)


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0,
                              comm: Communicator | None = None) -> None:
    """Give every rank the root's optimizer state (collective).

    Works for any optimizer with ``state_dict()`` / ``load_state_dict()`` whose state is
    a nested structure of numpy arrays and plain values.
    """
    comm = resolve(comm)
    state = broadcast_tree(optimizer.state_dict(), root=root_rank, comm=comm,
                           name="optimizer")
    if comm.rank != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, comm: Communicator | None = None) -> Any:
    """Return the root's ``obj`` (any picklable object) on every rank."""
    return resolve(comm).broadcast_object(obj, root_rank)


def allgather_object(obj: Any, comm: Communicator | None = None) -> list[Any]:
    """Return every rank's ``obj`` in rank order (any picklable object)."""
    return resolve(comm).allgather_object(obj)
