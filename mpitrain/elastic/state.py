"""The training state that elastic training commits, restores and shares.

A :class:`State` holds named *entries*: numpy arrays, numbers, strings, dicts and
lists of them, and objects with ``state_dict()``/``load_state_dict()`` (torch modules
and optimizers, mpitrain.trainer optimizers, samplers). :meth:`State.commit` takes a
deep copy of every entry (a *snapshot*); :meth:`State.restore` puts the last snapshot
back, writing arrays in place so that references the training code holds stay valid.
With ``checkpoint=DIR`` every ``checkpoint_every``-th commit is also written as a
durable checkpoint (:mod:`mpitrain.checkpoint`), which :func:`mpitrain.elastic.run`
resumes from when the job starts again.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable

import numpy as np

from .. import checkpoint
from ..errors import ArgumentError
from ..session import default_communicator

_RESERVED = frozenset({"commit", "restore", "sync", "commits", "register_reset_callbacks",
                       "checkpoint", "checkpoint_every", "entries"})
_TENSOR = "__torch_tensor__"


def _stateful(value: Any) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _restore_into(current: Any, saved: Any) -> Any:
    """``saved`` as the new value of an entry now ``current``, reusing its arrays."""
    if (isinstance(current, np.ndarray) and isinstance(saved, np.ndarray)
            and current.shape == saved.shape and current.dtype == saved.dtype
            and current.flags.writeable):
        current[...] = saved
        return current
    if isinstance(current, dict) and isinstance(saved, dict):
        for key in list(current):
            if key not in saved:
                del current[key]
        for key, value in saved.items():
            current[key] = _restore_into(current.get(key), value)
        return current
    if isinstance(current, list) and isinstance(saved, list) and len(current) == len(saved):
        current[:] = [_restore_into(c, s) for c, s in zip(current, saved)]
        return current
    return copy.deepcopy(saved)


def to_arrays(tree: Any) -> Any:
    """``tree`` with torch tensors replaced by marked numpy arrays (for a checkpoint)."""
    if isinstance(tree, dict):
        return {k: to_arrays(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_arrays(v) for v in tree)
    if hasattr(tree, "detach") and hasattr(tree, "numpy"):
        return {_TENSOR: tree.detach().cpu().numpy()}
    return tree


def from_arrays(tree: Any) -> Any:
    """Undo :func:`to_arrays`: marked arrays become torch tensors again."""
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return sys.modules["torch"].from_numpy(np.array(tree[_TENSOR]))
        return {k: from_arrays(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(from_arrays(v) for v in tree)
    return tree


class State:
    """Named training state that survives the loss of ranks.

    Args:
        checkpoint: optional directory; every ``checkpoint_every``-th :meth:`commit`
            also writes a durable checkpoint there, and :func:`mpitrain.elastic.run`
            resumes from the newest one when the job starts (``--max-restarts``).
        checkpoint_every: commits between two durable checkpoints.
        **entries: the state, e.g. ``model=net, optimizer=opt, epoch=0, batch=0``.
            Read and assign entries as attributes: ``state.epoch += 1``.

    Example::

        state = mt.elastic.State(params=w, epoch=0, batch=0)

        @mt.elastic.run
        def train(state):
            while state.batch < steps:
                ...
                state.batch += 1
                state.commit()
    """

    def __init__(self, checkpoint: str | None = None, checkpoint_every: int = 1,
                 **entries: Any) -> None:
        clash = sorted(_RESERVED.intersection(entries))
        if clash:
            raise ArgumentError(f"mt.elastic.State: {', '.join(clash)} is a reserved name; "
                                "rename that entry")
        if checkpoint_every < 1:
            raise ArgumentError(f"mt.elastic.State: checkpoint_every must be >= 1, got "
                                f"{checkpoint_every}")
        object.__setattr__(self, "_entries", dict(entries))
        self._checkpoint = checkpoint
        self._every = checkpoint_every
        self._commits = 0
        self._snapshot: dict[str, Any] = self.capture()
        self._callbacks: list[Callable[[], None]] = []

    # -- entries as attributes ----------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        entries = self.__dict__.get("_entries", {})
        if name in entries:
            return entries[name]
        raise AttributeError(f"mt.elastic.State has no entry {name!r}; entries: "
                             f"{', '.join(entries) or '(none)'}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in _RESERVED:
            raise AttributeError(f"mt.elastic.State.{name} cannot be assigned")
        else:
            self._entries[name] = value

    @property
    def entries(self) -> dict[str, Any]:
        """The live entries, by name."""
        return dict(self._entries)

    @property
    def commits(self) -> int:
        """How many times :meth:`commit` has run (the id of the last snapshot)."""
        return self._commits

    # -- snapshots ------------------------------------------------------------------------
    def capture(self) -> dict[str, Any]:
        """A deep copy of every entry (``state_dict()`` of the stateful ones)."""
        return {name: copy.deepcopy(value.state_dict() if _stateful(value) else value)
                for name, value in self._entries.items()}

    def apply(self, snapshot: dict[str, Any]) -> None:
        """Set every entry to its value in ``snapshot`` (arrays are written in place)."""
        for name, saved in snapshot.items():
            current = self._entries.get(name)
            if _stateful(current):
                current.load_state_dict(copy.deepcopy(saved))
            else:
                self._entries[name] = _restore_into(current, saved)

    def commit(self) -> None:
        """Snapshot the state: a rank failure rolls every survivor back to a commit.

        Every rank must commit at the same points of the training loop. Every
        ``checkpoint_every``-th commit also writes the durable checkpoint (collective).
        """
        self._commits += 1
        self._snapshot = self.capture()
        if self._checkpoint and self._commits % self._every == 0:
            checkpoint.save(self._checkpoint, {"commits": self._commits,
                                               "entries": to_arrays(self._snapshot)},
                            step=self._commits)

    def restore(self) -> None:
        """Roll the entries back to the last :meth:`commit`."""
        self.apply(self._snapshot)

    def adopt(self, snapshot: dict[str, Any], commits: int) -> None:
        """Make ``snapshot`` (commit number ``commits``) this rank's state and last commit."""
        self.apply(snapshot)
        self._snapshot = copy.deepcopy(snapshot)
        self._commits = commits

    def load_checkpoint(self) -> bool:
        """Adopt the newest intact durable checkpoint, if ``checkpoint`` has one (local, no
        MPI); damaged newer ones are skipped with a warning
        (:func:`mpitrain.checkpoint.load_latest`)."""
        if not self._checkpoint:
            return False
        ckpt = checkpoint.load_latest(self._checkpoint)
        if ckpt is None:
            return False
        saved = ckpt.state
        if not (isinstance(saved, dict) and isinstance(saved.get("entries"), dict)
                and isinstance(saved.get("commits"), int)):
            raise checkpoint.CheckpointError(
                f"{ckpt.path} was not written by mt.elastic.State (it has no entries and "
                f"commits); give State(checkpoint=...) a directory of its own")
        self.adopt(from_arrays(saved["entries"]), saved["commits"])
        return True

    # -- reset callbacks ------------------------------------------------------------------
    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every recovery from a rank failure.

        Use them to adapt to the new size (learning rate, data sampler, ...).
        """
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (done by :func:`mpitrain.elastic.run`)."""
        for callback in self._callbacks:
            callback()

    def sync(self, root: int = 0) -> None:
        """Every rank takes rank ``root``'s last commit (collective, default communicator)."""
        comm = default_communicator()
        mine = (self._commits, self._snapshot) if comm.rank == root else None
        commits, snapshot = comm.broadcast_object(mine, root=root)
        if comm.rank != root:
            self.adopt(snapshot, commits)
