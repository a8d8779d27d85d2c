"""Node topology of a communicator: which ranks share a host.

``local`` groups the ranks of one shared-memory node (``MPI_COMM_TYPE_SHARED``);
``cross`` groups the ranks with the same local rank across nodes. With ``L`` ranks
on each of ``N`` nodes, ``cross_size == N`` and ``cross_rank`` is the node index.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI


@dataclass
class Topology:
    """The node split of a communicator, with the two sub-communicators."""

    local_comm: MPI.Comm
    cross_comm: MPI.Comm
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    node_count: int
    homogeneous: bool

    @classmethod
    def detect(cls, comm: MPI.Intracomm) -> Topology:
        """Split ``comm`` by node (collective over ``comm``)."""
        rank = comm.Get_rank()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank, local_size = local.Get_rank(), local.Get_size()
        cross = comm.Split(color=local_rank, key=rank)
        # Node count = number of local rank-0s; homogeneous when all nodes are equal.
        sizes = comm.allgather(local_size if local_rank == 0 else 0)
        node_sizes = [s for s in sizes if s]
        return cls(local, cross, local_rank, local_size, cross.Get_rank(), cross.Get_size(),
                   len(node_sizes), len(set(node_sizes)) == 1)

    def free(self) -> None:
        """Release the sub-communicators."""
        for c in (self.local_comm, self.cross_comm):
            if c != MPI.COMM_NULL:
                c.Free()
