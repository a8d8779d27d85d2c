"""mt.elastic.State without MPI traffic: commit, restore, checkpoints, recovery helpers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.elastic import State, rank_failure
from mpitrain.elastic.state import from_arrays, to_arrays
from mpitrain.trainer.optimizers import SGD, Adam, Parameter


def test_restore_writes_arrays_in_place_and_rolls_back_everything() -> None:
    w = np.arange(4.0)
    layers = {"a": np.ones(2), "b": [np.zeros(3), 7]}
    state = State(w=w, layers=layers, epoch=0, tag="x")
    state.commit()
    w += 10
    layers["a"][:] = -1
    layers["b"][0][1] = 5
    layers["c"] = np.ones(1)
    state.epoch = 3
    state.tag = "y"
    state.restore()
    assert state.w is w and np.array_equal(w, np.arange(4.0))
    assert state.layers is layers and set(layers) == {"a", "b"}
    assert np.array_equal(layers["a"], np.ones(2)) and np.array_equal(layers["b"][0], np.zeros(3))
    assert state.epoch == 0 and state.tag == "x" and state.commits == 1


def test_snapshots_are_deep_copies() -> None:
    w = np.zeros(3)
    state = State(w=w)
    state.commit()
    w[0] = 1.0
    state.commit()
    w[0] = 2.0
    state.restore()
    assert w[0] == 1.0 and state.commits == 2


def test_stateful_objects_numpy_optimizers() -> None:
    p = Parameter(np.ones(3), "w")
    for opt in (SGD([p], lr=0.1, momentum=0.9), Adam([p], lr=0.1)):
        state = State(params=p.data, optimizer=opt)
        p.grad = np.full(3, 0.5)
        opt.step()
        state.commit()
        committed = (p.data.copy(), opt.state_dict()["steps"])
        opt.step()
        opt.step()
        state.restore()
        assert np.array_equal(p.data, committed[0]) and opt.steps == committed[1]
        again = State(params=p.data, optimizer=opt).capture()
        p.data += 1  # the snapshot does not alias the live arrays
        assert not np.array_equal(again["params"], p.data)


def test_torch_module_and_optimizer() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        net(torch.ones(4, 3)).pow(2).sum().backward()
        opt.step()

    step()
    state = State(model=net, optimizer=opt, batch=1)
    state.commit()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    want_avg = opt.state_dict()["state"][0]["exp_avg"].clone()
    step()
    step()
    state.batch = 3
    state.restore()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in want.items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], want_avg) and state.batch == 1
    step()  # the optimizer's state does not alias the snapshot
    state.restore()
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], want_avg)
    tensors = to_arrays(state.capture())
    back = from_arrays(tensors)
    assert isinstance(back["model"]["weight"], torch.Tensor)
    assert torch.equal(back["model"]["weight"], want["weight"])


def test_durable_checkpoint_round_trip(tmp_path: Path) -> None:
    w = np.arange(5.0)
    state = State(checkpoint=str(tmp_path), checkpoint_every=2, w=w, step=0)
    for step in range(1, 6):
        w += 1
        state.step = step
        state.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000002.safetensors",
                                                          "ckpt-000000004.safetensors"]
    fresh = State(checkpoint=str(tmp_path), checkpoint_every=2, w=np.zeros(5), step=0)
    assert fresh.load_checkpoint()
    assert fresh.commits == 4 and fresh.step == 4
    assert np.array_equal(fresh.w, np.arange(5.0) + 4)
    assert not State(checkpoint=str(tmp_path / "none"), w=np.zeros(1)).load_checkpoint()


def test_bad_use() -> None:
    with pytest.raises(mt.ArgumentError, match="commit is a reserved name"):
        State(commit=1)
    with pytest.raises(mt.ArgumentError, match="checkpoint_every must be >= 1"):
        State(checkpoint_every=0, w=1)
    state = State(epoch=0)
    with pytest.raises(AttributeError, match="no entry 'batch'; entries: epoch"):
        _ = state.batch
    with pytest.raises(AttributeError, match="cannot be assigned"):
        state.commits = 3


def test_rank_failure_follows_wrapped_errors() -> None:
    failed = MPI.Exception(MPI.ERR_PROC_FAILED)
    assert rank_failure(failed) is failed
    try:
        try:
            raise MPI.Exception(MPI.ERR_REVOKED)
        except MPI.Exception as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert rank_failure(outer) is outer.__cause__
    assert rank_failure(MPI.Exception(MPI.ERR_TRUNCATE)) is None
    assert rank_failure(ValueError("x")) is None
