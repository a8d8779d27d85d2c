"""Trainer parts that need no MPI: sampler, compression, optimizers, checkpoint format."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from mpitrain import checkpoint, trainer
from mpitrain.dtypes import BFLOAT16
from mpitrain.errors import CheckpointError


@pytest.mark.parametrize("n,replicas,drop_last", [(10, 3, False), (10, 3, True), (7, 7, False),
                                                  (2, 5, False), (12, 4, True)])
def test_sampler_shards(n: int, replicas: int, drop_last: bool) -> None:
    shards = [trainer.DistributedSampler(n, replicas, r, seed=3, drop_last=drop_last)
              for r in range(replicas)]
    for epoch in (0, 1):
        for s in shards:
            s.set_epoch(epoch)
        parts = [s.indices() for s in shards]
        assert len({len(p) for p in parts}) == 1 and all(len(p) == len(s) for p, s in
                                                         zip(parts, shards))
        every = np.concatenate(parts)
        if drop_last:
            assert len(set(every.tolist())) == len(every) == n - n % replicas
        else:
            assert set(every.tolist()) == set(range(n))  # padding repeats, never misses
            assert len(every) == -(-n // replicas) * replicas
    a = trainer.DistributedSampler(n, replicas, 0, seed=3)
    b = trainer.DistributedSampler(n, replicas, 0, seed=3)
    b.set_epoch(1)
    if n > 3 and replicas < n:
        assert list(a) != list(b), "each epoch draws a new order"
    b.load_state_dict(a.state_dict())
    assert list(a) == list(b)
    unshuffled = trainer.DistributedSampler(n, replicas, 1, shuffle=False)
    assert list(unshuffled)[:1] == [1 % n]


def test_sampler_misuse() -> None:
    with pytest.raises(ValueError, match="rank=3"):
        trainer.DistributedSampler(10, 3, 3)
    with pytest.raises(ValueError, match="drop_last"):
        trainer.DistributedSampler(2, 3, 0, drop_last=True)
    assert len(trainer.DistributedSampler(range(9), 2, 1)) == 5


@pytest.mark.parametrize("compression,wire", [(trainer.Compression.fp16, np.float16),
                                              (trainer.Compression.bf16, BFLOAT16)])
def test_compression_casts_floats_only(compression: trainer.Compressor, wire: object) -> None:
    x = np.linspace(-1, 1, 7)
    sent, ctx = compression.compress(x)
    assert sent.dtype == wire
    back = compression.decompress(sent, ctx)
    assert back.dtype == np.float64 and np.allclose(back, x, atol=1e-2)
    ints = np.arange(3)
    assert compression.compress(ints)[0] is ints
    same, ctx = compression.compress(sent)  # already the wire type: untouched
    assert same is sent and compression.decompress(same, ctx) is same
    assert trainer.Compression.none.compress(x) == (x, None)


def test_optimizers_match_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    init = rng.standard_normal((4, 3))
    grads = [rng.standard_normal((4, 3)) for _ in range(5)]
    cases = [(lambda p: trainer.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
              lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
             (lambda p: trainer.SGD(p, lr=0.1, momentum=0.5, nesterov=True),
              lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, nesterov=True)),
             (lambda p: trainer.Adam(p, lr=0.01, weight_decay=0.1),
              lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1))]
    for ours_of, theirs_of in cases:
        mine = trainer.Parameter(init.copy())
        ours = ours_of([mine])
        ref = torch.nn.Parameter(torch.from_numpy(init.copy()))
        theirs = theirs_of([ref])
        for g in grads:
            mine.grad = g.copy()
            ref.grad = torch.from_numpy(g.copy())
            ours.step()
            theirs.step()
        assert np.allclose(mine.data, ref.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_optimizer_state_round_trip() -> None:
    p = trainer.Parameter(np.ones(3), "p")
    opt = trainer.Adam([p])
    p.grad = np.full(3, 0.5)
    opt.step()
    other = trainer.Adam([trainer.Parameter(np.ones(3))])
    other.load_state_dict(opt.state_dict())
    assert other.steps == 1 and np.array_equal(other.state[0]["exp_avg"], opt.state[0]["exp_avg"])
    with pytest.raises(ValueError, match="state has 1 parameters, this optimizer 2"):
        trainer.Adam([trainer.Parameter(np.ones(3))] * 2).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="shape"):
        trainer.Adam([trainer.Parameter(np.ones(4))]).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="nesterov"):
        trainer.SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="lr=-1"):
        trainer.SGD([p], lr=-1)


def test_checkpoint_round_trips_every_kind_of_value(tmp_path: object) -> None:
    directory = str(tmp_path)
    state = {"f64": np.arange(6.0).reshape(2, 3), "bf16": np.ones(3, dtype=BFLOAT16),
             "scalar": np.float32(2.5), "big": 2 ** 100, "nan": float("nan"),
             "tuple": (1, "x", None, True), "int_keys": {0: "a", (1, 2): "b"},
             "dunder": {"__array__": 1}, "nested": [{"a": np.zeros(0, np.int8)}]}
    path = checkpoint.save(directory, state, step=3)  # no MPI: this process writes
    got = checkpoint.load(path).state
    assert got["f64"].dtype == np.float64 and np.array_equal(got["f64"], state["f64"])
    assert got["bf16"].dtype == BFLOAT16 and np.array_equal(got["bf16"], state["bf16"])
    assert isinstance(got["scalar"], np.float32) and got["scalar"] == 2.5
    assert got["big"] == 2 ** 100 and np.isnan(got["nan"])
    assert got["tuple"] == (1, "x", None, True) and got["int_keys"] == {0: "a", (1, 2): "b"}
    assert got["dunder"] == {"__array__": 1} and got["nested"][0]["a"].dtype == np.int8
    assert checkpoint.latest(directory) == path and checkpoint.latest(directory + "/no") is None
    assert os.listdir(directory) == ["ckpt-000000003.safetensors"]


def test_rng_capture_and_restore() -> None:
    gen = np.random.default_rng(1)
    saved = checkpoint.capture_rng(gen)
    first = (random.random(), np.random.random(), gen.random())
    checkpoint.restore_rng(saved, gen)
    assert (random.random(), np.random.random(), gen.random()) == first
    with pytest.raises(CheckpointError, match="saved none"):
        checkpoint.restore_rng(checkpoint.capture_rng(), gen)


def test_torch_tensor_views_share_memory() -> None:
    torch = pytest.importorskip("torch")
    from mpitrain.torch.checkpoint import to_numpy, to_tensors
    from mpitrain.torch.tensors import as_buffer, from_buffer

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex64):
        t = torch.arange(6).reshape(2, 3).to(dtype)
        view = as_buffer(t)
        view[0, 0] = 7
        assert t[0, 0].item() == 7, f"{dtype}: the view must alias the tensor"
        back = from_buffer(view)
        assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    tree = {"w": torch.ones(2, dtype=torch.bfloat16), "n": (1, torch.zeros(1))}
    again = to_tensors(to_numpy(tree))
    assert again["w"].dtype == torch.bfloat16 and again["n"][0] == 1
    with pytest.raises(TypeError, match="not supported"):
        as_buffer(torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="sparse"):
        as_buffer(torch.ones(2).to_sparse())


def test_distributed_optimizer_checks_names_before_init(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Duplicate or missing parameter names are a ValueError at construction, before
    the communicator is looked up (so also before, and without, hvd.init()), as in
    Horovod."""
    torch = pytest.importorskip("torch")
    import mpitrain.torch as hvd
    from mpitrain.torch import optimizer as torch_optimizer

    def no_communicator(process_set: object) -> None:
        raise AssertionError("the communicator was looked up before the names were checked")

    monkeypatch.setattr(torch_optimizer, "communicator", no_communicator)
    a, b = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="duplicate: weight"):
        hvd.DistributedOptimizer(opt, named_parameters=[*a.named_parameters(),
                                                        *b.named_parameters()])
    with pytest.raises(ValueError, match="2 optimized parameter"):
        hvd.DistributedOptimizer(opt, named_parameters=a.named_parameters())
    with pytest.raises(ValueError, match="sequence of tuples"):
        hvd.DistributedOptimizer(opt, named_parameters=[a.weight])
