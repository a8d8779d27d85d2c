"""The staging transport and the fake device it is tested with, on one process.

The transport sends to itself over ``MPI.COMM_SELF``. The fake device
(``tests/fake_device.py``) runs stream work late and in random orders, so a missing
event or synchronization shows up as poisoned bytes: the last tests break the
transport on purpose and check that the fake device catches it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fake_device import (
    POISON,
    FakeBackend,
    FakeDevice,
    FakeDeviceArray,
    _Marker,
    to_device,
)
from mpi4py import MPI

from mpitrain.comm.staging import DeviceDirectTransport, StagingTransport
from mpitrain.comm.transport import Transport
from mpitrain.dispatch.policy import largest_segment_bytes
from mpitrain.errors import MpitrainError

TAG = 5
SEEDS = range(12)


@pytest.fixture
def self_transport() -> Any:
    """A transport whose only rank sends to itself (one per test: a failing test's
    leftover messages cannot reach the next)."""
    transport = Transport(MPI.COMM_SELF)
    yield transport
    transport.free()


def payloads(seed: int, count: int = 9) -> list[np.ndarray[Any, Any]]:
    """Messages of different lengths (0 included) and contents."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, size=int(rng.integers(0, 40))).astype(np.float32)
            for _ in range(count)]


def exchange(transport: Any, be: FakeBackend, messages: list[np.ndarray[Any, Any]],
             forward: bool = False) -> list[np.ndarray[Any, Any]]:
    """Produce each message on the device, send it to ourselves, receive it, and
    (``forward``) send what was received on once more. What arrived last is consumed by
    a queued "kernel" right after its ``Wait()``, as the ring's reduction does; returns
    what that kernel saw."""
    device = be.fake
    outs, recvs, sends = [], [], []
    for data in messages:
        src = be.empty(data.size, data.dtype)
        be.copy_into(src, data)  # the "kernel" producing the message, queued
        out = be.empty(data.size, data.dtype)
        recvs.append(transport.irecv(be.as_bytes(out), 0, TAG))
        sends.append(transport.isend(be.as_bytes(src), 0, TAG))
        outs.append(out)
    finals = outs
    if forward:
        finals = [be.empty(o.size, o.dtype) for o in outs]
        again = [transport.irecv(be.as_bytes(f), 0, TAG + 1) for f in finals]
        for req, out in zip(recvs, outs):
            req.Wait()
            sends.append(transport.forward(req, be.as_bytes(out), 0, TAG + 1))
        recvs = again
    seen = [be.empty(f.size, f.dtype) for f in finals]
    for req, final, copy in zip(recvs, finals, seen):
        req.Wait()
        be.copy_into(copy, final)
    transport.waitall(sends)
    device.current.synchronize()
    return [np.asarray(c).view(np.ndarray).copy() for c in seen]


# -- the fake device itself -------------------------------------------------------------
def test_fake_stream_work_runs_late_in_order() -> None:
    device = FakeDevice(seed=1)
    be = FakeBackend(device)
    with device.default:
        x = be.empty(4, np.int32)
        be.copy_into(x, np.arange(4, dtype=np.int32))
        be.scale(x, 2.0)
        assert np.all(x.view(np.uint8) == POISON), "queued work ran before any sync"
        device.default.synchronize()
    assert np.array_equal(x, [0, 2, 4, 6])
    assert device.idle()


def test_fake_events_order_streams_and_catch_missing_waits() -> None:
    stale = 0
    for seed in range(40):
        device = FakeDevice(seed=seed)
        be = FakeBackend(device)
        other = device.new_stream()
        src = be.empty(8, np.int64)
        be.copy_into(src, np.arange(8))
        ordered, unordered = np.zeros(8, np.int64), np.zeros(8, np.int64)
        event = device.new_event()
        event.record(device.default)
        other.wait_event(event)
        device.copy_to_host(ordered.view(np.uint8), src.view(np.uint8), other)
        racing = device.new_stream()  # no wait_event: may copy before src is written
        device.copy_to_host(unordered.view(np.uint8), src.view(np.uint8), racing)
        other.synchronize()
        racing.synchronize()
        assert np.array_equal(ordered, np.arange(8)), f"seed {seed}"
        stale += not np.array_equal(unordered, np.arange(8))
    assert 0 < stale < 40, "the fake device must interleave streams both ways"


