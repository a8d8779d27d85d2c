"""Node topology of a communicator: which ranks share a host.

A *node* is a group of ranks that share memory (``MPI_COMM_TYPE_SHARED``). Nodes are
numbered by their lowest rank: node 0 holds rank 0, node 1 the lowest rank not on
node 0, and so on. Inside a node, ranks are numbered by rank: ``local_rank``.

``cross_rank`` is the index of this rank's node and ``cross_size`` the number of
nodes, on every layout. Horovod defines them as the rank and size within the group
of ranks that share this rank's local rank; the two definitions agree whenever every
node holds the same number of ranks, and differ only on uneven layouts, where
Horovod's values are not node indices (with 1 rank on node 0 and 3 on node 1, its
``cross_size`` is 1 for local ranks 1 and 2).

Two sub-communicators, split from the communicator's private duplicate:

* ``local_comm``: the ranks of this node, ordered by local rank;
* ``cross_comm``: the ranks with this rank's local rank, one per node, ordered by
  node index. Its size is ``cross_size`` for local ranks below
  :attr:`Topology.min_local_size` (present on every node), smaller above it.

The hierarchical algorithms talk to :attr:`Topology.local` and :attr:`Topology.cross`,
transports over private duplicates of these two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from mpi4py import MPI

from .inspector import StallLimits
from .transport import Transport


@dataclass
class Topology:
    """The node split of a communicator, with the two sub-communicators.

    Attributes:
        nodes: the ranks of each node, by node index; each node's ranks ascending.
        node: index of this rank's node (``cross_rank``).
        local_rank: this rank's index in ``nodes[node]``.
        local_comm, cross_comm: the sub-communicators described in the module text.
        local, cross: transports over private duplicates of them (for algorithms).
    """

    nodes: tuple[tuple[int, ...], ...]
    node: int
    local_rank: int
    local_comm: MPI.Intracomm
    cross_comm: MPI.Intracomm
    local: Transport
    cross: Transport

    @classmethod
    def detect(cls, comm: MPI.Intracomm, stall: StallLimits | None = None,
               elastic: bool = False) -> Topology:
        """Split ``comm`` by shared-memory node (collective over ``comm``); ``stall``
        and ``elastic``: those of the two sub-transports (:class:`Transport`)."""
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        return cls._split(comm, cast(MPI.Intracomm, local), stall, elastic)

    @classmethod
    def from_node_ids(cls, comm: MPI.Intracomm, node_id: int,
                      stall: StallLimits | None = None, elastic: bool = False) -> Topology:
        """Treat the ranks that pass the same ``node_id`` as one node (collective).

        For tests and experiments: it lets one host act as several nodes.
        """
        local = comm.Split(color=node_id, key=comm.Get_rank())
        return cls._split(comm, cast(MPI.Intracomm, local), stall, elastic)

    @classmethod
    def _split(cls, comm: MPI.Intracomm, local: MPI.Intracomm,
               stall: StallLimits | None, elastic: bool) -> Topology:
        rank = comm.Get_rank()
        # Every rank learns the lowest rank of every rank's node: that names the node.
        leaders = comm.allgather(local.allreduce(rank, op=MPI.MIN))
        index = {leader: j for j, leader in enumerate(sorted(set(leaders)))}
        members: list[list[int]] = [[] for _ in index]
        for r, leader in enumerate(leaders):
            members[index[leader]].append(r)
        node, local_rank = index[leaders[rank]], local.Get_rank()
        cross = cast(MPI.Intracomm, comm.Split(color=local_rank, key=node))
        return cls(tuple(tuple(m) for m in members), node, local_rank, local, cross,
                   Transport(local, stall, elastic), Transport(cross, stall, elastic))

    # -- this rank ----------------------------------------------------------------------
    @property
    def local_size(self) -> int:
        """Number of ranks on this node."""
        return len(self.nodes[self.node])

    @property
    def cross_rank(self) -> int:
        """Index of this rank's node (see the module text for Horovod's definition)."""
        return self.node

    @property
    def cross_size(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    # -- the whole layout ---------------------------------------------------------------
    @property
    def node_count(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    @property
    def min_local_size(self) -> int:
        """Ranks on the smallest node: local ranks below it exist on every node."""
        return min(len(ranks) for ranks in self.nodes)

    @property
    def homogeneous(self) -> bool:
        """True when every node holds the same number of ranks."""
        return len({len(ranks) for ranks in self.nodes}) == 1

    def free(self) -> None:
        """Release the sub-communicators and their transports (collective)."""
        self.local.free()
        self.cross.free()
        for c in (self.local_comm, self.cross_comm):
            if c != MPI.COMM_NULL:
                c.Free()
