"""The dispatch layer: from a collective call to an algorithm's plan.

* :mod:`.selection`: the ordered table of rules that picks an algorithm per call;
* :mod:`.policy`: how a plan's buffers reach MPI (host, CUDA-aware, staged);
* :mod:`.dispatcher`: the :class:`Dispatcher`, which checks a call, picks its
  algorithm, validates it across ranks, runs its cached plan and scales the result.

It sits above :mod:`mpitrain.algorithms` and :mod:`mpitrain.comm`, and below the async
engine and the :class:`~mpitrain.Communicator` facade, which both own dispatchers.
"""

from .dispatcher import Dispatcher
from .policy import device_policy, policy_for
from .selection import DEFAULT_RULES, Rule, dump_rules, load_rules, select

__all__ = ["DEFAULT_RULES", "Dispatcher", "Rule", "device_policy", "dump_rules", "load_rules",
           "policy_for", "select"]
