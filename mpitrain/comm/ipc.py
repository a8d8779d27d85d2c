"""Mapping other ranks' device buffers (CUDA IPC) for the ``ipc`` algorithms.

Each call, every rank writes a *record* for each buffer its peers will read: the
:class:`~mpitrain.backends.device.Export` of the buffer (the handle of the allocation
that holds it, the allocation's address in the owner, the buffer's offset in it) at
the head of its slot of the node's shared-memory window, at the parity of the next
barrier; after that barrier every rank reads the others' records. A record is in one
of three states: exported, empty (a zero-length buffer: nothing to map), or not
exportable (memory from a stream-ordered pool, ``cudaMallocAsync``, or another
allocator without handles); a call goes device to device only if no record is in the
last state, which every rank sees alike.

Mapping a handle costs far more than a call (CUDA: ~90 us), so mappings are cached
per peer, keyed by the allocation's address and identity (CUDA: its buffer id; handles
of one allocation need not be equal byte for byte). Allocators reuse addresses: when a
peer frees an allocation and gets a new one at the same address, the new one has
another identity, and the mapping of the old one (which still shows the old memory)
is closed as soon as a record names the new one. At most :data:`CACHE_PER_PEER` mappings are
kept per peer, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from ..backends.device import Export, IpcDevice
from .shm import SharedMemory

HANDLE_BYTES = 64
"""Bytes of a handle (``cudaIpcMemHandle_t``)."""
CACHE_PER_PEER = 64
"""Mappings kept per peer."""
NOT_EXPORTABLE, EXPORTED, EMPTY = 0, 1, 2
_STATE, _BASE, _IDENTITY, _OFFSET = 0, 1, 2, 3  # int64 words before the handle
_WORDS = 4
_INT63 = (1 << 63) - 1  # what an int64 word holds of an unsigned 64-bit value
RECORD_BYTES = _WORDS * 8 + HANDLE_BYTES


def _record_view(slot: Any, index: int) -> tuple[Any, Any]:
    """The words and the handle bytes of record ``index`` in a rank's slot."""
    start = index * RECORD_BYTES
    return (slot[start:start + _WORDS * 8].view(np.int64),
            slot[start + _WORDS * 8:start + RECORD_BYTES])


class IpcPeers:
    """The records of one communicator's node and this rank's mappings of its peers'
    allocations (one per communicator and device).

    Args:
        shm: the node's shared-memory window (every rank of the communicator on it).
        device: this rank's device.
    """

    def __init__(self, shm: SharedMemory, device: IpcDevice) -> None:
        self.shm, self.device = shm, device
        self.rank = shm.rank
        # per peer: (base, identity) -> mapping, least recently used first
        self.mapped: list[OrderedDict[tuple[int, int], Any]] = [
            OrderedDict() for _ in range(shm.size)]
        self.identities: list[dict[int, int]] = [{} for _ in range(shm.size)]  # base -> id
        self.opens = 0
        """Handles mapped so far (a test reads it to see the cache work)."""

    def publish(self, buffers: Sequence[Any]) -> int:
        """Write this rank's records of ``buffers`` for the next barrier; returns its
        parity (pass it to :meth:`ready` and :meth:`array`)."""
        parity = self.shm.next_parity
        slot = self.shm.slot(parity, self.rank)
        for index, buf in enumerate(buffers):
            words, handle = _record_view(slot, index)
            found: Export | None = self.device.export(buf) if buf.size else None
            if buf.size == 0:
                words[_STATE] = EMPTY
            elif found is None:
                words[_STATE] = NOT_EXPORTABLE
            else:
                words[_STATE], words[_BASE] = EXPORTED, found.base & _INT63
                words[_IDENTITY], words[_OFFSET] = found.identity & _INT63, found.offset
                handle[:] = np.frombuffer(found.handle.ljust(HANDLE_BYTES, b"\0"), np.uint8)
        return parity

    def ready(self, parity: int, records: int) -> bool:
        """True if every rank's first ``records`` records of ``parity`` can be mapped
        (read after the barrier that follows :meth:`publish`; the same on every rank)."""
        for q in range(self.shm.size):
            slot = self.shm.slot(parity, q)
            for index in range(records):
                if _record_view(slot, index)[0][_STATE] == NOT_EXPORTABLE:
                    return False
        return True

    def array(self, parity: int, q: int, index: int, lo: int, count: int,
              dtype: np.dtype[Any]) -> Any:
        """Elements ``lo:lo+count`` of rank ``q``'s buffer ``index`` (its record of
        ``parity``) as a device array mapped into this process."""
        words, handle = _record_view(self.shm.slot(parity, q), index)
        mapping = self._mapping(q, int(words[_BASE]), int(words[_IDENTITY]), handle)
        return self.device.view(mapping, int(words[_OFFSET]) + lo * dtype.itemsize, count, dtype)

    def _mapping(self, q: int, base: int, identity: int, handle: Any) -> Any:
        cache, key = self.mapped[q], (base, identity)
        mapping = cache.get(key)
        if mapping is not None:
            cache.move_to_end(key)
            return mapping
        stale = self.identities[q].get(base)
        if stale is not None and (base, stale) in cache:  # the peer reused the address
            self.device.close(cache.pop((base, stale)))
        if len(cache) >= CACHE_PER_PEER:
            self.device.close(cache.popitem(last=False)[1])
        mapping = self.device.open(bytes(handle))
        self.opens += 1
        cache[key] = mapping
        self.identities[q][base] = identity
        return mapping

    def close(self) -> None:
        """Unmap every mapping."""
        for cache in self.mapped:
            while cache:
                self.device.close(cache.popitem()[1])
        for identities in self.identities:
            identities.clear()
