"""Hierarchical collectives: shared memory inside a node, one shard per rank across nodes.

The node split comes from the :class:`~mpitrain.comm.topology.Topology`: ``local``
is the transport over the ranks of this node, ``cross`` the one over the ranks with
this rank's local rank, one per node. Only the first ``columns`` local ranks (the
size of the smallest node) exist on every node, so the buffer is cut into
``columns`` *columns*: local rank ``i < columns`` handles column ``i`` across nodes,
and the local ranks above (only on larger nodes) take part inside their node only.

* **Allreduce**: the buffer is cut into one shard per *crossing* rank: the first
  ``MPITRAIN_CROSS_RANKS`` local ranks (default 1; 0: all ``columns``). Intra-node
  reduce-scatter: crossing local rank ``i`` gets its node's sum of shard ``i`` (the
  others keep nothing). Inter-node allreduce of shard ``i`` among the local ranks
  ``i`` of all nodes, every crossing rank at once: recursive doubling (a single
  exchange) for two nodes or small shards, the ring otherwise. Intra-node allgather
  of the shards. With one crossing rank per node (like Open MPI's ``coll/han``) each
  pair of nodes talks over one connection; with several, the shards cross in
  parallel over as many connections, whose flows contend for the link: that pays
  only where one process cannot fill a node's link (BENCHMARKS.md, "Multi-node",
  measures both settings).
  Between two nodes, a large buffer is cut into *pieces* (:func:`piece_count`) that
  overlap: the shards of piece ``p`` start across nodes
  as soon as it is reduce-scattered, while piece ``p + 1`` is; a shard goes to the
  node's other ranks (one non-blocking send to each, so that no rank waits for a
  slower one) as soon as it is final, while later shards are still between nodes.
* **Reduce-scatter** and **allgather** keep their contract (rank ``r`` gets, or
  gives, chunk ``r``). Every rank belongs to column ``local_rank % columns``; the
  *packed* layout orders the chunks by column, then node, then rank, so that a
  column is contiguous and, inside it, so is each node's *block* (the chunks of that
  node's ranks in the column). Reduce-scatter packs, reduce-scatters the columns
  inside the node, reduce-scatters each column's node blocks across nodes, and the
  column's first rank on the node (its *representative*) hands the other ranks of
  its block their chunk. Allgather runs the same steps backwards. Where the packed
  layout is the rank order (one node, or one rank per node) no copy is made.

Where two ranks exchange both ways over one connection (recursive doubling, and the
ring between two nodes), inter-node messages are at most
``MPITRAIN_INTER_SEGMENT_BYTES`` (60 KiB), below the eager limit of Open MPI's TCP
transport (64 KiB). Larger messages go by rendezvous: the sender waits for the
receiver's go-ahead, which travels back on the same TCP connection as the receiver's
own bulk data in the other direction and queues behind it; exchanges then run one
direction at a time, up to twice as slow. The ring on three or more nodes sends each
way on different connections and keeps the usual segments (tiny ones cost it more
in per-message overhead than they save).

With one node the inter-node phase is empty and each collective is its flat
intra-node form; with one rank per node the intra-node phases are empty.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..comm.topology import Topology
from ..comm.transport import Request, Transport
from .base import Plan, PlanRequest, Signature
from .chunks import Bounds, bounds_from_counts, split_bounds
from .native import NativeAllgather, NativeReduceScatter
from .ring import RingAllgather, RingAllreduce, RingReduceScatter
from .segmented_doubling import SegmentedDoublingAllreduce

# Shards up to this size cross nodes by recursive doubling (fewer rounds); larger
# ones by the ring (fewer bytes), except between two nodes, where both send the same.
DOUBLING_MAX_BYTES = 64 << 10
DELIVER_TAG = 31
GATHER_TAG = 32
# Large allreduces run in up to MAX_PIECES pieces of at least PIECE_BYTES, pipelined.
PIECE_BYTES = 2 << 20
MAX_PIECES = 8

_FLAT = {
    "reduce_scatter": {"ring": RingReduceScatter, "mpi": NativeReduceScatter},
    "allgather": {"ring": RingAllgather, "mpi": NativeAllgather},
}


def inter_segment_bytes(segment_bytes: int, limit: int) -> int:
    """Segment size of the inter-node phases: ``limit`` (``MPITRAIN_INTER_SEGMENT_BYTES``),
    or the general ``segment_bytes`` where that is smaller (or ``limit`` is 0)."""
    if limit == 0 or 0 < segment_bytes < limit:
        return segment_bytes
    return limit


def _phase(collective: str, req: PlanRequest, transport: Transport, chunks: list[Bounds],
           algorithm: str | None = None, segment_bytes: int | None = None) -> Any:
    """A flat plan of ``collective`` over ``transport``: ``algorithm`` or the table's."""
    sub = dataclasses.replace(req, transport=transport, chunks=tuple(chunks),
                              segment_bytes=req.segment_bytes if segment_bytes is None
                              else segment_bytes)
    if algorithm is None:
        algorithm = req.choose(collective, sub.count * req.dtype.itemsize, transport.size,
                               req.backend.name, tuple(_FLAT[collective]))
    return _FLAT[collective][algorithm](sub)


