"""The numpy trainer: N ranks with per-rank batch B/N match 1 rank with batch B."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from helpers import assert_all_ranks

import mpitrain as mt
from mpitrain import trainer

BATCH = 120  # divisible by every rank count 1..5 times 2 accumulation passes
STEPS = 3


def make_params(seed: int = 0) -> list[trainer.Parameter]:
    """A 2-layer tanh MLP, 5 -> 7 -> 3, float64."""
    rng = np.random.default_rng(seed)
    shapes = {"w1": (5, 7), "b1": (7,), "w2": (7, 3), "b2": (3,)}
    return [trainer.Parameter(rng.standard_normal(s) * 0.5, name=n) for n, s in shapes.items()]


def backward(params: list[trainer.Parameter], x: np.ndarray, y: np.ndarray, scale: float,
             on_grad: Callable[[trainer.Parameter], None], order: list[int]) -> None:
    """Add the gradient of ``scale * 0.5 * |mlp(x) - y|^2`` to every ``.grad``.

    ``on_grad`` is called for each parameter, in ``order`` (indices into ``params``).
    """
    w1, b1, w2, b2 = (p.data for p in params)
    h = np.tanh(x @ w1 + b1)
    dout = scale * (h @ w2 + b2 - y)
    dh = dout @ w2.T * (1 - h * h)
    grads = [x.T @ dh, dh.sum(0), h.T @ dout, dout.sum(0)]
    for p, g in zip(params, grads):
        p.grad = g if p.grad is None else p.grad + g
    for i in order:
        on_grad(params[i])


def data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, 5)), rng.standard_normal((BATCH, 3))


def make_optimizer(kind: str, params: list[trainer.Parameter]) -> Any:
    if kind == "sgd":
        return trainer.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return trainer.Adam(params, lr=0.05, weight_decay=0.01)


def reference(kind: str, steps: int = STEPS) -> list[np.ndarray]:
    """One process, full batch, plain optimizer."""
    params = make_params()
    opt = make_optimizer(kind, params)
    for step in range(steps):
        opt.zero_grad()
        x, y = data(step)
        backward(params, x, y, 1.0 / BATCH, lambda p: None, [0, 1, 2, 3])
        opt.step()
    return [p.data for p in params]


def distributed_run(comm: mt.Communicator, kind: str, passes: int = 1, steps: int = STEPS,
                    **options: Any) -> list[np.ndarray]:
    """Each rank trains on its shard of every batch, in ``passes`` micro-batches."""
    params = make_params(seed=comm.rank)  # differ on purpose: the broadcast fixes them
    if callable(options.get("groups")):
        options = {**options, "groups": options["groups"](params)}
    opt = trainer.DistributedOptimizer(make_optimizer(kind, params),
                                       backward_passes_per_step=passes, **options)
    trainer.broadcast_parameters(params, root_rank=0)
    trainer.broadcast_optimizer_state(opt, root_rank=0)
    shard = BATCH // comm.size
    # ranks announce their gradients in different orders (the engine matches names)
    order = list(np.random.default_rng(comm.rank).permutation(4))
    for step in range(steps):
        opt.zero_grad()
        x, y = data(step)
        mine = slice(comm.rank * shard, (comm.rank + 1) * shard)
        for xs, ys in zip(np.array_split(x[mine], passes), np.array_split(y[mine], passes)):
            backward(params, xs, ys, 1.0 / shard, opt.grad_ready, order)
        opt.step()
    return [p.data for p in params]


def assert_close_all_ranks(comm: mt.Communicator, got: list[np.ndarray],
                           want: list[np.ndarray], rtol: float, what: str) -> None:
    error = relative_error(got, want)
    assert_all_ranks(comm, error <= rtol, f"{what}: relative error {error:.3g}")


def relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """Largest deviation of any parameter, relative to that parameter's largest entry."""
    return max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_equivalence_with_one_big_batch(comm: mt.Communicator, kind: str, passes: int) -> None:
    got = distributed_run(comm, kind, passes)
    assert_close_all_ranks(comm, got, reference(kind), 1e-12, f"{kind} passes={passes}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("options", [
    {"gradient_predivide_factor": 4.0},
    {"groups": 2},
    {"groups": lambda params: [[params[0], params[3]]]},
], ids=["predivide", "groups2", "group-lists"])
def test_options_keep_the_average(comm: mt.Communicator, options: dict[str, Any]) -> None:
    got = distributed_run(comm, "sgd", 2, **options)
    assert_close_all_ranks(comm, got, reference("sgd"), 1e-12, str(options))


