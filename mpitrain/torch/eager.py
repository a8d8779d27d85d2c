"""What ``torch.compile`` sees of mpitrain's torch adapters: nothing inside them.

TorchDynamo traces every Python frame that a compiled region runs into, including
frames that torch starts from C++: DDP's reducer calling a Python process group's
``allreduce``, a functional collective's ``wait_tensor`` calling ``Work.wait``. Traced,
mpitrain's code is either refused (a process group's attributes) or, worse, compiled
around its own state (handle tables, locks, counters). The entry points are therefore
wrapped in ``torch.compiler.disable``, which runs them (and whatever they call)
eagerly: a compiled region breaks its graph at the call, as at any collective of a
backend written in C++ (Horovod's ops, gloo's), and compiles what comes before and
after it. Outside a compiled region the wrapper adds one function call and a switch
of TorchDynamo's frame hook to each call.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, TypeVar

import torch

_Class = TypeVar("_Class", bound=type)
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def eager(fn: _Fn) -> _Fn:
    """``fn``, run eagerly under ``torch.compile`` (with everything it calls)."""
    wrapped: _Fn = torch.compiler.disable(fn)
    return wrapped


def eager_methods(*private: str) -> Callable[[_Class], _Class]:
    """Class decorator: the public methods and property getters that the class defines,
    and those of the ``private`` names (the ones torch calls), run eagerly
    (:func:`eager`). The class's own helpers are not wrapped: they run inside those
    entry points, eagerly already, and each wrapper costs a collective's hot path."""
    def wrap(cls: _Class) -> _Class:
        for name, member in list(vars(cls).items()):
            if name.startswith("_") and name not in private:
                continue
            if inspect.isfunction(member):
                setattr(cls, name, eager(member))
            elif isinstance(member, property) and member.fget is not None:
                setattr(cls, name, property(eager(member.fget), member.fset, member.fdel,
                                            member.__doc__))
        return cls
    return wrap


def eager_functions(namespace: dict[str, Any], names: Iterable[str]) -> None:
    """Make the functions ``names`` of a module's ``namespace`` (its ``globals()``)
    run eagerly (:func:`eager`); other names (classes, constants) are left as they are."""
    for name in names:
        if inspect.isfunction(namespace[name]):
            namespace[name] = eager(namespace[name])
