"""Every name of the horovod.torch API in mpitrain.torch, at 2+ ranks, with error cases."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import pytest
from helpers import assert_all_ranks

torch = pytest.importorskip("torch")
import mpitrain as mt  # noqa: E402
import mpitrain.torch as hvd  # noqa: E402
from mpitrain import session  # noqa: E402
from mpitrain.torch.tensors import as_buffer  # noqa: E402


@pytest.fixture(autouse=True)
def _init(comm: Any, torch_device: str) -> None:
    hvd.init()


def rank_tensor(n: int = 6, dtype: Any = torch.float64, r: int | None = None) -> Any:
    """Differs by rank and index: (rank + 1) * (index + 1)."""
    r = hvd.rank() if r is None else r
    return (torch.arange(n, dtype=torch.float64) + 1).mul(r + 1).to(dtype)


def total(n: int = 6, dtype: Any = torch.float64) -> Any:
    return sum(rank_tensor(n, torch.float64, r) for r in range(hvd.size())).to(dtype)


def check(ok: bool, what: str) -> None:
    assert_all_ranks(mt.default_communicator(), bool(ok), what)


@pytest.mark.mpi(min_size=2)
def test_identity() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size()) == (world.Get_rank(), world.Get_size())
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.local_size() * hvd.cross_size() == hvd.size()  # one node, or balanced nodes
    assert hvd.mpi_threads_supported() and hvd.mpi_enabled() and hvd.mpi_built()
    assert not hvd.gloo_enabled() and not hvd.gloo_built() and hvd.nccl_built() == 0
    hvd.init()  # idempotent
    assert hvd.size() == world.Get_size()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int32, torch.bfloat16])
def test_allreduce_ops(dtype: Any) -> None:
    x = rank_tensor(6, dtype)
    before = x.clone()
    summed = hvd.allreduce(x, op=hvd.Sum)
    check(torch.equal(summed, total(6, dtype)) and torch.equal(x, before), f"Sum {dtype}")
    if dtype.is_floating_point:
        avg = hvd.allreduce(x)  # Average is the default
        check(torch.allclose(avg.double(), total().div(hvd.size()), rtol=1e-2),
              f"Average {dtype}")
    check(torch.equal(hvd.allreduce(x, op=hvd.Min), rank_tensor(6, dtype, 0)), "Min")
    check(torch.equal(hvd.allreduce(x, op=hvd.Max), rank_tensor(6, dtype, hvd.size() - 1)),
          "Max")
    signs = torch.tensor([1, -1, 2], dtype=dtype) if hvd.rank() < 2 else torch.ones(3, dtype=dtype)
    check(torch.equal(hvd.allreduce(signs, op=hvd.Product),
                      torch.tensor([1, 1, 4], dtype=dtype)), "Product")
    check(torch.equal(hvd.allreduce(x, average=False), total(6, dtype)), "average=False")
    scaled = hvd.allreduce(rank_tensor(), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3)
    check(torch.allclose(scaled, total() * 1.5), "scaling")


@pytest.mark.mpi(min_size=2)
def test_allreduce_errors() -> None:
    x = rank_tensor()
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(TypeError, match="Adasum combines float vectors"):
        hvd.allreduce(x.long(), op=hvd.Adasum)
    with pytest.raises(TypeError, match="cast with"):
        hvd.allreduce(torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="GPU backend"):
        hvd.allreduce(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match="unknown reduction op"):
        hvd.allreduce(x, op="median")
    with pytest.raises(RuntimeError, match="shape_check"):  # ranks disagree: everyone fails
        hvd.allreduce(torch.ones(3 + hvd.rank()), name="shape_check")
    with pytest.raises(RuntimeError, match="op_check"):
        hvd.allreduce(x, name="op_check", op=hvd.Sum if hvd.rank() else hvd.Max)
    check(torch.equal(hvd.allreduce(x, op=hvd.Sum), total()), "usable after errors")


def test_a_non_tensor_on_one_rank_fails_every_rank() -> None:
    """The last rank passes a string where a tensor belongs: it gets a DtypeError that
    names it (no internal error shown before it), and every other rank raises too
    instead of waiting for it."""
    bad = hvd.rank() == hvd.size() - 1
    calls = {
        "allreduce": lambda x: hvd.allreduce(x),
        "allreduce_async": lambda x: hvd.synchronize(hvd.allreduce_async(x, name="nt")),
        "allreduce with fp16": lambda x: hvd.allreduce(x, compression=hvd.Compression.fp16),
        "grouped_allreduce": lambda x: hvd.grouped_allreduce([rank_tensor(), x]),
        "allgather": lambda x: hvd.allgather(x),
        "grouped_allgather": lambda x: hvd.grouped_allgather([rank_tensor(), x]),
        "broadcast": lambda x: hvd.broadcast(x, 0),
        "broadcast_": lambda x: hvd.broadcast_(x, 0),
        "reducescatter": lambda x: hvd.reducescatter(x),
        "grouped_reducescatter": lambda x: hvd.grouped_reducescatter([rank_tensor(), x]),
        "alltoall": lambda x: hvd.alltoall(x),
    }
    for what, call in calls.items():
        with pytest.raises(mt.MpitrainError) as info:
            call("not a tensor" if bad else rank_tensor())
        error = info.value
        shown = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        assert shown is None, f"{what}: {error!r} shown after {shown!r}"
        if bad:
            assert isinstance(error, mt.DtypeError), f"{what}: {error!r}"
            assert "expected a torch.Tensor, got str" in str(error), f"{what}: {error}"
    check(torch.equal(hvd.allreduce(rank_tensor(), op=hvd.Sum), total()), "usable after")


@pytest.mark.host_only("checks the numpy view of CPU tensors")
@pytest.mark.mpi(min_size=2)
def test_allreduce_in_place_lands_in_the_tensor() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x = rank_tensor(8, dtype)
        ptr = x.data_ptr()
        assert np.shares_memory(as_buffer(x), as_buffer(x)) and \
            as_buffer(x).__array_interface__["data"][0] == ptr  # a view, not a copy
        assert hvd.allreduce_(x, op=hvd.Sum) is x
        check(x.data_ptr() == ptr and torch.equal(x, total(8, dtype)), f"allreduce_ {dtype}")
    t = rank_tensor(6).reshape(2, 3).t()  # non-contiguous
    hvd.allreduce_(t, op=hvd.Sum)
    check(torch.equal(t, total().reshape(2, 3).t()), "allreduce_ of a transposed view")
    p = torch.nn.Parameter(rank_tensor())
    hvd.allreduce_(p, op=hvd.Sum)  # a leaf that requires grad: written through .data
    check(torch.equal(p.detach(), total()), "allreduce_ of a Parameter")


@pytest.mark.mpi(min_size=2)
def test_async_poll_synchronize() -> None:
    handles = [hvd.allreduce_async(rank_tensor(), name="a", op=hvd.Sum),
               hvd.allreduce_async_(rank_tensor(), name="b", op=hvd.Sum)]
    assert all(isinstance(h, int) for h in handles)
    results = []
    for h in handles:
        while not hvd.poll(h):
            time.sleep(0.001)
        results.append(hvd.synchronize(h))
    check(all(torch.equal(r, total()) for r in results), "async results")
    assert hvd.synchronize(handles[0]) is results[0]  # again: the same output, as Horovod
    with pytest.raises(ValueError, match="not a handle"):
        hvd.poll(12345678)
    # ranks submit named operations in different orders: the names match them up
    names = [f"t{i}" for i in range(5)]
    order = names if hvd.rank() % 2 else names[::-1]
    pending = {n: hvd.allreduce_async(rank_tensor() * (int(n[1]) + 1), name=n, op=hvd.Sum)
               for n in order}
    check(all(torch.equal(hvd.synchronize(pending[n]), total() * (i + 1))
              for i, n in enumerate(names)), "out-of-order names")
    # Rank 0's "busy" cannot finish before the others submit it, after the barrier.
    x = rank_tensor()
    if hvd.rank() == 0:
        h = hvd.allreduce_async(x, name="busy")
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(x, name="busy")
        hvd.barrier()
    else:
        hvd.barrier()
        h = hvd.allreduce_async(x, name="busy")
    hvd.synchronize(h)


@pytest.mark.mpi(min_size=2)
def test_grouped_allreduce_family() -> None:
    xs = [rank_tensor(3), rank_tensor(5, torch.float32), rank_tensor(1, torch.int64)]
    want = [total(3), total(5, torch.float32), total(1, torch.int64)]
    out = hvd.grouped_allreduce(xs, op=hvd.Sum)
    check(all(torch.equal(o, w) for o, w in zip(out, want)), "grouped_allreduce")
    out = hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Sum))
    check(all(torch.equal(o, w) for o, w in zip(out, want)), "grouped_allreduce_async")
    h = hvd.grouped_allreduce_async_(xs, op=hvd.Sum)
    assert hvd.synchronize(h) == xs
    check(all(torch.equal(o, w) for o, w in zip(xs, want)), "grouped_allreduce_async_")
    ys = [rank_tensor(2), rank_tensor(4)]
    assert hvd.grouped_allreduce_(ys, op=hvd.Sum) == ys
    check(torch.equal(ys[1], total(4)), "grouped_allreduce_")
    with pytest.raises(RuntimeError):
        hvd.grouped_allreduce([torch.ones(2 + hvd.rank())], name="grouped_mismatch")


@pytest.mark.mpi(min_size=2)
def test_allgather_and_broadcast() -> None:
    rows = hvd.rank() + 1
    x = torch.full((rows, 2), float(hvd.rank()))
    want = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(hvd.size())])
    check(torch.equal(hvd.allgather(x), want), "allgather")
    check(torch.equal(hvd.synchronize(hvd.allgather_async(x)), want), "allgather_async")
    with pytest.raises(RuntimeError, match="gather_mismatch"):
        hvd.allgather(torch.ones(2, 2 + hvd.rank()), name="gather_mismatch")
    root = hvd.size() - 1
    y = rank_tensor()
    check(torch.equal(hvd.broadcast(y, root), rank_tensor(r=root)) and
          torch.equal(y, rank_tensor()), "broadcast")
    check(torch.equal(hvd.synchronize(hvd.broadcast_async(y, root)), rank_tensor(r=root)),
          "broadcast_async")
    assert hvd.broadcast_(y, root) is y
    check(torch.equal(y, rank_tensor(r=root)), "broadcast_")
    z = rank_tensor()
    hvd.synchronize(hvd.broadcast_async_(z, 0))
    check(torch.equal(z, rank_tensor(r=0)), "broadcast_async_")
    with pytest.raises(ValueError, match="root=99"):
        hvd.broadcast(y, 99)


@pytest.mark.mpi(min_size=2)
def test_alltoall() -> None:
    n, r = hvd.size(), hvd.rank()
    x = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2) + 100 * r
    out = hvd.alltoall(x)  # equal splits: one row to each rank
    want = torch.stack([torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)[r] + 100 * s
                        for s in range(n)])
    check(torch.equal(out, want), "alltoall without splits")
    splits = [(r + d) % 3 for d in range(n)]  # rank r sends (r + d) % 3 rows to rank d
    rows = torch.arange(sum(splits), dtype=torch.int64) + 1000 * r
    got, received = hvd.alltoall(rows.reshape(-1, 1), splits=splits)
    expect_counts = [(s + r) % 3 for s in range(n)]
    parts = []
    for s in range(n):
        theirs = [(s + d) % 3 for d in range(n)]
        start = sum(theirs[:r])
        parts.append(torch.arange(start, start + theirs[r]) + 1000 * s)
    check(received.tolist() == expect_counts and received.dtype == torch.int32 and
          torch.equal(got.reshape(-1), torch.cat(parts)), "alltoall with splits")
    with pytest.raises(ValueError, match="divisible"):
        hvd.alltoall(torch.ones(n + 1))
    with pytest.raises(ValueError, match="summing to dim 0"):
        hvd.alltoall(torch.ones(3), splits=[1] * (n + 1))
    with pytest.raises(ValueError, match="0-d"):
        hvd.alltoall(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="same dtype"):
        hvd.alltoall(torch.ones(n, dtype=torch.float32 if r else torch.float64))


@pytest.mark.mpi(min_size=2)
def test_reducescatter() -> None:
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1  # uneven: the first rank gets one more row
    x = rank_tensor(rows * 2).reshape(rows, 2)
    full = total(rows * 2).reshape(rows, 2)
    lo = sum(len(b) for b in np.array_split(np.arange(rows), n)[:r])
    mine = len(np.array_split(np.arange(rows), n)[r])
    check(torch.allclose(hvd.reducescatter(x), full[lo:lo + mine] / n), "reducescatter Average")
    got = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum))
    check(torch.equal(got, full[lo:lo + mine]), "reducescatter_async Sum")
    with pytest.raises(RuntimeError):
        hvd.reducescatter(torch.ones(n + r, 2), name="rs_mismatch")


@pytest.mark.mpi(min_size=1)
def test_autograd_records_only_calls_that_need_a_gradient(monkeypatch: pytest.MonkeyPatch,
                                                          ) -> None:
    """The differentiable collectives go through their autograd function only where
    autograd would record the call (grad mode on, an input that requires grad); the
    others run its forward alone, with the same results."""
    from mpitrain.torch import mpi_ops

    recorded: list[str] = []
    for name in ("_Allreduce", "_GroupedAllreduce", "_Allgather", "_Broadcast",
                 "_Reducescatter", "_Alltoall"):
        function = getattr(mpi_ops, name)
        real = function.apply

        def watched(*args: Any, real: Any = real, name: str = name) -> Any:
            recorded.append(name)
            return real(*args)

        monkeypatch.setattr(function, "apply", watched)

    n = hvd.size()

    def every_call(x: Any) -> list[Any]:
        return [hvd.allreduce(x, op=hvd.Sum), *hvd.grouped_allreduce([x, x], op=hvd.Sum),
                hvd.allgather(x), hvd.broadcast(x, 0), hvd.reducescatter(x, op=hvd.Sum),
                hvd.alltoall(x)]

    rows = torch.ones(n, 2, dtype=torch.float64)
    plain = every_call(rows)
    with torch.no_grad():
        every_call(rows.clone().requires_grad_())
    check(recorded == [], f"autograd recorded {recorded} for calls that need no gradient")
    kept = [k for k in ("args", "shape", "process_set", "root", "received")
            if hasattr(mpi_ops._UNTRACKED, k)]
    check(kept == [], f"the forwards' shared ctx kept {kept} of their last calls")
    tracked = every_call(rows.clone().requires_grad_())
    check(sorted(set(recorded)) == ["_Allgather", "_Allreduce", "_Alltoall", "_Broadcast",
                                    "_GroupedAllreduce", "_Reducescatter"],
          f"autograd recorded only {sorted(set(recorded))}")
    check(all(t.requires_grad for t in tracked[:-1]) and not any(p.requires_grad for p in plain)
          and all(torch.equal(p, t.detach()) for p, t in zip(plain, tracked)),
          "the forward alone gives what the autograd function gives")


@pytest.mark.mpi(min_size=2)
def test_autograd() -> None:
    n, r = hvd.size(), hvd.rank()
    w = torch.arange(3, dtype=torch.float64) + r  # each rank's loss weights

    x = rank_tensor(3).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * w).sum().backward()
    want = sum(torch.arange(3, dtype=torch.float64) + s for s in range(n))
    check(torch.allclose(x.grad, want), "allreduce Sum backward")
    x.grad = None
    (hvd.allreduce(x) * w).sum().backward()
    check(torch.allclose(x.grad, want / n), "allreduce Average backward")

    a, b = rank_tensor(2).requires_grad_(), rank_tensor(3).requires_grad_()
    ga, gb = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    (ga.sum() * (r + 1) + gb.sum()).backward()
    check(torch.allclose(a.grad, torch.full((2,), n * (n + 1) / 2, dtype=torch.float64)) and
          torch.allclose(b.grad, torch.full((3,), float(n), dtype=torch.float64)),
          "grouped_allreduce backward")

    g = torch.ones(r + 1, 2, dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(g)  # rows of rank s start at s*(s+1)/2
    weights = torch.arange(gathered.shape[0], dtype=torch.float64).unsqueeze(1) * (r + 1)
    (gathered * weights).sum().backward()
    start = r * (r + 1) // 2
    rows = torch.arange(start, start + r + 1, dtype=torch.float64).unsqueeze(1)
    # Horovod's gradients: allgather and broadcast average the ranks' gradients
    check(torch.allclose(g.grad, (rows * (n + 1) / 2).expand(r + 1, 2)), "allgather backward")
    g2 = [torch.ones(r + 1, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    gathered2 = hvd.grouped_allgather(g2)
    (gathered2[0].sum() * (r + 1) + gathered2[1].sum() * 2).backward()
    check(torch.allclose(g2[0].grad, torch.full((r + 1,), (n + 1) / 2, dtype=torch.float64))
          and torch.allclose(g2[1].grad, torch.full((r + 1,), 2.0, dtype=torch.float64)),
          "grouped_allgather backward")

    root = n - 1
    c = rank_tensor(3).requires_grad_()
    (hvd.broadcast(c, root) * (r + 1)).sum().backward()
    want_c = torch.full((3,), (n + 1) / 2) if r == root else torch.zeros(3)
    check(torch.allclose(c.grad, want_c.double()), "broadcast backward")

    t = torch.ones(n, 1, dtype=torch.float64, requires_grad=True)
    (hvd.alltoall(t) * (r + 1)).sum().backward()  # row d went to rank d
    check(torch.allclose(t.grad.reshape(-1), torch.arange(1, n + 1, dtype=torch.float64)),
          "alltoall backward")

    # reducescatter: the gathered gradient, times the scaling factors, times n for Sum
    per_row = torch.arange(1, n + 1, dtype=torch.float64).unsqueeze(1).expand(n, 2)
    s = torch.ones(n, 2, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(s, op=hvd.Sum) * (r + 1)).sum().backward()
    check(torch.allclose(s.grad, per_row * n), "reducescatter Sum backward")
    s.grad = None
    (hvd.reducescatter(s, prescale_factor=3.0, postscale_factor=0.5) * (r + 1)).sum().backward()
    check(torch.allclose(s.grad, per_row * 1.5), "reducescatter Average backward")
    s2 = [torch.ones(n, 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    blocks = hvd.grouped_reducescatter(s2, op=hvd.Sum)
    (blocks[0].sum() * (r + 1) + blocks[1].sum()).backward()
    check(torch.allclose(s2[0].grad, per_row * n)
          and torch.allclose(s2[1].grad, torch.full((n, 2), float(n), dtype=torch.float64)),
          "grouped_reducescatter backward")
    m = rank_tensor(3).requires_grad_()
    with pytest.raises(ValueError, match="gradient of allreduce"):
        hvd.allreduce(m, op=hvd.Max).sum().backward()


@pytest.mark.mpi(min_size=2)
def test_compression_in_allreduce() -> None:
    x = rank_tensor(4, torch.float32) / 7
    for compression, tol in ((hvd.Compression.fp16, 1e-3), (hvd.Compression.bf16, 1e-2)):
        y = hvd.allreduce(x, op=hvd.Sum, compression=compression)
        check(y.dtype == torch.float32 and torch.allclose(y, total(4, torch.float32) / 7,
                                                          rtol=tol), str(compression))
    ints = rank_tensor(4, torch.int64)
    assert hvd.Compression.fp16.compress(ints)[0] is ints  # integers are not cast


@pytest.mark.mpi(min_size=2)
def test_barrier_join_objects() -> None:
    hvd.barrier()
    last = hvd.size() - 1
    served = True
    if hvd.rank() == last:  # joined ranks serve an allreduce with zeros: this one completes
        # only once every other rank is in join(), so this rank is the last to join
        ones = torch.ones(3, dtype=torch.float64)
        served = torch.equal(hvd.allreduce(ones, op=hvd.Sum, name="late"), ones)
    last_to_join = hvd.join()
    check(served and last_to_join == last, f"join returned {last_to_join}, not {last}")
    check(hvd.join() in range(hvd.size()), "join again")
    assert hvd.broadcast_object({"r": hvd.rank()}, root_rank=last) == {"r": last}
    assert hvd.allgather_object(hvd.rank() ** 2) == [r * r for r in range(hvd.size())]
    with pytest.raises(ValueError, match="root=99"):
        hvd.broadcast_object(1, root_rank=99)


@pytest.mark.mpi(min_size=2)
def test_barrier_returns_on_no_rank_before_the_last_has_entered() -> None:
    """Each rank in turn enters late, right after creating a file; every rank finds that
    file once its barrier returns. The late rank first completes an allreduce with the
    others, as Horovod's test_global_barrier_op does, so they are in the barrier already
    (the sleep only makes an early return likely; the check is the file, not a clock)."""
    folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    try:
        for late in range(hvd.size()):
            marker = os.path.join(folder, f"entered{late}")
            hvd.allreduce_(torch.ones(1), None, f"before_barrier{late}", hvd.Sum)
            if hvd.rank() == late:
                time.sleep(0.2)
                open(marker, "w").close()
            hvd.barrier()
            check(os.path.exists(marker), f"barrier returned before rank {late} entered it")
    finally:
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(folder)


def roots_model(root: int) -> tuple[Any, Any]:
    """What the root of :func:`test_broadcast_parameters_and_optimizer_state` holds: its
    seeded model and Adam, after one step on rank 0 only."""
    torch.manual_seed(root)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if root == 0:  # only the root has Adam state
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
    return model, opt


def same_state(model: Any, opt: Any, want_model: Any, want_opt: Any) -> str:
    """Where ``model``/``opt`` differ from ``want_model``/``want_opt`` (``""``: nowhere)."""
    ours, theirs = model.state_dict(), want_model.state_dict()
    wrong = [k for k in theirs if not torch.equal(ours[k].cpu(), theirs[k])]
    for i, (p, q) in enumerate(zip(model.parameters(), want_model.parameters())):
        want = want_opt.state.get(q, {})
        got = opt.state.get(p, {})
        wrong += [f"adam[{i}].{k}" for k in want
                  if k not in got or not torch.equal(torch.as_tensor(got[k]).cpu(),
                                                     torch.as_tensor(want[k]))]
    return ", ".join(wrong)


@pytest.mark.mpi(min_size=2)
def test_broadcast_parameters_and_optimizer_state() -> None:
    """Every rank ends with the root's parameters, buffers and Adam state, bit for bit
    as the root made them (rebuilt here from the root's seed)."""
    model, opt = roots_model(hvd.rank())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    want_model, want_opt = roots_model(0)
    wrong = same_state(model, opt, want_model, want_opt)
    check(len(opt.state) == 4 and not wrong, f"differ from the root's: {wrong}")
    root = hvd.size() - 1
    torch.manual_seed(10 + hvd.rank())
    other = torch.nn.Linear(3, 4)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=root)
    torch.manual_seed(10 + root)
    want = torch.nn.Linear(3, 4)
    check(torch.equal(other.weight.detach(), want.weight.detach())
          and torch.equal(other.bias.detach(), want.bias.detach()),
          f"named_parameters generator: not rank {root}'s")
    with pytest.raises(ValueError, match="invalid params"):
        hvd.broadcast_parameters(42)
    with pytest.raises(ValueError, match="not a tensor"):
        hvd.broadcast_parameters({"x": 1.0})


@pytest.mark.mpi(min_size=2)
def test_shutdown_and_init_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a communicator of its own, so the suite's communicator stays alive."""
    monkeypatch.setattr(session, "_default", None)
    assert not hvd.is_initialized()
    with pytest.raises(RuntimeError, match="init"):
        hvd.size()
    hvd.init()
    check(torch.equal(hvd.allreduce(rank_tensor(), op=hvd.Sum), total()), "after init")
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(RuntimeError, match="init"):
        hvd.allreduce(rank_tensor())
    hvd.init()
    check(torch.equal(hvd.allreduce(rank_tensor(), op=hvd.Sum), total()) and
          hvd.join() in range(hvd.size()), "after shutdown and init again")
    hvd.shutdown()