@pytest.mark.mpi(min_size=1)
def test_sum_gives_size_times_the_average(comm: mt.Communicator) -> None:
    got = distributed_run(comm, "sgd", 1, 1, op=mt.Sum)
    params = make_params()
    x, y = data(0)
    backward(params, x, y, comm.size / BATCH, lambda p: None, [])
    want = [p.data - 0.1 * (p.grad + 0.01 * p.data) for p in params]  # SGD's first step
    assert_close_all_ranks(comm, got, want, 1e-12, "op=Sum")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("compression,rtol", [(trainer.Compression.fp16, 1e-3),
                                              (trainer.Compression.bf16, 1e-2)])
def test_compression(comm: mt.Communicator, compression: Any, rtol: float) -> None:
    got = distributed_run(comm, "sgd", 1, 1, compression=compression)
    want = reference("sgd", 1)
    assert_close_all_ranks(comm, got, want, rtol, str(compression))
    assert relative_error(got, want) > 1e-12, "the gradients did not travel compressed"
    for p in make_params():  # gradients keep their dtype after the round trip
        assert compression.decompress(*compression.compress(p.data)).dtype == np.float64


@pytest.mark.mpi(min_size=1)
def test_skip_synchronize_and_clipping(comm: mt.Communicator) -> None:
    params = make_params()
    opt = trainer.DistributedOptimizer(trainer.SGD(params, lr=0.1))
    shard = BATCH // comm.size
    x, y = data(0)
    mine = slice(comm.rank * shard, (comm.rank + 1) * shard)
    backward(params, x[mine], y[mine], 1.0 / shard, opt.grad_ready, [0, 1, 2, 3])
    opt.synchronize()
    averaged = [p.grad.copy() for p in params]
    with opt.skip_synchronize():
        opt.step()
    ref = make_params()
    backward(ref, x, y, 1.0 / BATCH, lambda p: None, [])
    assert_close_all_ranks(comm, averaged, [p.grad for p in ref], 1e-12, "synchronize()")
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.synchronize()
        opt.step()


