"""``mpitrain.torch`` on real CUDA tensors: what a Horovod user's GPU training runs.

Skipped without a CUDA device (the same paths run on every machine on the fake GPU:
the ``torch_device`` fixture of ``tests/conftest.py`` runs the torch modules twice).
Rank ``r`` uses GPU ``local_rank % count``. Every result is checked against a reference
computed on the CPU: training against a one-process training on every rank's data.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from helpers import assert_all_ranks

torch = pytest.importorskip("torch")
import mpitrain as mt  # noqa: E402
import mpitrain.torch as hvd  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="torch sees no CUDA device")
STEPS, BATCH = 3, 24


@pytest.fixture(autouse=True)
def gpu(comm: Any) -> Any:
    """This rank's GPU, current for torch."""
    hvd.init()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def check(ok: Any, what: str) -> None:
    assert_all_ranks(mt.default_communicator(), bool(ok), what)


def on(device: Any, values: Any, dtype: Any = torch.float32) -> Any:
    return torch.as_tensor(np.asarray(values)).to(device=device, dtype=dtype)


@pytest.mark.mpi(min_size=1)
def test_async_and_grouped_ops_on_cuda_tensors(gpu: Any) -> None:
    """In place (the engine once refused CUDA tensors there), out of place, grouped,
    allgather, broadcast and reducescatter: results on the input's GPU, right values;
    the input produced by a kernel on a side stream (the engine waits for it)."""
    n, r = hvd.size(), hvd.rank()
    side = torch.cuda.Stream(device=gpu)
    with torch.cuda.stream(side):
        x = torch.arange(1000, device=gpu, dtype=torch.float32) * (r + 1)  # on `side`
        handle = hvd.allreduce_async_(x, op=hvd.Sum, name="cuda.inplace")
    out = hvd.synchronize(handle)
    want = torch.arange(1000, dtype=torch.float32) * n * (n + 1) / 2
    check(out is x and x.device == gpu and torch.equal(x.cpu(), want), "allreduce_async_")
    y = hvd.allreduce(torch.full((7, 3), float(r), device=gpu))
    check(y.device == gpu and torch.allclose(y.cpu(), torch.full((7, 3), (n - 1) / 2)),
          "allreduce Average out of place")
    group = [torch.full((5,), float(r + i), device=gpu, dtype=dtype)
             for i, dtype in enumerate((torch.float32, torch.float16, torch.bfloat16))]
    hvd.grouped_allreduce_(group, op=hvd.Sum)
    check(all(t.device == gpu and torch.equal(t.float().cpu(),
                                              torch.full((5,), float(n * (n - 1) / 2 + n * i)))
              for i, t in enumerate(group)), "grouped_allreduce_")
    rows = hvd.allgather(torch.full((r + 1, 2), float(r), device=gpu))
    want_rows = torch.cat([torch.full((s + 1, 2), float(s)) for s in range(n)])
    check(rows.device == gpu and torch.equal(rows.cpu(), want_rows), "allgather")
    b = torch.full((9,), float(r), device=gpu)
    hvd.broadcast_(b, root_rank=n - 1)
    check(torch.equal(b.cpu(), torch.full((9,), float(n - 1))), "broadcast_")
    block = hvd.reducescatter(torch.ones(2 * n, 3, device=gpu), op=hvd.Sum)
    check(block.device == gpu and torch.equal(block.cpu(), torch.full((2, 3), float(n))),
          "reducescatter")


@pytest.mark.mpi(min_size=1)
def test_broadcast_parameters_and_optimizer_state_of_a_cuda_model(gpu: Any) -> None:
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(gpu)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 3, device=gpu)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    flat = torch.cat([t.reshape(-1).double().cpu() for t in model.state_dict().values()] +
                     [v.reshape(-1).double().cpu() for s in opt.state.values()
                      for v in s.values()])
    every = hvd.allgather_object(flat)
    check(all(torch.equal(f, every[0]) for f in every), "state equals the root's")


def make_model(device: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3)).double().to(device)


def data(step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 5, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=g, dtype=torch.float64))


