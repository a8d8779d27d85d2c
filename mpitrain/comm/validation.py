"""Cross-rank validation: every collective's arguments agree on every rank before data moves.

A call's :class:`Signature` holds what every rank must agree on (collective, op, dtype,
shape, root, scaling, name and algorithm) and a 63-bit *fingerprint* of it. Before any
data message, the :class:`Validator` exchanges one fixed-size header per rank,
``[fingerprint, rows, payload bytes, 0]``:

* on one node, through the shared memory of :mod:`.shm` (one barrier; the fingerprint
  sits beside the barrier counters, and a small collective's input can ride in this
  rank's slot, so validating costs nothing extra);
* otherwise, with one ``MPI_Allgather`` of the headers on the private communicator.

The header has the same size on every rank whatever the call, so a disagreement can
never truncate or mismatch a message: it shows as different fingerprints, which every
rank sees. Only then are the full signatures gathered (``allgather`` of objects) to
name the ranks and both values, and :class:`~mpitrain.MismatchError` is raised on
every rank; every rank has left the exchange, so the communicator stays usable.

Allgather's per-rank row counts travel in the same header, so it needs no second
exchange.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import MismatchError
from .objects import allgather_object
from .shm import ADDRESS, FP, HEADER_WORDS, NO_PAYLOAD, PAYLOAD, ROWS, SharedMemory
from .transport import Transport

_FP_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class Signature:
    """What every rank must agree on for one collective call.

    ``shape`` is the whole shape, except for allgather whose axis 0 may differ: there
    it is the trailing shape and ``rows_vary`` is set.
    """

    collective: str
    op: str
    dtype: str
    shape: tuple[int, ...]
    rows_vary: bool
    root: int
    prescale: float
    postscale: float
    name: str
    algorithm: str
    fingerprint: int

    def fields(self) -> dict[str, str]:
        """The human-readable values of every checked field, by field name."""
        dims = ", ".join(str(d) for d in self.shape)
        if self.rows_vary:
            dims = "*" + (", " + dims if dims else "")
        return {
            "collective": self.collective,
            "buffer": f"{self.dtype}[{dims}]" if self.dtype else "",
            "op": self.op,
            "root": str(self.root) if self.root >= 0 else "",
            "scaling": (f"prescale {self.prescale:g} postscale {self.postscale:g}"
                        if self.dtype else ""),
            "name": repr(self.name) if self.name else "",
            "algorithm": self.algorithm,
        }


@functools.lru_cache(maxsize=4096)
def signature(collective: str, op: str = "", dtype: str = "", shape: tuple[int, ...] = (),
              rows_vary: bool = False, root: int = -1, prescale: float = 1.0,
              postscale: float = 1.0, name: str = "", algorithm: str = "") -> Signature:
    """The (cached) :class:`Signature` of a call; its fingerprint is stable across hosts."""
    text = repr((collective, op, dtype, shape, rows_vary, root, float(prescale),
                 float(postscale), name, algorithm))
    fp = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return Signature(collective, op, dtype, shape, rows_vary, root, float(prescale),
                     float(postscale), name, algorithm, (fp & _FP_MASK) | 1)


def mismatch_message(rank: int, fields: list[dict[str, str]]) -> str:
    """Name the ranks that disagree with rank 0 and both values, for every differing field."""
    parts = []
    reference = fields[0]
    same_kind = all(f["collective"] == reference["collective"] for f in fields)
    keys = list(reference) if same_kind else ["collective"]
    for key in keys:
        value = reference[key]
        odd: dict[str, list[int]] = {}
        for r, f in enumerate(fields):
            if f[key] != value:
                odd.setdefault(f[key], []).append(r)
        for other, ranks in odd.items():
            who = (f"rank {ranks[0]}" if len(ranks) == 1
                   else "ranks " + ", ".join(str(r) for r in ranks))
            verb = "called" if key == "collective" else "sent"
            label = "" if key in ("collective", "buffer") else f"{key} "
            parts.append(f"{who} {verb} {label}{other or 'none'}, rank 0 {verb} "
                         f"{label}{value or 'none'}")
    what = (f"ranks disagree on {reference['collective']}'s arguments" if same_kind
            else "ranks called different collectives")
    return (f"rank {rank}: {what}: " + "; ".join(parts) + ". Every rank must call the same "
            "collectives in the same order with the same dtype, shape, op, root, scaling, "
            "name and algorithm")


class Validator:
    """The header exchange that starts every collective (collective to create).

    Args:
        transport: the private communicator's transport (MPI exchanges wait through it).
        shm: the node's shared memory, or ``None`` to exchange with MPI.
    """

    def __init__(self, transport: Transport, shm: SharedMemory | None) -> None:
        self.transport, self.shm = transport, shm
        self.rank, self.size = transport.rank, transport.size
        self._mine = np.zeros(HEADER_WORDS, np.int64)
        self._table = np.zeros((self.size, HEADER_WORDS), np.int64)
        self.parity = 0
        # this rank's words in a shared-memory header (field f of rank r is f * n + r);
        # its fingerprint goes to ``shm.fingerprints`` instead, beside the barrier counters
        n, r = self.size, self.rank
        self._rows_at, self._payload_at = ROWS * n + r, PAYLOAD * n + r
        self._address_at = ADDRESS * n + r

    def exchange(self, sig: Signature | None, rows: int = 0, payload: int = NO_PAYLOAD,
                 address: int = 0) -> int:
        """Publish this rank's header, wait for every rank's, and compare fingerprints.

        Args:
            sig: this call's signature; ``None`` skips the comparison (validation off).
            rows: this rank's row count (allgather); see :meth:`rows`.
            payload: bytes of input this rank left in its shared-memory slot, or
                ``NO_PAYLOAD``; see :meth:`payloads`.
            address: the address of this rank's buffer (an allgather's block, for the
                single-copy algorithm); see :meth:`addresses`.

        Returns:
            The shared-memory parity of this exchange (the slots to read), or ``-1``.

        Raises:
            MismatchError: on every rank, if any two fingerprints differ.
        """
        fp = sig.fingerprint if sig is not None else 0
        shm = self.shm
        if shm is not None:
            p = self.parity = (shm.seq + 1) & 1  # shm.next_parity, without a property call
            words = shm.header_words[p]
            words[self._rows_at] = rows
            words[self._payload_at] = payload
            words[self._address_at] = address
            if not shm.agree(fp) and sig is not None:
                self.raise_mismatch(sig)
            return p
        mine = self._mine
        mine[FP], mine[ROWS], mine[PAYLOAD], mine[ADDRESS] = fp, rows, payload, address
        self.transport.allgather(mine, self._table)
        if sig is not None:
            column = self._table[:, FP]
            if column.min() != column.max():
                self.raise_mismatch(sig)
        return -1

    def meet(self, sig: Signature | None) -> int:
        """:meth:`exchange` for calls that publish nothing but the fingerprint (a barrier,
        a small allreduce whose data sits in its slot): on one node, this rank's row and
        payload words are left as they are (only allgather reads them, after an exchange
        of its own), which saves a third of the work around the barrier.

        Returns:
            The shared-memory parity of this exchange, or ``-1``.
        """
        shm = self.shm
        if shm is None:
            return self.exchange(sig)
        p = self.parity = (shm.seq + 1) & 1
        if not shm.agree(0 if sig is None else sig.fingerprint) and sig is not None:
            self.raise_mismatch(sig)
        return p

    def check(self, sig: Signature) -> None:
        """Validate a call whose data moves separately (:meth:`exchange` without payload)."""
        self.exchange(sig)

    def rows(self) -> list[int]:
        """Every rank's ``rows`` of the last exchange."""
        col = self.shm.headers[self.parity, ROWS] if self.shm is not None \
            else self._table[:, ROWS]
        return col.tolist()

    def payloads(self) -> Any:
        """Every rank's ``payload`` of the last exchange (an int64 array)."""
        if self.shm is not None:
            return self.shm.headers[self.parity, PAYLOAD]
        return self._table[:, PAYLOAD]

    def addresses(self) -> Any:
        """Every rank's ``address`` of the last exchange (an int64 array)."""
        if self.shm is not None:
            return self.shm.headers[self.parity, ADDRESS]
        return self._table[:, ADDRESS]

    def raise_mismatch(self, sig: Signature) -> None:
        """Raise :class:`~mpitrain.MismatchError` naming every disagreeing rank and value
        (collective: every rank of a failed exchange calls it; through the transport, so
        that a rank that never does fails the others at the stall timeout)."""
        fields = allgather_object(self.transport, sig.fields())
        raise MismatchError(mismatch_message(self.rank, fields))
