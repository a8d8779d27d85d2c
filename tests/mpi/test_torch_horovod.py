"""Horovod conformance of mpitrain.torch: build flags, handles, integer scaling, grouped
allgather/reducescatter, alltoall_async, the timeline, HorovodInternalError and join()
with uneven data."""

from __future__ import annotations

import gc
import json
import os
import tempfile
from typing import Any

import pytest
from helpers import assert_all_ranks

torch = pytest.importorskip("torch")
import mpitrain as mt  # noqa: E402
import mpitrain.torch as hvd  # noqa: E402


@pytest.fixture(autouse=True)
def _init(comm: Any) -> None:
    hvd.init()


def check(ok: bool, what: str) -> None:
    assert_all_ranks(mt.default_communicator(), bool(ok), what)


def signed_ints(dtype: Any = torch.int32) -> Any:
    """Odd and negative values that differ by rank: sums that 2, 3, ... do not divide."""
    r = hvd.rank()
    return torch.tensor([-7 - r, 5 + 2 * r, -1, 3 * r - 11, 0, 9], dtype=dtype)


def reference_sum(dtype: Any = torch.int32) -> Any:
    return sum(torch.tensor([-7 - r, 5 + 2 * r, -1, 3 * r - 11, 0, 9], dtype=torch.float64)
               for r in range(hvd.size()))


@pytest.mark.mpi(min_size=2)
def test_build_flags() -> None:
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert hvd.nccl_built() == 0 and not hvd.gloo_built() and not hvd.gloo_enabled()
    assert not hvd.ddl_built() and not hvd.ccl_built() and not hvd.rocm_built()
    if not torch.cuda.is_available():
        assert not hvd.cuda_built()
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


@pytest.mark.mpi(min_size=2)
def test_synchronize_again_returns_the_output() -> None:
    x = torch.ones(4) * (hvd.rank() + 1)
    handle = hvd.allreduce_async(x, op=hvd.Sum)
    first = hvd.synchronize(handle)
    check(torch.equal(first, torch.ones(4) * sum(range(1, hvd.size() + 1))), "sum")
    assert hvd.synchronize(handle) is first and hvd.poll(handle)
    grouped = hvd.grouped_allreduce_async([x, x * 2], op=hvd.Sum)
    outputs = hvd.synchronize(grouped)
    assert hvd.synchronize(grouped) == outputs
    del first
    gc.collect()
    assert hvd.synchronize(handle) is None  # the output is gone: None, as Horovod returns
    with pytest.raises(ValueError, match="not a handle"):
        hvd.synchronize(10**9)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_scaling_truncates_toward_zero(dtype: Any) -> None:
    n = hvd.size()
    exact = reference_sum(dtype)
    averaged = hvd.allreduce(signed_ints(dtype), op=hvd.Average)
    check(torch.equal(averaged, torch.trunc(exact / n).to(dtype)), f"Average {averaged}")
    post = hvd.allreduce(signed_ints(dtype), op=hvd.Sum, postscale_factor=0.3)
    check(torch.equal(post, torch.trunc(exact * 0.3).to(dtype)), f"postscale {post}")
    pre = hvd.allreduce(signed_ints(dtype), op=hvd.Sum, prescale_factor=0.45)
    expected = sum(torch.trunc(torch.tensor([-7 - r, 5 + 2 * r, -1, 3 * r - 11, 0, 9],
                                            dtype=torch.float64) * 0.45) for r in range(n))
    check(torch.equal(pre, expected.to(dtype)), f"prescale {pre}")
    inplace = signed_ints(dtype)
    hvd.allreduce_(inplace, op=hvd.Average, postscale_factor=2.5)
    check(torch.equal(inplace, torch.trunc(exact * (2.5 / n)).to(dtype)), "in place")
    group = hvd.grouped_allreduce([signed_ints(dtype), signed_ints(dtype).double()],
                                  op=hvd.Average)
    check(torch.equal(group[0], torch.trunc(exact / n).to(dtype)) and
          torch.allclose(group[1], exact / n), "grouped, mixed dtypes")
    rows = signed_ints(dtype).repeat(n, 1)  # reducescatter: one row per rank
    block = hvd.reducescatter(rows, op=hvd.Average)
    check(torch.equal(block, torch.trunc(exact / n).to(dtype).reshape(1, -1)),
          "reducescatter Average")


