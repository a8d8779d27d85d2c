"""The narrow transport the algorithms talk to.

A :class:`Transport` owns a private duplicate of the user's communicator, so that
mpitrain's messages can never match a message of the user's (or of another
mpitrain communicator). Algorithms only post non-blocking sends and receives of
raw bytes to ranks of this communicator and wait for them.
"""

from __future__ import annotations

from typing import Any, Sequence

from mpi4py import MPI

Request = MPI.Request


class Transport:
    """Point-to-point byte transport on a private communicator.

    Args:
        comm: the communicator to duplicate; the transport never uses it directly.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm: MPI.Intracomm = comm.Dup()
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.right: int = (self.rank + 1) % self.size
        self.left: int = (self.rank - 1) % self.size
        # Bound methods: the hot loops call these without attribute lookups on MPI.
        self.isend = self.comm.Isend
        self.irecv = self.comm.Irecv

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``."""
        self.comm.Sendrecv(sendbuf, dest, tag, recvbuf, source, tag)

    def send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of ``buf`` to ``dest``."""
        self.comm.Send(buf, dest, tag)

    def recv(self, buf: Any, source: int, tag: int = 0) -> None:
        """Blocking receive into ``buf`` from ``source``."""
        self.comm.Recv(buf, source, tag)

    @staticmethod
    def waitall(requests: Sequence[Request | None]) -> None:
        """Wait for every request that is not ``None``."""
        live = [r for r in requests if r is not None]
        if live:
            MPI.Request.Waitall(live)

    def free(self) -> None:
        """Release the private communicator (collective)."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
