"""How the negotiator encodes a cycle's announcements, and decodes other ranks'."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from mpi4py import MPI

from mpitrain.engine.negotiation import Negotiator, generated_name, is_generated
from mpitrain.engine.request import Waiters


class Spec:
    def __init__(self, signature: str) -> None:
        self.signature = signature


class Req:
    """What the negotiator reads of a request."""

    def __init__(self, spec: Spec, kind: str = "allreduce", serial: int = -1,
                 name: str = "") -> None:
        self.spec, self.serial = spec, serial
        self.name = name or f"{kind}.noname.{serial}"


def negotiator() -> Negotiator:
    return Negotiator(MPI.COMM_SELF, 0.001, Waiters())


def decoded(neg: Negotiator, announcements: list[Any]) -> list[tuple[str, str]]:
    """The (name, signature) pairs another rank's payload puts in the table, in order."""
    neg._record(1, memoryview(pickle.dumps(announcements)))
    pairs = [(name, sigs[1]) for name, sigs in neg.table.items()]
    neg.table.clear()
    return pairs


def test_consecutive_generated_names_of_one_spec_are_one_run() -> None:
    a, b = Spec("allreduce sum float32[4]"), Spec("allreduce sum float64[4]")
    reqs = [Req(a, serial=n) for n in range(5, 105)]
    neg = negotiator()
    out, fresh = neg._announce(reqs)
    assert out == [["allreduce", 5, 100, a.signature]]
    assert fresh == []
    assert len(pickle.dumps(out, pickle.HIGHEST_PROTOCOL)) < 150  # not 100 pairs of text
    assert decoded(neg, out) == [(r.name, a.signature) for r in reqs]
    # a change of spec (hence of kind), a gap or a step back in the serials, or a given
    # name, starts a new item
    reqs = [Req(a, serial=0), Req(a, serial=1), Req(b, serial=2), Req(b, serial=4),
            Req(a, name="w", serial=-1), Req(b, serial=5), Req(a, "allgather", serial=6),
            Req(a, serial=3)]
    out, fresh = neg._announce(reqs)
    assert out == [["allreduce", 0, 2, a.signature], ["allreduce", 2, 1, b.signature],
                   ["allreduce", 4, 1, b.signature], ("w", a.signature),
                   ["allreduce", 5, 1, b.signature], ["allgather", 6, 1, a.signature],
                   ["allreduce", 3, 1, a.signature]]
    assert fresh == [("w", a.signature)]
    assert decoded(neg, out) == [(r.name, r.spec.signature) for r in reqs]


def test_given_names_are_sent_by_number_once_agreed() -> None:
    a = Spec("allreduce sum float32[4]")
    neg = negotiator()
    neg.remember("w1", a.signature)
    reqs = [Req(a, name="w0"), Req(a, name="w1"), Req(a, serial=9), Req(a, name="w2")]
    out, fresh = neg._announce(reqs)
    assert out == [("w0", a.signature), 0, ["allreduce", 9, 1, a.signature],
                   ("w2", a.signature)]
    assert fresh == [("w0", a.signature), ("w2", a.signature)]
    assert decoded(neg, out) == [(r.name, a.signature) for r in reqs]


def test_a_cycle_agrees_and_numbers_the_given_names() -> None:
    """One rank: every cycle is 'the same' on all ranks; given names get numbers in
    announcement order, generated ones never do."""
    a = Spec("allreduce sum float32[4]")
    neg = negotiator()
    reqs = [Req(a, serial=0), Req(a, name="g0"), Req(a, serial=1), Req(a, name="g1")]
    agreement = neg.exchange(reqs, False, 1 << 20)
    assert agreement.same and agreement.news
    assert agreement.ready == [r.name for r in reqs]
    assert neg.known == [("g0", a.signature), ("g1", a.signature)]
    out, fresh = neg._announce(reqs)
    assert out == [["allreduce", 0, 1, a.signature], 0, ["allreduce", 1, 1, a.signature], 1]
    assert fresh == []


def test_only_generated_names_go_unnumbered() -> None:
    """Generated names never repeat and are not numbered; a given name that contains
    ``.noname.`` (the torch adapter's default parameter names) repeats every step and is
    numbered like any other."""
    assert generated_name("allreduce", 7) == "allreduce.noname.7"
    assert is_generated("allreduce.noname.7") and is_generated("grouped_allreduce.noname.0")
    for given in ("allreduce.noname.0.3", "w", "allreduce.noname.", "x.noname.7b"):
        assert not is_generated(given), given
    a = Spec("allreduce sum float32[4]")
    neg = negotiator()
    neg.exchange([Req(a, name="allreduce.noname.0.3"), Req(a, serial=0)], False, 1 << 20)
    assert neg.known == [("allreduce.noname.0.3", a.signature)]
    neg.remember("allreduce.noname.1", a.signature)
    assert len(neg.known) == 1


