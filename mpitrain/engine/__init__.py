"""The async engine: handles, negotiation across ranks, tensor fusion, progress thread.

See :mod:`.engine` for how a cycle works, :mod:`.negotiation` for how ranks agree
on what to run and :mod:`.fusion` for how small operations share one collective.
"""

from .api import AsyncCollectives
from .engine import Engine, EngineStats
from .request import Handle

__all__ = ["AsyncCollectives", "Engine", "EngineStats", "Handle"]
