"""torch.distributed over the "mpitrain" backend on real CUDA tensors: what a DDP or
FSDP user's GPU training runs.

Skipped without a CUDA device (the same paths run on every machine on the fake GPU:
``test_torch_distributed.py`` runs every test again with its tensors taken for fake
GPU tensors); ``benchmarks/gpu_check.sh`` runs it on a GPU machine. The default group
is made with ``device_id`` (this rank's GPU, ``local_rank % count``), as GPU scripts make
it. Every result is checked against a reference computed on the CPU: the collectives
against exact integer-valued sums, training against one process on every rank's data.
"""

from __future__ import annotations

import datetime
from typing import Any, Iterator

import pytest
from helpers import assert_all_ranks, register_ddp_hook

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import mpitrain as mt  # noqa: E402
import mpitrain.torch  # noqa: E402  (registers the backend)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="torch sees no CUDA device")
BATCH, STEPS = 4, 3


@pytest.fixture(scope="module", autouse=True)
def gpu() -> Iterator[Any]:
    """This rank's GPU, current for torch; the default group bound to it."""
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    device = torch.device("cuda", node.Get_rank() % torch.cuda.device_count())
    node.Free()
    torch.cuda.set_device(device)
    dist.init_process_group("mpitrain", timeout=datetime.timedelta(seconds=120),
                            device_id=device)
    yield device
    dist.destroy_process_group()


def check(ok: Any, what: str) -> None:
    assert_all_ranks(mt.init(), bool(ok), what)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64"])
def test_collectives_of_cuda_tensors(gpu: Any, dtype: str) -> None:
    """all_reduce (blocking, and async with its future and a callback),
    all_gather_into_tensor, reduce_scatter_tensor and broadcast of CUDA tensors made by
    kernels on the current stream just before the call: exact small integers, so the
    result is exact in every dtype."""
    n, r = dist.get_world_size(), dist.get_rank()
    kind = getattr(torch, dtype)
    t = (torch.arange(8, device=gpu) + r).to(kind)  # a kernel the backend must wait for
    dist.all_reduce(t)
    want = (torch.arange(8) * n + sum(range(n))).to(kind)
    ok = {"all_reduce": torch.equal(t.cpu(), want)}
    t = (torch.arange(8, device=gpu) + r).to(kind)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    ok["async all_reduce, future, then"] = torch.equal(fut.wait().cpu(), want * 2)
    out = torch.zeros(8 * n, device=gpu, dtype=kind)
    dist.all_gather_into_tensor(out, torch.full((8,), r, device=gpu).to(kind))
    ok["all_gather_into_tensor"] = torch.equal(
        out.cpu(), torch.arange(n).repeat_interleave(8).to(kind))
    piece = torch.zeros(4, device=gpu, dtype=kind)
    dist.reduce_scatter_tensor(piece, (torch.arange(4 * n, device=gpu) + r).to(kind))
    ok["reduce_scatter_tensor"] = torch.equal(
        piece.cpu(), (torch.arange(4 * r, 4 * r + 4) * n + sum(range(n))).to(kind))
    b = torch.full((5,), r + 1, device=gpu).to(kind)
    dist.broadcast(b, src=n - 1)
    ok["broadcast"] = torch.equal(b.cpu(), torch.full((5,), n).to(kind))
    check(all(ok.values()), f"{dtype}: {ok}")