def test_stalled_names_are_reported_then_given_up(caplog: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A name some ranks announced and others did not: warned past the warning (naming
    the missing ranks), proposed for giving up past the timeout, and given up (with
    the entries a stopping rank never announced) by :meth:`Negotiator._abandon`. The
    clock is the test's: it moves only when the test moves it."""
    import logging
    import time

    from mpitrain.engine.negotiation import STALL_CHECK_S, Agreement

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    neg = negotiator()
    neg.size, neg.warning_s, neg.timeout_s = 3, 1.0, 5.0
    a = Spec("allreduce sum float32[4]")
    neg.cycle = 7
    neg._record(0, memoryview(pickle.dumps([("old", a.signature)])))
    neg.cycle = 9
    neg._record(1, memoryview(pickle.dumps([("new", a.signature)])))
    neg._record(2, memoryview(pickle.dumps([("new", a.signature)])))
    neg.born["old"] = (7, clock[0] - 6.0)  # past the timeout
    neg.born["new"] = (9, clock[0] - 2.0)  # past the warning only
    with caplog.at_level(logging.WARNING, logger="mpitrain"):
        expire = neg._check_stalls([])
    assert expire == 7
    (record,) = caplog.records
    assert "'old' (allreduce sum float32[4]) has waited 6 s for rank(s) [1, 2]" in record.message
    assert "'new' (allreduce sum float32[4]) has waited 2 s for rank(s) [0]" in record.message
    assert "At 5 s (the stall timeout) they are given up" in record.message
    clock[0] += STALL_CHECK_S / 2
    assert neg._check_stalls([]) == -1  # looked at most every STALL_CHECK_S
    clock[0] += STALL_CHECK_S / 2
    assert neg._check_stalls([]) == 7 and len(caplog.records) == 1  # again, warned once
    agreement = Agreement([], {}, False, False, 0)
    neg._abandon(agreement, expire, stopped=[])
    assert list(agreement.abandoned) == ["old"] and agreement.stalled == {"old"}
    assert "rank(s) [1, 2], which did not submit it" in agreement.abandoned["old"]
    assert list(neg.table) == ["new"] and list(neg.born) == ["new"]
    agreement = Agreement([], {}, False, False, 0)
    neg._abandon(agreement, -1, stopped=[0])  # rank 0 stops without announcing 'new'
    assert agreement.stalled == set()
    assert "rank(s) [0] stopped their async engine" in agreement.abandoned["new"]
    assert not neg.table and not neg.born and not neg.warned


def test_a_joined_rank_is_not_waited_for() -> None:
    """With rank 0 in join(), a name ranks 1 and 2 submitted is ready (rank 0 missing,
    to stand in), one only rank 1 submitted waits for rank 2 alone; the cycle in which
    every rank has joined ends the join with the last rank to join."""
    from mpitrain.engine.negotiation import Agreement

    neg = negotiator()
    neg.size = 3
    neg.table = {"both": {1: "s", 2: "s"}, "one": {1: "s"}, "odd": {2: "t", 1: "s"}}
    neg.born = {name: (1, 0.0) for name in neg.table}
    agreement = Agreement([], {}, False, False, 0)
    neg._join_state(agreement, [0])
    neg._collect(agreement)
    assert agreement.ready == ["both", "odd"]
    assert agreement.missing == {"both": [0], "odd": [0]}
    assert agreement.mismatched == {"odd": {2: "t", 1: "s"}}
    assert list(neg.table) == ["one"] and neg.waiting_for("one") == [2]
    assert not agreement.all_joined
    later = Agreement([], {}, False, False, 0)
    neg._join_state(later, [0, 1, 2])  # ranks 1 and 2 join in the same cycle
    assert later.all_joined and later.last_joined == 2
    assert neg.waiting_for("one") == [0, 2]  # the join is over: rank 0 counts again


def test_identity_of_each_op() -> None:
    """What a joined rank contributes: the op's identity after the prescale factor."""
    import numpy as np

    from mpitrain.engine.engine import identity
    from mpitrain.ops import ReduceOp

    assert identity(ReduceOp.SUM, np.float32) == 0
    assert identity(ReduceOp.AVERAGE, np.int64, 3.0) == 0
    assert identity(ReduceOp.PRODUCT, np.int32) == 1
    assert identity(ReduceOp.PRODUCT, np.float64, 4.0) == 0.25
    assert identity(ReduceOp.MIN, np.float16) == np.inf
    assert identity(ReduceOp.MIN, np.float32, -2.0) == -np.inf  # times -2: +inf
    assert identity(ReduceOp.MAX, np.int8) == -128
    assert identity(ReduceOp.MIN, np.uint16) == 65535
    assert identity(ReduceOp.MAX, np.bool_) is False
    assert identity(ReduceOp.MAX, np.float32, 0.0) == 0
