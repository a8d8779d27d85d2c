"""The comm layer: communicator, transport and topology."""

from .communicator import Communicator
from .topology import Topology
from .transport import Transport

__all__ = ["Communicator", "Topology", "Transport"]