def train(model: Any, opt: Any, device: Any, shard: slice, passes: int = 1) -> list[Any]:
    """``STEPS`` steps on this rank's ``shard`` of each step's batch (the mean loss)."""
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(step)
        size = shard.stop - shard.start
        for xs, ys in zip(x[shard].chunk(passes), y[shard].chunk(passes)):
            out = model(xs.to(device))
            (0.5 / size * ((out - ys.to(device)) ** 2).sum()).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("compression, passes, fused", [
    ("none", 1, True), ("none", 2, False), ("fp16", 1, True), ("bf16", 1, True)])
def test_distributed_optimizer_on_cuda_equals_one_process(gpu: Any, compression: str,
                                                          passes: int, fused: bool,
                                                          configure: Callable[..., Any]
                                                          ) -> None:
    """DistributedOptimizer on a CUDA model (it once failed in the first backward):
    the parameters of a one-process training on the whole batch, on the CPU."""
    if not fused:
        configure(fusion_threshold=0)
    n, r = hvd.size(), hvd.rank()
    shard = slice(r * (BATCH // n), (r + 1) * (BATCH // n))
    model = make_model(gpu)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, compression),
                                   backward_passes_per_step=passes)
    got = train(model, opt, gpu, shard, passes)
    ref = make_model("cpu")
    want = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), "cpu",
                 slice(0, (BATCH // n) * n))
    tol = 1e-10 if compression == "none" else 2e-2
    err = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
    check(err <= tol, f"{compression} passes={passes} fused={fused}: relative error {err:.3g}")


@pytest.mark.mpi(min_size=2)
def test_adasum_and_sync_batch_norm_on_cuda(gpu: Any) -> None:
    """Adasum (reduced on the host) gives a CUDA model what it gives a CPU copy;
    SyncBatchNorm on CUDA matches BatchNorm over the whole batch."""
    n, r = hvd.size(), hvd.rank()
    if n & (n - 1) == 0:
        models = {dev: make_model(dev) for dev in (gpu, "cpu")}
        results = {}
        for dev, model in models.items():
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           op=hvd.Adasum)
            shard = slice(r * (BATCH // n), (r + 1) * (BATCH // n))
            results[dev] = train(model, opt, dev, shard)
        err = max(float((g - c).abs().max()) for g, c in zip(results[gpu], results["cpu"]))
        check(err <= 1e-10, f"Adasum on CUDA vs CPU: {err:.3g}")
    torch.manual_seed(7)
    whole = torch.randn(4 * n, 3, 5, dtype=torch.float64) * 3 + 1
    ref = torch.nn.BatchNorm1d(3).double()
    ref_in = whole.clone().requires_grad_()
    ref_out = ref(ref_in)  # one call: a second would update the running statistics again
    (ref_out ** 2).sum().backward()
    sync = hvd.SyncBatchNorm(3).double().to(gpu)
    mine = whole[4 * r:4 * (r + 1)].to(gpu).requires_grad_()
    out = sync(mine)
    (out ** 2).sum().backward()
    check(torch.allclose(out.detach().cpu(), ref_out[4 * r:4 * (r + 1)].detach()) and
          torch.allclose(mine.grad.cpu(), ref_in.grad[4 * r:4 * (r + 1)]) and
          torch.allclose(sync.running_mean.cpu(), ref.running_mean), "SyncBatchNorm on CUDA")


@pytest.mark.mpi(min_size=2)
def test_join_with_uneven_steps_on_cuda(gpu: Any) -> None:
    """Rank r does r + 1 allreduces of CUDA tensors, then joins; the ranks that joined
    contribute zeros."""
    n, r = hvd.size(), hvd.rank()
    results = [hvd.allreduce(torch.ones(4, device=gpu), op=hvd.Sum, name=f"j{i}")
               for i in range(r + 1)]
    last = hvd.join()
    want = [float(n - i) for i in range(r + 1)]  # ranks i..n-1 take part in step i
    check(last == n - 1 and all(t.device == gpu and torch.equal(t.cpu(), torch.full((4,), w))
                                for t, w in zip(results, want)), "join on CUDA")


@pytest.mark.mpi(min_size=1)
def test_build_flags_on_a_gpu(gpu: Any) -> None:
    """``cuda_built()`` is True here; ``nccl_built()`` stays 0 even where CuPy has NCCL
    (and device collectives use it): it tells Horovod scripts which semantics the
    operations have (Adasum over every rank), not what carries the bytes."""
    check(hvd.cuda_built() and hvd.nccl_built() == 0,
          f"cuda_built() {hvd.cuda_built()}, nccl_built() {hvd.nccl_built()}")