def _begin(topo: Topology, collective: str) -> None:
    """Count a collective on both sub-transports (their stall inspectors report it)."""
    topo.local.begin(collective)
    topo.cross.begin(collective)


def _inter_allreduce(req: PlanRequest, cross: Transport, count: int) -> Any:
    """The allreduce of one shard of ``count`` elements across nodes."""
    sub = dataclasses.replace(req, transport=cross,
                              chunks=tuple(split_bounds(count, cross.size)))
    if cross.size == 2 or count * req.dtype.itemsize <= DOUBLING_MAX_BYTES:
        # Pairs exchange both ways on one connection: keep the messages eager.
        return SegmentedDoublingAllreduce(dataclasses.replace(
            sub, segment_bytes=inter_segment_bytes(req.segment_bytes, req.inter_segment_bytes)))
    return _Blocking(RingAllreduce(sub))


class _Blocking:
    """``start``/``finish`` for a plan that only runs to completion."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def start(self, src: Any, out: Any) -> None:
        """Run the plan."""
        self.plan.run(src, out)

    def finish(self) -> None:
        """Nothing left to do."""


def cross_columns(topo: Topology, wanted: int) -> int:
    """How many local ranks of each node carry the allreduce across nodes: ``wanted``
    (``MPITRAIN_CROSS_RANKS``; 0 or more than the smallest node: every rank there)."""
    if wanted <= 0:
        return topo.min_local_size
    return min(wanted, topo.min_local_size)


def piece_count(nbytes: int) -> int:
    """How many pieces an allreduce of ``nbytes`` is pipelined in."""
    return max(1, min(MAX_PIECES, nbytes // PIECE_BYTES))


class _Piece:
    """One piece ``[lo, hi)`` of the buffer through the three allreduce phases."""

    def __init__(self, req: PlanRequest, lo: int, hi: int) -> None:
        topo = req.topology
        columns, self.local = cross_columns(topo, req.cross_ranks), topo.local
        n = hi - lo
        shards = split_bounds(n, columns) + [(n, n)] * (self.local.size - columns)
        self.lo, self.hi = lo, hi
        # Absolute element range of every local rank's shard of this piece.
        self.shards = [(lo + a, lo + b) for a, b in shards]
        self.shard = self.shards[self.local.rank]
        self.peers = [r for r in range(self.local.size) if r != self.local.rank]
        self.as_bytes = req.backend.as_bytes
        # Our ring reads and writes the same buffer safely: it runs in place.
        self.rs = _phase("reduce_scatter", req, self.local, shards, "ring")
        self.inter = _inter_allreduce(req, topo.cross, shards[self.local.rank][1] -
                                      shards[self.local.rank][0]) \
            if self.local.rank < columns and topo.cross.size > 1 else None

    def reduce_scatter(self, src: Any, out: Any) -> None:
        """Intra-node: this rank's shard of the piece gets the node's sum."""
        lo, hi = self.shard
        self.rs.run(src[self.lo:self.hi], out[lo:hi])

    def start_inter(self, out: Any) -> None:
        """Inter-node: start the allreduce of the shard (in place)."""
        if self.inter is not None:
            lo, hi = self.shard
            self.inter.start(out[lo:hi], out[lo:hi])

    def finish_inter(self) -> None:
        """Inter-node: complete it."""
        if self.inter is not None:
            self.inter.finish()

    def receive_shards(self, out: Any) -> list[Request]:
        """Intra-node allgather, first half: post the receives of the other shards."""
        return [self.local.irecv(self.as_bytes(out[self.shards[r][0]:self.shards[r][1]]),
                                 r, GATHER_TAG)
                for r in self.peers if self.shards[r][1] > self.shards[r][0]]

    def send_shard(self, out: Any) -> list[Request]:
        """Intra-node allgather, second half: send the finished shard to the others."""
        lo, hi = self.shard
        if hi == lo:
            return []
        return [self.local.isend(self.as_bytes(out[lo:hi]), r, GATHER_TAG) for r in self.peers]


class HierarchicalAllreduce(Plan):
    """Intra-node reduce-scatter, inter-node allreduce per shard, intra-node allgather,
    pipelined over pieces of the buffer."""

    def __init__(self, req: PlanRequest) -> None:
        self.topology = req.topology
        # Only the two-node exchange runs in the background (start/finish); with more
        # nodes the ring runs to completion and pieces would only add pipeline fills.
        n_pieces = piece_count(req.count * req.dtype.itemsize) \
            if self.topology.node_count == 2 else 1
        pieces = split_bounds(req.count, n_pieces)
        self.pieces = [_Piece(req, lo, hi) for lo, hi in pieces]

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks)``; ``src`` may be ``out`` (in place)."""
        _begin(self.topology, "hierarchical allreduce")
        gather: list[Request] = []
        for piece in self.pieces:
            piece.reduce_scatter(src, out)  # its sends are done: out may now be received
            gather += piece.receive_shards(out)
            piece.start_inter(out)
        for piece in self.pieces:
            piece.finish_inter()
            gather += piece.send_shard(out)
        self.topology.local.waitall(gather)