@pytest.mark.mpi(min_size=2)
def test_float16_scaling_in_float32() -> None:
    x = torch.arange(-100, 100, dtype=torch.float16)
    factor = 0.1915194503788923
    scaled = hvd.allreduce(x, op=hvd.Max, prescale_factor=factor)  # Max: no sum to round
    one = (x.float() * factor).half()  # not x * half(factor), which differs here
    assert not torch.equal(one, x * torch.tensor(factor, dtype=torch.float16))
    check(torch.equal(scaled, one), f"prescale fp16 {scaled} != {one}")


@pytest.mark.mpi(min_size=2)
def test_grouped_allgather_and_reducescatter() -> None:
    r, n = hvd.rank(), hvd.size()
    tensors = [torch.full((r + 1, 2), float(r)), torch.arange(3, dtype=torch.int64) + r]
    gathered = hvd.synchronize(hvd.grouped_allgather_async(tensors, name="gg"))
    want0 = torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)])
    want1 = torch.cat([torch.arange(3, dtype=torch.int64) + q for q in range(n)])
    check(torch.equal(gathered[0], want0) and torch.equal(gathered[1], want1),
          "grouped_allgather_async")
    leaf = torch.full((r + 1, 2), float(r), requires_grad=True)
    out = hvd.grouped_allgather([leaf])[0]
    out.sum().backward()  # Horovod's gradient: every rank's gradient (ones), averaged
    check(torch.equal(leaf.grad, torch.ones(r + 1, 2)), "grouped_allgather grad")
    blocks = hvd.grouped_reducescatter([torch.ones(n, 3) * (r + 1), torch.ones(2 * n)],
                                       op=hvd.Sum)
    total = n * (n + 1) / 2
    check(torch.equal(blocks[0], torch.full((1, 3), total)) and
          torch.equal(blocks[1], torch.full((2,), float(n))), "grouped_reducescatter")
    handle = hvd.grouped_reducescatter_async([torch.ones(n) * (r + 1)], op=hvd.Average)
    check(torch.equal(hvd.synchronize(handle)[0], torch.full((1,), total / n)),
          "grouped_reducescatter_async")
    with pytest.raises(RuntimeError, match="gg_bad"):  # ranks disagree: every rank fails
        hvd.synchronize(hvd.grouped_allgather_async([torch.ones(2, 1 + r)], name="gg_bad"))


@pytest.mark.mpi(min_size=2)
def test_alltoall_async() -> None:
    r, n = hvd.rank(), hvd.size()
    splits = torch.tensor([r + 1] * n, dtype=torch.int32)
    x = torch.cat([torch.full((r + 1,), float(q)) for q in range(n)])
    handle = hvd.alltoall_async(x, splits)
    assert hvd.poll(handle)
    output, received = hvd.synchronize(handle)
    check(torch.equal(output, torch.full((n * (n + 1) // 2,), float(r))) and
          received.tolist() == [q + 1 for q in range(n)], "alltoall_async")
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall_async(x, [1] * (n + 1))


@pytest.mark.mpi(min_size=2)
def test_timeline_api() -> None:
    comm = mt.default_communicator()
    folder = tempfile.mkdtemp(prefix="hvd-timeline-") if hvd.rank() == 0 else None
    path = comm.broadcast_object(os.path.join(folder or "", "timeline.json"))
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="timeline_probe")
    hvd.stop_timeline()
    found = ""
    if hvd.rank() == 0:
        with open(path) as f:
            text = f.read()
        json.loads(text)
        found = "ok" if "timeline_probe" in text else text[:200]
    check(comm.broadcast_object(found) == "ok", f"timeline: {comm.broadcast_object(found)}")


@pytest.mark.mpi(min_size=2)
def test_horovod_internal_error_catches_mismatches() -> None:
    with pytest.raises(hvd.HorovodInternalError, match="mismatch_probe"):
        hvd.allreduce(torch.ones(2 + hvd.rank()), name="mismatch_probe")
    check(torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum),
                      torch.full((2,), float(hvd.size()))), "usable afterwards")


