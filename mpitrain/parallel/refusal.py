"""A local error ends the collective on every rank: the refusal protocol of the adapters.

A collective's arguments are turned into what the engine takes (op, scaling, zero-copy
views) on each rank alone, so a bad argument on one rank raises there before that
rank's submission exists, and the other ranks would wait for it (forever, by default).
An adapter therefore prepares its submissions inside :class:`refusing`, which announces
an error raised there to the other ranks through the engine, in place of the
submissions it prevented (same kind, same name; unnamed ones take the next number of
their kind, so later unnamed operations stay matched): the other ranks' submissions
fail with :class:`~mpitrain.MismatchError` naming this rank and its error. The engine
announces its own refusals (raised by the submission call itself), so the submission
call is never inside the block. Blocking exchanges that an adapter makes outside the
engine (alltoall, gather, broadcast_object) meet in a rendezvous that the stall
inspector watches, then share each rank's outcome in one small allgather
(:func:`agreed`), before they run MPI's own collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, TypeVar

from ..communicator import Communicator
from ..errors import MismatchError

_T = TypeVar("_T")


class refusing:
    """Prepare this rank's ``kind`` submissions named ``names`` (``None``: unnamed) on
    ``comm`` in the block; if it raises, announce every one of them as refused and
    re-raise. (A class, not a generator: every adapter call enters one.)"""

    __slots__ = ("comm", "kind", "names")

    def __init__(self, comm: Communicator, kind: str, *names: str | None) -> None:
        self.comm, self.kind, self.names = comm, kind, names

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, Exception):
            engine = self.comm.engine()
            for name in self.names:
                engine.refuse(self.kind, name, exc)


@dataclass(frozen=True)
class Refused:
    """What a rank sends in an :func:`agreed` exchange in place of its part: its error."""

    rank: int
    error: str


def agreed(comm: Communicator, exchange: Callable[[Any], list[Any]], rank: int, what: str,
           prepare: Callable[[], tuple[_T, Any]]) -> tuple[_T, list[Any]]:
    """Run ``prepare`` (this rank's checks; it returns a value and the part the other
    ranks see) and ``exchange`` (an allgather) the parts, or this rank's error in place
    of its part, so that an error on any rank ends the collective ``what`` on every rank
    (``rank``: this rank, as the messages name it).

    The ranks meet first in ``comm``'s rendezvous named ``what``, a barrier that the
    stall inspector watches and validation checks: a rank that never calls the
    collective ends it in :class:`~mpitrain.StallError` on the others at the stall
    timeout (where a bare MPI exchange would wait forever), and ranks in different
    collectives of ``comm`` get :class:`~mpitrain.MismatchError`. ``what`` also travels
    with the part, which catches different collectives where validation is off.

    Returns:
        ``prepare``'s value and every rank's part, in rank order.

    Raises:
        Exception: the error ``prepare`` raised, on the rank where it was raised.
        MismatchError: on every other rank, naming that rank and its error; on every
            rank, if the ranks called different collectives.
        StallError: on the ranks that waited past the stall timeout for the others.
    """
    comm.rendezvous(what)
    failure: Exception | None = None
    try:
        value, part = prepare()
    except Exception as exc:
        failure, part = exc, Refused(rank, f"{type(exc).__name__}: {exc}")
    calls, parts = zip(*exchange((what, part)))
    if failure is not None:
        raise failure
    if any(c != what for c in calls):
        raise MismatchError(f"rank {rank}: the ranks called different collectives at once: "
                            + ", ".join(f"rank {r} {c}" for r, c in enumerate(calls))
                            + ". Every rank must make the same collective calls in the "
                            "same order")
    refused = [p for p in parts if isinstance(p, Refused)]
    if refused:
        raise MismatchError(f"rank {rank}: {what} is given up on every rank: "
                            + "; ".join(f"it was refused on rank {p.rank}: {p.error}"
                                        for p in refused)
                            + ". Fix that rank's arguments; the other ranks cannot go on "
                            "without it")
    return value, list(parts)