@pytest.mark.mpi(min_size=1)
def test_collectives_do_not_wait_for_later_work_on_the_default_stream(gpu: Any) -> None:
    """DDP's bucket allreduces (async, in place, made on the default stream) and FSDP2's
    all-gathers and reduce-scatters (async, on streams of its own) finish while a kernel
    queued on the default stream after them still runs (the rest of a backward pass)."""
    from gpu import occupy_default_stream

    n, r = dist.get_world_size(), dist.get_rank()
    side = torch.cuda.Stream()
    buckets = [torch.arange(1 << 16, device=gpu, dtype=torch.float32) + r for _ in range(2)]
    with torch.cuda.stream(side):
        x = torch.arange(1 << 16, device=gpu, dtype=torch.float32) + r
        gathered = torch.empty(n << 16, device=gpu)
        piece = torch.empty(1 << 16, device=gpu)
        rows = torch.arange(n << 16, device=gpu, dtype=torch.float32) + r
        dist.all_gather_into_tensor(gathered, x, async_op=True).wait()  # plans, handles
        dist.reduce_scatter_tensor(piece, rows, async_op=True).wait()
    dist.all_reduce(buckets[0], async_op=True).wait()
    torch.cuda.synchronize()
    dist.barrier()
    bucket = dist.all_reduce(buckets[1], async_op=True)
    busy = occupy_default_stream(3.0)
    bucket.wait()
    with torch.cuda.stream(side):
        gathered.zero_()
        piece.zero_()
        works = [dist.all_gather_into_tensor(gathered, x, async_op=True),
                 dist.reduce_scatter_tensor(piece, rows, async_op=True)]
        for work in works:
            work.wait()
    overlapped = not busy.done
    busy.synchronize()
    torch.cuda.synchronize()
    check(overlapped, "the collectives waited for the default stream's later kernel")
    base = torch.arange(1 << 16, dtype=torch.float32)
    want = torch.cat([base + k for k in range(n)])
    summed = torch.arange(n << 16, dtype=torch.float32) * n + sum(range(n))
    check(torch.equal(buckets[1].cpu(), base * n + sum(range(n))) and
          torch.equal(gathered.cpu(), want) and
          torch.equal(piece.cpu(), summed[r << 16:(r + 1) << 16]),
          "all_reduce, all_gather_into_tensor and reduce_scatter_tensor")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_ranks_out_of_step_on_cuda_raise_at_once(gpu: Any) -> None:
    """An all_reduce of a CUDA tensor on the last rank, an all_gather_into_tensor on the
    others: MismatchError on every rank naming both (not a wait until the group's
    timeout), and the group goes on working."""
    n, r = dist.get_world_size(), dist.get_rank()
    try:
        if r == n - 1:
            dist.all_reduce(torch.ones(4, device=gpu))
        else:
            dist.all_gather_into_tensor(torch.zeros(4 * n, device=gpu),
                                        torch.ones(4, device=gpu))
        problem = "no error"
    except mt.MismatchError as exc:
        problem = "" if "called allreduce" in str(exc) and "called allgather" in str(exc) \
            else f"does not name both calls: {exc}"
    check(not problem, problem)
    t = torch.ones(3, device=gpu)
    dist.all_reduce(t)
    check(torch.equal(t.cpu(), torch.full((3,), float(n))), "usable after")


def make_model(device: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double().to(device)


def batch(step: int, rows: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randn(rows, 3, generator=g, dtype=torch.float64))


def one_process() -> list[Any]:
    """SGD on every rank's data at once, on the CPU."""
    n = dist.get_world_size()
    model = make_model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, BATCH * n)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120, method="thread")  # a deadlock blocks in C++, where no signal lands
@pytest.mark.parametrize("hook", ["none", "fp16", "powersgd"])
def test_ddp_on_cuda_equals_one_process(gpu: Any, hook: str) -> None:
    """DDP of a CUDA model (its reducer calls the backend from autograd's device
    thread; the fp16 hook's and PowerSGD's futures complete on mpitrain's threads)
    against SGD on the whole batch in one process on the CPU."""
    n, r = dist.get_world_size(), dist.get_rank()
    model = make_model(gpu)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[gpu])
    register_ddp_hook(ddp, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, BATCH * n)
        ((ddp(x[r::n].to(gpu)) - y[r::n].to(gpu)) ** 2).mean().backward()
        opt.step()
    want = one_process()
    err = max(float((p.detach().cpu() - w).abs().max())
              for p, w in zip(model.parameters(), want))
    tol = {"none": 1e-12, "powersgd": 1e-9}.get(hook, 5e-3)
    check(err <= tol, f"DDP on CUDA, hook={hook}: max error {err:.3g}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120, method="thread")
def test_fsdp2_on_cuda_equals_one_process(gpu: Any) -> None:
    """FSDP2's ``fully_shard`` of a CUDA model: its all-gathers and reduce-scatters of
    CUDA tensors on its own streams, against SGD in one process on the CPU."""
    from torch.distributed.fsdp import fully_shard

    n, r = dist.get_world_size(), dist.get_rank()
    model = make_model(gpu)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, BATCH * n)
        ((model(x[r::n].to(gpu)) - y[r::n].to(gpu)) ** 2).mean().backward()
        opt.step()
    got = [p.full_tensor().detach().cpu() for p in model.parameters()]
    err = max(float((g - w).abs().max()) for g, w in zip(got, one_process()))
    check(err <= 1e-12, f"FSDP2 on CUDA: max error {err:.3g}")