@dataclasses.dataclass
class ColumnLayout:
    """Where every rank's chunk sits in the packed layout, and this rank's part in it.

    Attributes:
        packed: packed element range of each rank's chunk (indexed by rank).
        columns: packed range of each column; ranks ``>= len(columns)`` of a node get
            an empty range, so the list has one entry per local rank.
        node_blocks: range of each node's block inside this rank's column, relative
            to the column start (empty unless this rank is a representative).
        members: ``(local rank, start, stop)`` of the chunks of this rank's block,
            relative to the block start; the first is this rank's own.
        representative: local rank that holds this rank's block.
        identity: True when the packed layout is the rank order.
    """

    packed: list[Bounds]
    columns: list[Bounds]
    node_blocks: list[Bounds]
    members: list[tuple[int, int, int]]
    representative: int
    identity: bool

    @classmethod
    def plan(cls, req: PlanRequest) -> ColumnLayout:
        """The layout of ``req.chunks`` (one per rank) on ``req.topology``."""
        topo, counts = req.topology, req.counts
        ncols = topo.min_local_size

        def block(node: int, col: int) -> list[int]:
            return list(topo.nodes[node][col::ncols])

        order = [r for col in range(ncols) for node in range(topo.node_count)
                 for r in block(node, col)]
        packed_of = dict(zip(order, bounds_from_counts([counts[r] for r in order])))
        packed = [packed_of[r] for r in range(len(counts))]
        col_sizes = [sum(counts[r] for node in range(topo.node_count)
                         for r in block(node, col)) for col in range(ncols)]
        columns = bounds_from_counts(col_sizes)
        columns += [(columns[-1][1], columns[-1][1])] * (topo.local_size - ncols)
        mine = topo.local_rank % ncols
        ranks = block(topo.node, mine)
        members = [(topo.nodes[topo.node].index(r), lo, hi) for r, (lo, hi)
                   in zip(ranks, bounds_from_counts([counts[r] for r in ranks]))]
        node_blocks = bounds_from_counts([sum(counts[r] for r in block(node, mine))
                                          for node in range(topo.node_count)]) \
            if topo.local_rank < ncols else []
        return cls(packed, columns, node_blocks, members, mine,
                   packed == list(req.chunks))

    @property
    def block_count(self) -> int:
        """Elements of this rank's block."""
        return self.members[-1][2]

    @property
    def own_count(self) -> int:
        """Elements of this rank's own chunk."""
        return self.members[0][2] - self.members[0][1]