@pytest.mark.mpi(min_size=2)
def test_misuse_raises_value_error(comm: mt.Communicator) -> None:
    params = make_params()
    opt = trainer.DistributedOptimizer(trainer.SGD(params, lr=0.1))
    x, y = data(0)
    backward(params, x, y, 1.0, opt.grad_ready, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="increase backward_passes_per_step"):
        opt.grad_ready(params[0])
    with pytest.raises(ValueError, match=r"zero_grad\(\) was called after backward"):
        opt.zero_grad()
    with pytest.raises(ValueError, match="does not update"):
        opt.grad_ready(trainer.Parameter(np.zeros(3)))
    opt.step()  # still usable: every rank completes the step
    opt.zero_grad()
    with pytest.raises(mt.UnsupportedError, match="op=Adasum"):
        trainer.DistributedOptimizer(trainer.SGD(params, lr=0.1), op=trainer.Adasum)
    with pytest.raises(ValueError, match="needs op=Average"):
        trainer.DistributedOptimizer(trainer.SGD(params, lr=0.1), op=mt.Sum,
                                     gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step=0"):
        trainer.DistributedOptimizer(trainer.SGD(params, lr=0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="duplicates: w"):
        trainer.DistributedOptimizer(trainer.SGD([trainer.Parameter(np.ones(2), "w"),
                                                  trainer.Parameter(np.ones(2), "w")], lr=1))
    with pytest.raises(ValueError, match="twice"):
        trainer.DistributedOptimizer(trainer.SGD(params, lr=0.1),
                                     groups=[[params[0]], [params[0]]])


@pytest.mark.mpi(min_size=2)
def test_mismatched_gradients_raise_runtime_error_everywhere(comm: mt.Communicator) -> None:
    """A rank whose parameter has another shape: every rank gets a RuntimeError."""
    rows = 3 if comm.rank == 0 else 4
    param = trainer.Parameter(np.ones((rows, 2)), name="odd")
    opt = trainer.DistributedOptimizer(trainer.SGD([param], lr=0.1))
    param.grad = np.ones((rows, 2))
    with pytest.raises(RuntimeError, match="odd"):
        opt.step()
    good = trainer.Parameter(np.ones(2), name="even")
    opt = trainer.DistributedOptimizer(trainer.SGD([good], lr=1.0))
    good.grad = np.full(2, float(comm.rank))
    opt.step()
    assert_all_ranks(comm, np.allclose(good.data, 1 - (comm.size - 1) / 2), "usable after")


@pytest.mark.mpi(min_size=1)
def test_broadcast_helpers(comm: mt.Communicator) -> None:
    params = make_params(seed=comm.rank)
    opt = trainer.Adam(params)
    for p in params:
        p.grad = np.full_like(p.data, comm.rank + 1.0)
    opt.step()
    trainer.broadcast_parameters({p.name: p for p in params}, root_rank=comm.size - 1)
    trainer.broadcast_optimizer_state(opt, root_rank=comm.size - 1)
    want_params = make_params(seed=comm.size - 1)
    want = trainer.Adam(want_params)
    for p in want_params:
        p.grad = np.full_like(p.data, float(comm.size))
    want.step()
    ok = all(np.array_equal(p.data, q.data) for p, q in zip(params, want_params))
    ok &= all(np.array_equal(a[k], b[k]) for a, b in zip(opt.state, want.state) for k in a)
    assert_all_ranks(comm, ok and opt.steps == 1, "broadcast parameters and Adam state")
    tree = trainer.broadcast_tree({"a": np.arange(comm.rank + 3), "n": (comm.rank, "x")} if
                                  comm.rank == 0 else None)
    assert_all_ranks(comm, np.array_equal(tree["a"], np.arange(3)) and tree["n"] == (0, "x"),
                     "broadcast_tree")
    assert trainer.broadcast_object({"r": comm.rank}, root_rank=0) == {"r": 0}
    assert trainer.allgather_object(comm.rank * 2) == [2 * r for r in range(comm.size)]
    raw = {"a": np.full(3, float(comm.rank)), "b": np.full(2, comm.rank, np.int32)}
    trainer.broadcast_parameters(raw, root_rank=comm.size - 1)  # plain arrays too
    assert_all_ranks(comm, np.all(raw["a"] == comm.size - 1) and np.all(raw["b"] == comm.size - 1),
                     "broadcast of plain arrays")
    with pytest.raises(ValueError, match="not an array"):
        trainer.broadcast_parameters([("x", "text")])


@pytest.mark.mpi(min_size=1)
def test_metrics(comm: mt.Communicator) -> None:
    avg = trainer.average_metrics({"loss": float(comm.rank), "acc": 1.0})
    assert avg == pytest.approx({"loss": (comm.size - 1) / 2, "acc": 1.0})
    m = trainer.Metrics()
    m.update(n=comm.rank + 1, loss=float(comm.rank))  # rank r: r+1 samples of loss r
    m.update(n=1, loss=10.0)
    got = m.average()
    samples = sum(r + 2 for r in range(comm.size))
    want = (sum((r + 1) * r for r in range(comm.size)) + 10.0 * comm.size) / samples
    assert got["loss"] == pytest.approx(want)
    if comm.size > 1:
        with pytest.raises(RuntimeError, match="same metric names"):
            trainer.average_metrics({"loss": 1.0} if comm.rank else {"acc": 1.0})