def test_fake_device_reports_deadlock() -> None:
    device = FakeDevice()
    never = device.new_event()
    never.record(device.new_stream())
    device.streams[-1].queue.appendleft(("wait", _Marker(), 0))  # a marker nothing reaches
    device.default.wait_event(never)
    with pytest.raises(RuntimeError, match="fake device deadlock"):
        device.default.synchronize()


# -- the staging transport --------------------------------------------------------------
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_staging_delivers_every_message_in_order(self_transport: Transport, slots: int) -> None:
    for seed in SEEDS:
        be = FakeBackend(FakeDevice(seed=seed))
        messages = payloads(seed)
        staging = StagingTransport(self_transport, be.fake, 40 * 4, slots)
        with be.fake.default:
            got = exchange(staging, be, messages)
        for i, (want, have) in enumerate(zip(messages, got)):
            assert np.array_equal(have, want), f"seed {seed} slots {slots} message {i}"
        assert not staging.unposted_sends and not staging.queued_recvs


@pytest.mark.parametrize("slots", [2, 8])
def test_sends_reach_mpi_in_call_order(self_transport: Transport, slots: int) -> None:
    """Equal-sized messages: one posted out of order would swap contents silently."""
    messages = [np.full(4, i, np.float32) for i in range(24)]
    for seed in SEEDS:
        be = FakeBackend(FakeDevice(seed=seed))
        staging = StagingTransport(self_transport, be.fake, 16, slots)
        with be.fake.default:
            got = exchange(staging, be, messages, forward=seed % 2 == 1)
        order = [int(g[0]) for g in got]
        assert order == list(range(24)), f"seed {seed}: arrived as {order}"


@pytest.mark.parametrize("slots", [1, 3])
def test_forward_never_holds_the_receive_slot(self_transport: Transport, slots: int) -> None:
    """A forward leaves the receive's slot to the receive alone (a slot held until a
    rendezvous send completes deadlocks the ring at 3+ ranks), and delivers the bytes."""
    for seed in SEEDS:
        be = FakeBackend(FakeDevice(seed=seed))
        messages = payloads(seed, 6)
        staging = StagingTransport(self_transport, be.fake, 40 * 4, slots)
        with be.fake.default:
            outs = [be.empty(m.size, m.dtype) for m in messages]
            finals = [be.empty(m.size, m.dtype) for m in messages]
            sends = []
            for data, out in zip(messages, outs):
                src = be.empty(data.size, data.dtype)
                be.copy_into(src, data)
                recv = staging.irecv(be.as_bytes(out), 0, TAG)
                sends.append(staging.isend(be.as_bytes(src), 0, TAG))
                recv.Wait()
                users = recv.slot.users if recv.slot is not None else 0
                sends.append(staging.forward(recv, be.as_bytes(out), 0, TAG + 1))
                assert recv.slot is None or recv.slot.users == users <= 1, f"seed {seed}"
            for req in [staging.irecv(be.as_bytes(f), 0, TAG + 1) for f in finals]:
                req.Wait()
            staging.waitall(sends)
            be.fake.default.synchronize()
        for want, have in zip(messages, finals):
            assert np.array_equal(np.asarray(have).view(np.ndarray), want), f"seed {seed}"


def test_forward_copies_on_the_host_when_a_send_slot_is_free(self_transport: Transport) -> None:
    """With a send slot free and no send queued, the received bytes go to it host to
    host: nothing is copied back from the device."""
    for seed in SEEDS:
        device = FakeDevice(seed=seed)
        be = FakeBackend(device)
        from_device: list[int] = []

        def counted(dst: Any, src: Any, stream: Any, real: Any = device.copy_to_host,
                    log: list[int] = from_device) -> None:
            log.append(src.nbytes)
            real(dst, src, stream)

        device.copy_to_host = counted  # type: ignore[method-assign]
        staging = StagingTransport(self_transport, device, 64, 2)
        with device.default:
            data = to_device(np.arange(16, dtype=np.float32))
            out, final = be.empty(16, np.float32), be.empty(16, np.float32)
            again = staging.irecv(be.as_bytes(final), 0, TAG + 1)
            recv = staging.irecv(be.as_bytes(out), 0, TAG)
            staging.isend(be.as_bytes(data), 0, TAG).Wait()
            recv.Wait()
            forwarded = staging.forward(recv, be.as_bytes(out), 0, TAG + 1)
            again.Wait()
            forwarded.Wait()
            device.default.synchronize()
        assert from_device == [64], f"seed {seed}: {from_device}"
        assert np.array_equal(np.asarray(final).view(np.ndarray), np.arange(16)), f"seed {seed}"