class _ColumnPlan(Plan):
    """What hierarchical reduce-scatter and allgather share: layout and buffers."""

    def __init__(self, req: PlanRequest, collective: str) -> None:
        self.topology = topo = req.topology
        be, dt = req.backend, req.dtype
        self.local, self.backend = topo.local, be
        self.layout = lay = ColumnLayout.plan(req)
        self.chunks = list(req.chunks)
        self.is_rep = topo.local_rank < topo.min_local_size
        nodes = topo.node_count
        self.intra = _phase(collective, req, topo.local, lay.columns)
        # Across nodes our ring: it keeps to the inter-node segment size (MPI's own
        # collectives send large messages whole, by rendezvous).
        # On two nodes the ring is an exchange both ways on one connection: eager.
        segment = inter_segment_bytes(req.segment_bytes, req.inter_segment_bytes)
        self.inter = _phase(collective, req, topo.cross, lay.node_blocks, "ring",
                            segment if nodes == 2 else None) \
            if self.is_rep and nodes > 1 else None
        # The block goes straight to/from the caller's buffer when it is one chunk.
        self.own_block = lay.block_count == lay.own_count
        lo, hi = lay.columns[topo.local_rank]
        self.column = be.empty(hi - lo if nodes > 1 else 0, dt)
        self.block = be.empty(lay.block_count if self.is_rep and not self.own_block else 0, dt)
        self.packed = be.empty(0 if lay.identity else req.count, dt)

    def deliver(self, block: Any) -> list[Request | None]:
        """Representative: send the other members of the block their chunks."""
        as_bytes = self.backend.as_bytes
        return [self.local.isend(as_bytes(block[lo:hi]), member, DELIVER_TAG)
                for member, lo, hi in self.layout.members[1:] if hi > lo]

    def collect(self, block: Any) -> list[Request | None]:
        """Representative: receive the other members' chunks into the block."""
        as_bytes = self.backend.as_bytes
        return [self.local.irecv(as_bytes(block[lo:hi]), member, DELIVER_TAG)
                for member, lo, hi in self.layout.members[1:] if hi > lo]


class HierarchicalReduceScatter(_ColumnPlan):
    """Pack, intra-node reduce-scatter of columns, inter-node reduce-scatter of node
    blocks, hand-out of the block's chunks."""

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req, "reduce_scatter")

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = this rank's reduced chunk of ``src``."""
        _begin(self.topology, "hierarchical reduce_scatter")
        be, lay = self.backend, self.layout
        packed = src
        if not lay.identity:
            packed = self.packed
            for (lo, hi), (plo, phi) in zip(self.chunks, lay.packed):
                be.copy_into(packed[plo:phi], src[lo:hi])
        if not self.is_rep:
            self.intra.run(packed, self.column)
            if out.size:
                self.local.wait(self.local.irecv(be.as_bytes(out), lay.representative,
                                                 DELIVER_TAG))
            return
        block = out if self.own_block else self.block
        if self.inter is None:
            self.intra.run(packed, block)
        else:
            self.intra.run(packed, self.column)
            self.inter.run(self.column, block)
        if not self.own_block:
            sends = self.deliver(block)
            be.copy_into(out, block[:lay.own_count])
            self.local.waitall(sends)


class HierarchicalAllgather(_ColumnPlan):
    """Collection of the block's chunks, inter-node allgather of node blocks,
    intra-node allgather of columns, unpack."""

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req, "allgather")

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = concatenation of every rank's ``block``."""
        _begin(self.topology, "hierarchical allgather")
        be, lay = self.backend, self.layout
        packed = out if lay.identity else self.packed
        if self.is_rep:
            mine = block
            if not self.own_block:
                mine = self.block
                recvs = self.collect(mine)
                if block.size:
                    be.copy_into(mine[:lay.own_count], block)
                self.local.waitall(recvs)
            column = mine
            if self.inter is not None:
                self.inter.run(mine, self.column)
                column = self.column
            self.intra.run(column, packed)
        else:
            if block.size:
                self.local.wait(self.local.isend(be.as_bytes(block), lay.representative,
                                                 DELIVER_TAG))
            self.intra.run(self.column, packed)
        if not lay.identity:
            for (lo, hi), (plo, phi) in zip(self.chunks, lay.packed):
                be.copy_into(out[lo:hi], packed[plo:phi])