def one_parameter_step(opt: Any, p: Any, scaler: Any = None) -> None:
    """Backward of ``p.sum() * (rank + 1)``: the averaged gradient is ``(size + 1) / 2``."""
    opt.zero_grad()
    loss = p.sum() * (hvd.rank() + 1)
    if scaler is None:
        loss.backward()
        opt.step()
        return
    scaler.scale(loss).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()


@pytest.mark.mpi(min_size=2)
def test_optimizer_is_a_torch_optimizer() -> None:
    mean = (hvd.size() + 1) / 2
    p = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)])
    assert isinstance(opt, torch.optim.Optimizer) and opt.defaults["lr"] == 1.0
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    one_parameter_step(opt, p)
    schedule.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.5
    one_parameter_step(opt, p)  # with the scheduled learning rate
    check(torch.equal(p.detach(), torch.full((2,), -mean * 1.5)), f"StepLR: {p}")
    saved = opt.state_dict()
    opt.param_groups[0]["lr"] = 9.0
    opt.load_state_dict(saved)
    assert opt.optimizer.param_groups[0]["lr"] == 0.5

    q = torch.nn.Parameter(torch.zeros(2))
    scaled = hvd.DistributedOptimizer(torch.optim.SGD([q], lr=1.0), named_parameters=[("q", q)])
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    one_parameter_step(scaled, q, scaler)
    check(torch.equal(q.detach(), torch.full((2,), -mean)), f"GradScaler: {q}")


