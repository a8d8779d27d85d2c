"""hvd.elastic (mpitrain/torch/elastic.py) without MPI traffic: the sampler's partitions
and records across a change of size, and TorchState's commit/restore."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

import mpitrain as mt
import mpitrain.torch as hvd
from mpitrain.errors import ArgumentError, ResetRequired
from mpitrain.torch import elastic as hvd_elastic


@dataclass
class FakeComm:
    size: int
    rank: int


def at(monkeypatch: pytest.MonkeyPatch, size: int, rank: int) -> None:
    """Make the sampler see a default communicator of ``size`` ranks, as ``rank``."""
    monkeypatch.setattr(hvd_elastic.session, "default_communicator",
                        lambda: FakeComm(size, rank))


def samplers(monkeypatch: pytest.MonkeyPatch, size: int, n: int,
             state: dict | None = None) -> list[hvd.elastic.ElasticSampler]:
    out = []
    for rank in range(size):
        at(monkeypatch, size, rank)
        sampler = hvd.elastic.ElasticSampler(range(n), shuffle=True, seed=5)
        if state is not None:
            sampler.load_state_dict(state)
        out.append(sampler)
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 24])
def test_the_ranks_partition_the_epoch(monkeypatch: pytest.MonkeyPatch, size: int,
                                       n: int) -> None:
    parts = [list(s) for s in samplers(monkeypatch, size, n)]
    assert len({len(p) for p in parts}) <= 1  # every rank runs the same number of steps
    seen = Counter(i for p in parts for i in p)
    assert set(seen) == set(range(n))
    assert sum(seen.values()) - n == (-n) % size if n else not seen  # padding only


@pytest.mark.parametrize(("before", "after", "batches"), [(4, 3, 2), (5, 2, 1), (3, 1, 3),
                                                          (2, 5, 0)])
def test_every_sample_once_across_a_change_of_size(monkeypatch: pytest.MonkeyPatch,
                                                   before: int, after: int,
                                                   batches: int) -> None:
    n, batch = 60, 4
    first = samplers(monkeypatch, before, n)
    seen: Counter[int] = Counter()
    for b in range(batches):
        for sampler in first:
            seen.update(sampler.get_indices(b, batch))
            sampler.record_batch(b, batch)
    states = [s.state_dict() for s in first]
    assert all(st == states[0] for st in states)  # record_batch records every rank's batch
    assert len(states[0]["processed_indices"]) == batches * batch * before
    second = samplers(monkeypatch, after, n, states[0])
    for sampler in second:
        seen.update(iter(sampler))
    padding = (-(n - batches * batch * before)) % after
    assert set(seen) == set(range(n))
    assert sum(seen.values()) == n + padding
    assert max(seen.values()) <= 2


def test_set_epoch_keeps_the_epoch_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    (sampler,) = samplers(monkeypatch, 1, 20)
    order0 = list(sampler)
    sampler.record_batch(0, 5)
    sampler.set_epoch(0)  # again, as after a reset: the recorded batch stays done
    assert list(sampler) == order0[5:]
    sampler.set_epoch(1)
    assert len(list(sampler)) == 20 and list(sampler) != order0
    sampler.record_indices([next(iter(sampler))])
    assert len(sampler) == 20  # the pass in progress goes on; a reset leaves it out
    sampler.reset()
    assert len(sampler) == 19
    at(monkeypatch, 1, 0)
    plain = hvd.elastic.ElasticSampler(range(6), shuffle=False)
    assert list(plain) == list(range(6))


def test_bad_batch_arguments_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    (sampler,) = samplers(monkeypatch, 1, 10)
    with pytest.raises(ArgumentError, match="batch_size >= 1"):
        sampler.record_batch(0, 0)
    with pytest.raises(ArgumentError, match="batch_idx=-1"):
        sampler.get_indices(-1, 2)


def test_torch_state_commits_and_restores_model_optimizer_and_values() -> None:
    mt.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(range(10), seed=1)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, batch=0)
    state.commit()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    sampler.record_batch(0, 4)
    state.epoch, state.batch = 1, 7
    assert state.epoch == 1 and state.model is model
    state.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k])
    assert optimizer.state_dict()["state"] == {}
    assert (state.epoch, state.batch) == (0, 0) and not sampler.processed_indices
    state.batch = 3
    state.save()
    state.batch = 4
    state.restore()
    assert state.batch == 3
    state.check_host_updates()  # nothing failed
    with pytest.raises(AttributeError, match="no entry 'missing'"):
        _ = state.missing


def test_run_calls_the_function_with_the_torch_state() -> None:
    state = hvd.elastic.ObjectState(step=0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append("reset")])

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState, steps: int) -> int:
        while state.step < steps:
            state.step += 1
            state.commit()
        return int(state.step)

    assert train(state, 3) == 3 and calls == []
    with pytest.raises(ArgumentError, match="TorchState or ObjectState"):
        train(mt.elastic.State(step=0), 3)


def test_horovods_errors_take_the_reset_path() -> None:
    for error in (hvd.elastic.HorovodInternalError, hvd.elastic.HostsUpdatedInterrupt):
        assert issubclass(error, ResetRequired)
        assert mt.elastic.recoverable(error("lost a rank"))
    assert not mt.elastic.recoverable(ValueError("bug"))


def test_horovods_order_count_and_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler gives Horovod's order (``random.Random(seed + epoch).shuffle``),
    counts ``processed_num`` as Horovod does (every rank's batch), and loads Horovod's
    state, ``{"epoch", "processed_num"}``: the epoch's first samples are done. After a
    restore, ``record_batch`` counts from the first sample left, whatever its index."""
    import random

    def horovod_order(n: int, seed: int, epoch: int) -> list[int]:
        order = list(range(n))
        random.Random(seed + epoch).shuffle(order)
        return order

    size, n, batch = 3, 30, 2
    for epoch in (0, 4):
        order = horovod_order(n, 5, epoch)
        parts = samplers(monkeypatch, size, n, {"epoch": epoch, "processed_num": 0})
        assert [list(p) for p in parts] == [order[r::size] for r in range(size)]
    (sampler,) = samplers(monkeypatch, 1, n)[:1]
    sampler.set_epoch(2)
    for b in range(3):
        sampler.record_batch(b, batch)
        assert sampler.processed_num == batch * (b + 1)
    assert sampler.state_dict()["processed_num"] == 3 * batch
    parts = samplers(monkeypatch, size, n, {"epoch": 2, "processed_num": 12})
    left = horovod_order(n, 5, 2)[12:]
    assert [list(p) for p in parts] == [left[r::size] for r in range(size)]
    for p in parts:
        p.record_batch(5, batch)  # (any index: batches are counted)
    assert all(p.processed_num == 12 + batch * size for p in parts)
    assert all(p.processed_indices == set(horovod_order(n, 5, 2)[:12 + batch * size])
               for p in parts)
