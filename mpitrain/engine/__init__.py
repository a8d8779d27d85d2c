"""The async engine: handles, negotiation across ranks, tensor fusion, progress thread.

See :mod:`.engine` for how a cycle works, :mod:`.negotiation` for how ranks agree
on what to run and :mod:`.fusion` for how small operations share one collective.

Those modules and :mod:`.request` may be compiled to C extensions (mypyc, see
``setup.py``); :func:`compiled` says whether they are, and importing the package
refuses compiled modules that are older than their sources.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from .._builds import REBUILD, check_source
from . import engine as _engine_module
from . import fusion as _fusion_module
from . import negotiation as _negotiation_module
from . import request as _request_module
from .engine import JOIN_SERVES_ALL, Engine, EngineStats
from .request import Handle

_CORE = (_request_module, _fusion_module, _negotiation_module, _engine_module)


def _built() -> list[ModuleType]:
    """The core modules loaded from compiled extensions (not from ``.py`` files)."""
    return [m for m in _CORE if not str(m.__file__).endswith(".py")]


def compiled() -> bool:
    """True if the engine's core modules run as compiled extensions."""
    return len(_built()) == len(_CORE)


def _check_compiled() -> None:
    """Raise ImportError if a compiled module was built from other source than the
    ``.py`` file beside it (an edit since the last build)."""
    built = _built()
    if not built:
        return
    here = Path(__file__).parent
    instead = f"delete {here}/*.so to run the sources"
    try:
        from ._compiled import SOURCES
    except ImportError:
        raise ImportError(f"mpitrain.engine: compiled modules without the manifest of "
                          f"their sources ({here}/_compiled.py); {REBUILD} or "
                          f"{instead}") from None
    for module in built:
        name = module.__name__.rpartition(".")[2] + ".py"
        check_source("mpitrain.engine", name, here / name, SOURCES.get(name), instead)


_check_compiled()

__all__ = ["JOIN_SERVES_ALL", "Engine", "EngineStats", "Handle", "compiled"]