@pytest.mark.mpi(min_size=2)
def test_broadcast_optimizer_state_with_parameters_without_gradient() -> None:
    frozen = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    trained = torch.nn.Parameter(torch.full((4,), float(hvd.rank())))
    sgd = torch.optim.SGD([frozen, trained], lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=hvd.rank() * 0.1)
    opt = hvd.DistributedOptimizer(sgd)  # without named_parameters
    hvd.broadcast_parameters([("frozen", frozen), ("trained", trained)], root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert frozen.grad is None and torch.equal(trained.grad, torch.zeros(4))
    check(opt.param_groups[0]["weight_decay"] == 0.0 and torch.equal(trained.detach(),
                                                                      torch.zeros(4)),
          "root's hyper-parameters, parameters not stepped")
    one_parameter_step(opt, trained)
    check(torch.allclose(trained.detach(), torch.full((4,), -0.1 * 1.9 * (hvd.size() + 1) / 2)),
          f"a step after the broadcast: {trained}")


# -- join with uneven data (DistributedOptimizer, the Horovod use case) ------------------
def batch(rank: int, step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def gradients(model: Any, x: Any, y: Any) -> list[Any]:
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.mpi(min_size=1)
def test_uneven_training_steps() -> None:
    """Rank r trains r + 1 steps, then joins. Each step's averaged gradient is the sum of
    the gradients of the ranks still training divided by size() (joined ranks count as
    zeros), so every rank's model follows the same path as a single-process replay."""
    me, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    replay = torch.nn.Linear(4, 1)
    replay.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(me + 1):
        opt.zero_grad()
        x, y = batch(me, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    check(last == n - 1, f"join() returned {last}, want {n - 1}")
    # replay: at step s, ranks s..n-1 still train; rank r's model stopped after step r
    for step in range(me + 1):
        grads = [gradients(replay, *batch(r, step)) for r in range(step, n)]
        with torch.no_grad():
            for i, p in enumerate(replay.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / n
    same = all(torch.allclose(a, b, atol=1e-6)
               for a, b in zip(model.parameters(), replay.parameters()))
    check(same, "the model matches a single-process replay")


@pytest.mark.mpi(min_size=1)
def test_uneven_ops_and_join_twice() -> None:
    """Allreduce (Sum, Average, Max) and grouped allreduce with uneven participation
    through mpitrain.torch; join twice in a row."""
    me, n = hvd.rank(), hvd.size()
    results = []
    for step in range(me + 1):
        t = torch.full((3,), float(me + 1))
        results.append((hvd.allreduce(t, op=hvd.Sum, name=f"s{step}"),
                        hvd.allreduce(t, op=hvd.Average, name=f"a{step}"),
                        hvd.allreduce(t, op=hvd.Max, name=f"m{step}"),
                        hvd.grouped_allreduce([t, t.int()], op=hvd.Sum, name=f"gr{step}")))
    hvd.join()
    again = hvd.join()
    wrong = []
    for step, (s, a, m, (gf, gi)) in enumerate(results):
        total = float(sum(r + 1 for r in range(step, n)))
        if not (torch.equal(s, torch.full((3,), total)) and
                torch.allclose(a, torch.full((3,), total / n)) and
                torch.equal(m, torch.full((3,), float(n))) and
                torch.equal(gf, s) and torch.equal(gi, s.int())):
            wrong.append(f"step {step}: {s} {a} {m} {gf} {gi}")
    check(not wrong, "; ".join(wrong))
    check(again in range(n), f"second join returned {again}")


@pytest.mark.mpi(min_size=2)
def test_only_allreduces_run_while_a_rank_is_joined() -> None:
    """As in Horovod, ranks in join() take part in allreduces only: an allgather, a
    broadcast (from a rank that has not joined) or a reducescatter submitted while rank 0
    is in join() raises RuntimeError on the ranks that submitted it, an allreduce still
    runs, and join() then returns on every rank."""
    me, n = hvd.rank(), hvd.size()
    outcomes: list[str] = []
    if me == 0:
        last = hvd.join()
    else:
        calls = {"allgather": lambda: hvd.allgather(torch.ones(2, 3), name="g"),
                 "broadcast": lambda: hvd.broadcast(torch.ones(4), root_rank=n - 1, name="b"),
                 "reducescatter": lambda: hvd.reducescatter(torch.ones(2 * n), name="r")}
        for what, call in calls.items():
            try:
                call()
                outcomes.append(f"{what}: no error")
            except RuntimeError as exc:
                if "join()" not in str(exc) or "[0]" not in str(exc):
                    outcomes.append(f"{what}: {exc}")
        summed = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="still.served")
        if not torch.equal(summed, torch.full((3,), float(n - 1))):
            outcomes.append(f"allreduce while joined: {summed}")
        last = hvd.join()
    check(not outcomes, "; ".join(outcomes))
    check(last in range(1, n), f"join() returned {last}")
    after = hvd.allgather(torch.full((1, 2), float(me)), name="after.join")
    check(torch.equal(after, torch.arange(n, dtype=torch.float32).repeat_interleave(2)
                      .reshape(n, 2)), f"allgather after join: {after}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.float32])
def test_reducescatter_refuses_adasum_for_every_dtype(dtype: Any) -> None:
    """As Horovod: Adasum is an allreduce only; reducescatter with it raises a
    RuntimeError on every rank, integers included (not a dtype complaint)."""
    with pytest.raises(RuntimeError, match="Adasum is an allreduce only"):
        hvd.reducescatter(torch.ones(4 * hvd.size(), dtype=dtype), op=hvd.Adasum)
    hvd.barrier()


@pytest.mark.mpi(min_size=2)
def test_alltoall_beside_another_collective_raises_on_every_rank() -> None:
    """alltoall on rank 0, broadcast_object on the others: alltoall's exchange begins
    with a validated rendezvous, so every rank raises naming both calls instead of
    waiting in MPI."""
    try:
        if hvd.rank() == 0:
            hvd.alltoall(torch.ones(hvd.size()))
        else:
            hvd.broadcast_object("x")
        problem = "no error"
    except RuntimeError as exc:
        problem = "" if "rank 0 called alltoall" in str(exc) and "called broadcast_object" \
            in str(exc) else f"does not name both calls: {exc}"
    check(not problem, problem)
    check(torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum),
                      torch.full((2,), float(hvd.size()))), "usable afterwards")
