"""The comm layer: what the algorithms sit on.

The transport on a private duplicated communicator (:mod:`.transport`) and its stall
inspector (:mod:`.inspector`), the node's shared memory (:mod:`.shm`), the node
split (:mod:`.topology`), cross-rank validation (:mod:`.validation`), object
collectives (:mod:`.objects`) and the device transports that stage through pinned
host memory (:mod:`.staging`).
"""

from .topology import Topology
from .transport import Transport

__all__ = ["Topology", "Transport"]
