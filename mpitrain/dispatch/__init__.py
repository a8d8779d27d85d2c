"""The dispatch layer: from a collective call to an algorithm's plan.

* :mod:`.checks`: what a call accepts, checked once for the blocking and the async path;
* :mod:`.selection`: the ordered table of rules that picks an algorithm per call;
* :mod:`.policy`: how a plan's buffers reach MPI (host, CUDA-aware, staged);
* :mod:`.dispatcher`: the :class:`Dispatcher`, which checks a call, picks its
  algorithm, validates it across ranks, runs its cached plan and scales the result.

It sits above :mod:`mpitrain.algorithms` and :mod:`mpitrain.comm`, and below the async
engine and the :class:`~mpitrain.Communicator` facade, which both own dispatchers.
"""

from .checks import Call, Checks
from .dispatcher import Dispatcher
from .policy import device_policy
from .selection import DEFAULT_RULES, Rule, Table, dump_rules, load_rules

__all__ = ["DEFAULT_RULES", "Call", "Checks", "Dispatcher", "Rule", "Table", "device_policy",
           "dump_rules", "load_rules"]
