"""A communicator's device-to-device links, and the one place that says which can run.

Device buffers reach the other ranks one of four ways; which one a call takes is
decided here, from facts every rank shares (:class:`Layout`), and by the selection
table among the algorithms these facts allow:

* ``ipc``: every rank on one node, each able to map the others' device memory (the
  same GPU, or peers with P2P access): the ``ipc`` algorithms (:mod:`.ipc`);
* ``nccl``: NCCL (through ``cupy.cuda.nccl``) on every rank: the ``nccl`` algorithms
  (:mod:`.nccl`). ``auto`` takes it only where no two ranks share a device; two ranks
  of one GPU run it only when asked by name, and only when each has its own
  ``NCCL_HOSTID`` (NCCL refuses them otherwise);
* CUDA-aware MPI, where the library says it is, and otherwise staging through pinned
  host memory: the transfer policies of :mod:`mpitrain.dispatch.policy`, under every
  other algorithm.

``MPITRAIN_DEVICE_LINKS`` (a communicator's setting) limits the links: ``auto`` (both),
``ipc``, ``nccl`` or ``none`` (MPI only). The :class:`Layout` is found once per
communicator and backend, by a collective exchange at the first device call (not when
the communicator is made: Horovod scripts choose their GPU after ``init()``), and
shown in benchmark headers (:meth:`Layout.describe`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import objects
from .ipc import IpcPeers
from .nccl import NcclLink, nccl_version
from .shm import SharedMemory
from .topology import Topology
from .transport import Transport

LINKS = ("auto", "ipc", "nccl", "none")
"""The values of ``MPITRAIN_DEVICE_LINKS``."""


@dataclass(frozen=True)
class Layout:
    """Where every rank's device is and which links can join them (the same on every
    rank).

    Attributes:
        devices: each rank's device identity (its PCI bus id; the fake device's name).
        ipc: every rank is on one node with shared memory and can map every other
            rank's device memory.
        nccl: every rank has NCCL, and NCCL can run here: no two ranks share a device,
            or those that do have different ``NCCL_HOSTID`` values.
        shared: some ranks share a device.
        why: why a link cannot run (empty when both can).
    """

    devices: tuple[str, ...]
    ipc: bool
    nccl: bool
    shared: bool
    why: str = ""

    def runnable(self, link: str) -> bool:
        """True if the link can carry calls here."""
        return bool(getattr(self, link))

    def preferred(self, link: str) -> bool:
        """True if ``auto`` may choose the link: runnable, and for NCCL only where every
        rank has its own device (NCCL between ranks of one GPU crawls)."""
        return self.runnable(link) and not (link == "nccl" and self.shared)

    def describe(self) -> str:
        """One line for logs and benchmark headers."""
        links = [name for name in ("ipc", "nccl") if self.runnable(name)]
        where = "one device" if len(set(self.devices)) == 1 else \
            f"{len(set(self.devices))} devices"
        return (f"device links {'+'.join(links) or 'none'} ({len(self.devices)} ranks on "
                f"{where}{'; ' + self.why if self.why else ''})")


class DeviceLinks:
    """The device links of one communicator: its :class:`Layout` per backend, its IPC
    mappings and its NCCL communicator, each made on first use.

    Args:
        transport: the communicator's private transport.
        topology: its node split.
        shm: the node's shared memory (None when the ranks span nodes or it is off).
        allowed: ``MPITRAIN_DEVICE_LINKS``.
    """

    def __init__(self, transport: Transport, topology: Topology, shm: SharedMemory | None,
                 allowed: str = "auto") -> None:
        self.transport, self.topology, self.shm = transport, topology, shm
        self.allowed = allowed
        self.layouts: dict[str, Layout] = {}
        self._ipc: dict[Any, IpcPeers] = {}
        self._nccl: dict[Any, NcclLink] = {}

    def layout(self, backend: Any) -> Layout | None:
        """The layout of ``backend``'s devices, once found (None before)."""
        return self.layouts.get(backend.name)

    def probe(self, backend: Any, collective: str) -> Layout:
        """Find the layout of ``backend``'s devices (collective: every rank calls it at
        the same call, its first device ``collective`` on this communicator, in whose
        name a stall is reported)."""
        found = self.layouts.get(backend.name)
        if found is not None:
            return found
        self.transport.begin(collective)
        device = backend.device()
        identity = str(getattr(device, "identity", f"{backend.name}:{backend.device_id()}"))
        mine = (identity, hasattr(device, "export"), nccl_version(),
                os.environ.get("NCCL_HOSTID", ""))
        every = objects.allgather_object(self.transport, mine)
        devices = tuple(e[0] for e in every)
        shared = len(set(devices)) < len(devices)
        why: list[str] = []
        ipc = self.allowed in ("auto", "ipc") and self.shm is not None and all(e[1] for e in every)
        if ipc:  # can this rank map every other rank's device? then every rank's answer
            maps = all(device.can_map(d) for d in devices)
            ipc = all(objects.allgather_object(self.transport, maps))
            if not ipc:
                why.append("ipc: a rank cannot map another's device (no P2P access)")
        elif self.allowed in ("auto", "ipc"):
            why.append("ipc: " + ("ranks on several nodes or shared memory off"
                                  if self.shm is None else "the device cannot export memory"))
        versions = {e[2] for e in every}  # one NCCL on every rank: the same dtypes reduce
        nccl = self.allowed in ("auto", "nccl") and None not in versions and len(versions) == 1
        if nccl and shared:
            sharing = [e for e in every if devices.count(e[0]) > 1]
            hostids = [e[3] for e in sharing]
            if not all(hostids) or len({(e[0], e[3]) for e in sharing}) < len(sharing):
                nccl = False
                why.append("nccl: ranks share a device (NCCL runs them only with a "
                           "different NCCL_HOSTID per rank)")
        elif not nccl and self.allowed in ("auto", "nccl"):
            why.append("nccl: cupy.cuda.nccl missing on some rank" if None in versions else
                       f"nccl: the ranks have different NCCL versions {sorted(versions)}")
        if self.allowed != "auto":
            why.append(f"MPITRAIN_DEVICE_LINKS={self.allowed}")
        layout = Layout(devices, ipc, nccl, shared, "; ".join(why))
        self.layouts[backend.name] = layout
        return layout

    def ipc(self, device: Any) -> IpcPeers:
        """This rank's mappings of its peers' memory on ``device``."""
        assert self.shm is not None, "the ipc link needs the node's shared memory"
        peers = self._ipc.get(device.id)
        if peers is None:
            peers = self._ipc[device.id] = IpcPeers(self.shm, device)
        return peers

    def nccl(self, device: Any) -> NcclLink:
        """The NCCL link of ``device`` (its communicator is made at its first call)."""
        link = self._nccl.get(device.id)
        if link is None:
            link = self._nccl[device.id] = NcclLink(self.transport, device)
        return link

    def free(self) -> None:
        """Unmap the peers' memory and destroy the NCCL communicators (local)."""
        for peers in self._ipc.values():
            peers.close()
        for link in self._nccl.values():
            link.free()
        self._ipc.clear()
        self._nccl.clear()
