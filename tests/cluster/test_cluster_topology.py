"""The node split on separate (emulated) hosts matches the hosts the ranks run on.

``CLUSTER_LAYOUT`` (set by tests/cluster/run.sh) is the number of ranks on each host,
in host order, e.g. ``2,3,1``; without it only the hostnames are checked.
"""

from __future__ import annotations

import os
import socket

import pytest
from helpers import assert_all_ranks

import mpitrain as mt


def hosts_of_ranks(comm: mt.Communicator) -> list[str]:
    """The hostname of every rank."""
    return comm.allgather_object(socket.gethostname())


@pytest.mark.mpi(min_size=1)
def test_nodes_are_hosts(comm: mt.Communicator) -> None:
    hosts = hosts_of_ranks(comm)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    want = sorted(tuple(ranks) for ranks in by_host.values())  # nodes by lowest rank
    topo = comm.topology
    mine = by_host[hosts[comm.rank]]
    ok = (list(topo.nodes) == want and comm.cross_size == len(want) == topo.node_count
          and want[comm.cross_rank] == tuple(mine) and comm.local_size == len(mine)
          and comm.local_rank == mine.index(comm.rank))
    assert_all_ranks(comm, ok, f"on {hosts[comm.rank]}: local {comm.local_rank}/"
                               f"{comm.local_size} cross {comm.cross_rank}/{comm.cross_size}, "
                               f"nodes {topo.nodes}, hosts {hosts}")
    assert (mt.local_rank(), mt.local_size(), mt.cross_rank(), mt.cross_size()) == \
        (comm.local_rank, comm.local_size, comm.cross_rank, comm.cross_size)


@pytest.mark.mpi(min_size=1)
def test_layout_as_launched(comm: mt.Communicator) -> None:
    layout = os.environ.get("CLUSTER_LAYOUT")
    if not layout:
        pytest.skip("CLUSTER_LAYOUT is not set")
    want = [int(n) for n in layout.split(",")]
    got = [len(ranks) for ranks in comm.topology.nodes]
    assert_all_ranks(comm, got == want, f"ranks per node {got}, launched as {want}")
    assert comm.topology.homogeneous == (len(set(want)) == 1)


@pytest.mark.mpi(min_size=1)
def test_sub_communicators(comm: mt.Communicator) -> None:
    """local_comm is this host; cross_comm has this local rank of each host, in node order."""
    topo = comm.topology
    local_hosts = set(topo.local_comm.allgather(socket.gethostname()))
    members = topo.cross_comm.allgather((comm.cross_rank, comm.local_rank))
    want = [(j, comm.local_rank) for j, ranks in enumerate(topo.nodes)
            if len(ranks) > comm.local_rank]
    assert_all_ranks(comm, local_hosts == {socket.gethostname()} and members == want,
                     f"local hosts {local_hosts}, cross members {members}, want {want}")
    assert topo.local.size == comm.local_size and topo.cross.size == len(want)