def test_receive_waits_for_earlier_readers_of_its_buffer(self_transport: Transport) -> None:
    for seed in SEEDS:
        be = FakeBackend(FakeDevice(seed=seed))
        staging = StagingTransport(self_transport, be.fake, 64, 2)
        with be.fake.default:
            buf = to_device(np.arange(8, dtype=np.int64))
            seen = be.empty(8, np.int64)
            be.fake.default.enqueue(lambda seen=seen, buf=buf: np.copyto(seen, buf),
                                    ticks=1000)  # a long-running reader of buf ...
            recv = staging.irecv(be.as_bytes(buf), 0, TAG)  # ... then buf is received into
            src = to_device(np.full(8, -1, dtype=np.int64))
            with be.fake.new_stream():  # the message does not wait for the reader
                send = staging.isend(be.as_bytes(src), 0, TAG)
            recv.Wait()
            send.Wait()
            be.fake.default.synchronize()
        assert np.array_equal(seen, np.arange(8)), f"seed {seed}: receive overtook a reader"
        assert np.array_equal(buf, np.full(8, -1)), f"seed {seed}"


def test_staging_rejects_messages_larger_than_a_slot(self_transport: Transport) -> None:
    be = FakeBackend(FakeDevice())
    staging = StagingTransport(self_transport, be.fake, 16, 1)
    with pytest.raises(MpitrainError, match="does not fit the 16-byte staging slots"):
        staging.isend(be.as_bytes(be.empty(5, np.float32)), 0, TAG)
    with pytest.raises(ValueError, match="MPITRAIN_STAGING_SLOTS"):
        StagingTransport(self_transport, be.fake, 16, 0)


def test_direct_transport_synchronizes_before_mpi(self_transport: Transport) -> None:
    for seed in SEEDS:
        be = FakeBackend(FakeDevice(seed=seed))
        direct = DeviceDirectTransport(self_transport, be.fake)
        messages = payloads(seed, 5)
        with be.fake.default:
            got = exchange(direct, be, messages, forward=True)
        for want, have in zip(messages, got):
            assert np.array_equal(have, want), f"seed {seed}"


def test_largest_segment_matches_the_ring_layout() -> None:
    from mpitrain.algorithms.base import PlanRequest

    def request(chunks: tuple[tuple[int, int], ...], segment_bytes: int) -> PlanRequest:
        return PlanRequest(None, None, None, np.dtype(np.float32), None, chunks,  # type: ignore[arg-type]
                           0, segment_bytes)

    assert largest_segment_bytes(request(((0, 4), (4, 7), (7, 10)), 0)) == 16
    assert largest_segment_bytes(request(((0, 4), (4, 7), (7, 10)), 8)) == 8
    assert largest_segment_bytes(request(((0, 5), (5, 9)), 8)) == 8  # 5 -> 3 segments: 2,2,1
    assert largest_segment_bytes(request(((0, 0), (0, 0)), 8)) == 0


# -- breaking the transport on purpose: the fake device must notice -----------------------
def broken_runs(make: Any, self_transport: Transport, seeds: range = range(30)) -> int:
    """How many seeds deliver wrong data through the transport ``make`` builds."""
    wrong = 0
    for seed in seeds:
        be = FakeBackend(FakeDevice(seed=seed))
        messages = [m for m in payloads(seed) if m.size] or [np.ones(3, np.float32)]
        with be.fake.default:
            got = exchange(make(be.fake), be, messages)
        wrong += any(not np.array_equal(h, w) for h, w in zip(got, messages))
    return wrong


def test_fake_device_catches_a_send_that_skips_the_producer_event(
        self_transport: Transport) -> None:
    def make(device: FakeDevice) -> StagingTransport:
        staging = StagingTransport(self_transport, device, 160, 2)
        staging.d2h.wait_event = lambda event: None  # type: ignore[method-assign]
        return staging

    assert broken_runs(make, self_transport) > 0


def test_fake_device_catches_a_direct_send_without_synchronization(
        self_transport: Transport) -> None:
    def make(device: FakeDevice) -> DeviceDirectTransport:
        direct = DeviceDirectTransport(self_transport, device)
        direct._settle = lambda: None  # type: ignore[method-assign]
        return direct

    assert broken_runs(make, self_transport) > 0


def test_fake_arrays_stay_fake() -> None:
    be = FakeBackend(FakeDevice())
    x = to_device(np.arange(6.0))
    assert be.owns(x) and be.owns(x[2:]) and not be.owns(np.arange(3))
    assert isinstance(be.empty(3, np.float64), FakeDeviceArray)
