"""mpitrain.torch.DistributedOptimizer: equivalence, overlap, hook order, misuse."""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import pytest
from helpers import assert_all_ranks

torch = pytest.importorskip("torch")
import mpitrain.torch as hvd  # noqa: E402

BATCH = 120
STEPS = 3


@pytest.fixture(autouse=True)
def _init(comm: Any, torch_device: str) -> None:
    hvd.init()
    torch.manual_seed(0)


def make_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3)).double()


def make_optimizer(kind: str, params: Any) -> Any:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=0.05, weight_decay=0.01)


def data(step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 5, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=g, dtype=torch.float64))


def loss_fn(model: Any, x: Any, y: Any, scale: float) -> Any:
    return 0.5 * scale * ((model(x) - y) ** 2).sum()


def reference(kind: str) -> list[Any]:
    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(step)
        loss_fn(model, x, y, 1.0 / BATCH).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def assert_close_all_ranks(got: list[Any], want: list[Any], rtol: float, what: str) -> None:
    err = max(float((g - w).abs().max() / w.abs().max()) for g, w in
              zip(got, [w.detach() for w in want]))
    assert_all_ranks(hvd_comm(), err <= rtol, f"{what}: relative error {err:.3g}")


def hvd_comm() -> Any:
    import mpitrain as mt

    return mt.default_communicator()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("batch", ["0", "200", "auto"])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_equivalence_with_one_big_batch(kind: str, passes: int, batch: str,
                                        env: pytest.MonkeyPatch) -> None:
    """Each gradient started at once (0), some held (200 bytes), the host's rule."""
    env.setenv("MPITRAIN_GRAD_BATCH_BYTES", batch)
    model = make_model(seed=hvd.rank())  # differ on purpose: the broadcast fixes them
    opt = hvd.DistributedOptimizer(make_optimizer(kind, model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    shard = BATCH // hvd.size()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(step)
        mine = slice(hvd.rank() * shard, (hvd.rank() + 1) * shard)
        for xs, ys in zip(x[mine].chunk(passes), y[mine].chunk(passes)):
            loss_fn(model, xs, ys, 1.0 / shard).backward()
        opt.step()
    got = [p.detach() for p in model.parameters()]
    assert_close_all_ranks(got, reference(kind), 1e-12, f"{kind} passes={passes}")


class WaitForAllreduce(torch.autograd.Function):
    """Identity whose backward blocks until the named allreduces have finished."""

    @staticmethod
    def forward(ctx: Any, x: Any, optimizer: Any, names: list[str]) -> Any:
        ctx.optimizer, ctx.names = optimizer, names
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        deadline = time.monotonic() + 60
        while True:
            handles = ctx.optimizer.reducer.handles()
            if all(n in handles and handles[n].test() for n in ctx.names):
                return grad, None, None
            if time.monotonic() > deadline:
                raise RuntimeError(f"allreduces {ctx.names} did not finish during backward: "
                                   f"in flight {sorted(handles)}")
            time.sleep(0.001)


@pytest.mark.mpi(min_size=2)
def test_allreduces_run_while_backward_runs(env: pytest.MonkeyPatch) -> None:
    """The last layer's gradients are averaged before backward reaches the first layer
    (where each gradient starts at once: MPITRAIN_GRAD_BATCH_BYTES=0)."""
    env.setenv("MPITRAIN_GRAD_BATCH_BYTES", "0")
    first, last = torch.nn.Linear(4, 8).double(), torch.nn.Linear(8, 2).double()
    params = [("first.weight", first.weight), ("first.bias", first.bias),
              ("last.weight", last.weight), ("last.bias", last.bias)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                                   named_parameters=params)
    late = ["grad.last.weight", "grad.last.bias"]
    x = torch.full((3, 4), float(hvd.rank() + 1), dtype=torch.float64)
    loss = last(WaitForAllreduce.apply(first(x), opt, late)).sum()
    loss.backward()
    backward_end = time.perf_counter()
    handles = opt.reducer.handles()
    early = [handles["grad.first.weight"], handles["grad.first.bias"]]
    overlapped = all(handles[n].finished_at is not None and handles[n].finished_at <
                     min(h.submitted_at for h in early) for n in late)
    assert_all_ranks(hvd_comm(), overlapped and all(handles[n].started_at < backward_end
                                                    for n in late),
                     "the last layer's allreduces must finish before the first layer's "
                     "gradients exist")
    opt.step()


def chain(widths: list[int]) -> Any:
    """Linear layers without biases: backward makes their gradients last layer first."""
    torch.manual_seed(5)
    return torch.nn.Sequential(*[torch.nn.Linear(a, b, bias=False).double()
                                 for a, b in zip(widths, widths[1:])])


def chain_step(model: Any, opt: Any) -> list[str]:
    """One step on rank-dependent data; the names in flight when backward ended."""
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7 + hvd.rank()
    model(x).pow(2).sum().backward()
    started = sorted(opt.reducer.handles())
    opt.step()
    return started


def chain_reference(widths: list[int]) -> list[Any]:
    model = chain(widths)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for r in range(hvd.size()):
        x = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7 + r
        (model(x).pow(2).sum() / hvd.size()).backward()
    opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.mpi(min_size=1)
def test_held_gradients_start_in_batches(env: pytest.MonkeyPatch) -> None:
    """With MPITRAIN_GRAD_BATCH_BYTES=500, final gradients wait until 500 bytes are
    ready. Backward makes the last layer's 336 bytes (they wait), the middle one's 560
    (both start, one batch), then the first one's 160 (they wait for step(), a second
    batch); every rank ends with the average of all ranks' gradients."""
    env.setenv("MPITRAIN_GRAD_BATCH_BYTES", "500")
    widths = [4, 5, 14, 3]
    model = chain(widths)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    assert opt.reducer.batch_bytes == 500
    assert [p.numel() * 8 for p in model.parameters()] == [160, 560, 336]
    comm = hvd_comm()
    comm.allreduce_async(np.zeros(1)).wait()  # the engine runs
    before = comm.async_stats()
    started = chain_step(model, opt)
    cycles = comm.async_stats().cycles - before.cycles
    assert_all_ranks(comm, started == ["grad.1.weight", "grad.2.weight"],
                     f"expected the two last layers' gradients in flight, got {started}")
    # the engine may not have run the first batch yet when step() submits the second:
    # then one cycle takes both
    assert_all_ranks(comm, cycles <= 2, f"two batches took {cycles} cycles")
    assert_close_all_ranks([p.detach() for p in model.parameters()], chain_reference(widths),
                           1e-12, "one batch in backward, one at step()")


@pytest.mark.mpi(min_size=1)
def test_a_whole_step_in_one_batch(env: pytest.MonkeyPatch) -> None:
    """A threshold above the model's size: nothing starts during backward, and step()
    runs every gradient's allreduce in one engine cycle and one collective."""
    env.setenv("MPITRAIN_GRAD_BATCH_BYTES", "1G")
    widths = [4, 5, 7, 3]
    model = chain(widths)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    comm = hvd_comm()
    comm.allreduce_async(np.zeros(1)).wait()  # the engine runs
    before = comm.async_stats()
    started = chain_step(model, opt)
    after = comm.async_stats()
    assert_all_ranks(comm, started == [], f"{started} started during backward")
    assert_all_ranks(comm, (after.cycles - before.cycles, after.collectives -
                            before.collectives) == (1, 1),
                     f"{after.cycles - before.cycles} cycles, "
                     f"{after.collectives - before.collectives} collectives for one step")
    assert_close_all_ranks([p.detach() for p in model.parameters()], chain_reference(widths),
                           1e-12, "one batch")


@pytest.mark.mpi(min_size=1)
def test_hooks_fire_in_rank_dependent_order() -> None:
    """Two branches evaluated in a rank-dependent order: hooks (and allreduces) differ."""
    torch.manual_seed(1)
    a, b = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    ref = copy.deepcopy((a, b))
    named = [(f"a.{n}", p) for n, p in a.named_parameters()] + \
            [(f"b.{n}", p) for n, p in b.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.5),
                                   named_parameters=named)
    fired: list[str] = []
    for name, p in named:
        p.register_post_accumulate_grad_hook(lambda _, n=name: fired.append(n))
    x = torch.arange(12, dtype=torch.float64).reshape(4, 3) + hvd.rank()
    outs = (a(x), b(x)) if hvd.rank() % 2 == 0 else tuple(reversed((b(x), a(x))))
    (outs[0] * 2 + outs[1]).pow(2).sum().backward()
    opt.step()
    orders = hvd.allgather_object(fired)
    if hvd.size() > 1:
        assert orders[0] != orders[1], "the test needs ranks whose hook order differs"
    ra, rb = ref
    ref_opt = torch.optim.SGD([*ra.parameters(), *rb.parameters()], lr=0.5)
    for r in range(hvd.size()):
        xr = torch.arange(12, dtype=torch.float64).reshape(4, 3) + r
        ((ra(xr) * 2 + rb(xr)).pow(2).sum() / hvd.size()).backward()
    ref_opt.step()
    assert_close_all_ranks([p.detach() for _, p in named],
                           [*ra.parameters(), *rb.parameters()], 1e-12, "hook order")


@pytest.mark.mpi(min_size=1)
def test_options_groups_compression_predivide() -> None:
    for options, rtol in (({"groups": 2}, 1e-12), ({"gradient_predivide_factor": 2.0}, 1e-12),
                          ({"compression": hvd.Compression.fp16}, 1e-3),
                          ({"compression": hvd.Compression.bf16}, 1e-2)):
        model = make_model()
        opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()), **options)
        shard = BATCH // hvd.size()
        x, y = data(0)
        mine = slice(hvd.rank() * shard, (hvd.rank() + 1) * shard)
        loss_fn(model, x[mine], y[mine], 1.0 / shard).backward()
        opt.step()
        ref = make_model()
        ref_opt = make_optimizer("sgd", ref.parameters())
        loss_fn(ref, x, y, 1.0 / BATCH).backward()
        ref_opt.step()
        assert_close_all_ranks([p.detach() for p in model.parameters()],
                               [p.detach() for p in ref.parameters()], rtol, str(options))
        assert all(p.grad.dtype == torch.float64 for p in model.parameters())


class HalvingCompressor(hvd.Compression.none):
    """A user's compressor that is not a plain cast: halves on the way out, doubles on
    the way back, so a reducer that skipped decompress would leave half the average."""

    calls = 0

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor * 0.5, "halved"

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        assert ctx == "halved"
        HalvingCompressor.calls += 1
        return tensor * 2.0


class CountedFP16(hvd.Compression.fp16):
    """The built-in float16 cast, counting decompress calls."""

    calls = 0

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        CountedFP16.calls += 1
        return hvd.Compression.fp16.decompress(tensor, ctx)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("compression", [HalvingCompressor, CountedFP16])
def test_reduced_gradients_are_stored_through_the_compressor(compression: Any) -> None:
    """A compressor's decompress runs unless it is a built-in cast (casts=True), whose
    cast back is the converting copy into p.grad: float64 gradients either way, equal
    to the reference."""
    widths = [4, 5, 7, 3]
    model = chain(widths)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    compression.calls = 0
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7 + hvd.rank()
    model(x).pow(2).sum().backward()
    grads = [p.grad for p in model.parameters()]
    opt.step()
    assert [p.grad.dtype for p in model.parameters()] == [torch.float64] * 3
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # stored in place
    assert compression.calls == (3 if compression is HalvingCompressor else 0)
    rtol = 1e-12 if compression is HalvingCompressor else 1e-3
    assert_close_all_ranks([p.detach() for p in model.parameters()], chain_reference(widths),
                           rtol, compression.__name__)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("kind", ["SGD", "SparseAdam"])
def test_sparse_gradients(sparse_as_dense: bool, kind: str) -> None:
    """Sparse gradients are averaged (allgathered, or allreduced as dense); SparseAdam,
    which takes nothing else, gets them sparse also with sparse_as_dense (SGD then gets
    them dense, which dense optimizers such as Adam need)."""
    def optimizer(params: Any) -> Any:
        return (torch.optim.SGD(params, lr=1.0) if kind == "SGD"
                else torch.optim.SparseAdam(list(params), lr=0.1))

    torch.manual_seed(3)
    emb = torch.nn.Embedding(10, 4, sparse=True).double()
    ref = copy.deepcopy(emb)
    opt = hvd.DistributedOptimizer(optimizer(emb.parameters()),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    rows = torch.tensor([hvd.rank() % 10, (3 * hvd.rank() + 1) % 10, 7])
    emb(rows).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse == (kind == "SparseAdam" or not sparse_as_dense)
    ref_opt = optimizer(ref.parameters())
    for r in range(hvd.size()):
        (ref(torch.tensor([r % 10, (3 * r + 1) % 10, 7])).sum() / hvd.size()).backward()
    ref_opt.step()
    assert_close_all_ranks([emb.weight.detach()], [ref.weight.detach()], 1e-12,
                           f"{kind}, sparse_as_dense={sparse_as_dense}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("named", [True, False])
def test_parameter_names(named: bool) -> None:
    """Horovod's ``_parameter_names``: each optimized parameter's allreduce name, unique
    and the same on every rank (``allreduce.noname.<group>.<index>`` without names)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    inner = torch.optim.SGD([{"params": model[0].parameters()},
                             {"params": model[1].parameters()}], lr=0.1)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters()
                                   if named else None)
    names = opt._parameter_names
    params = list(model.parameters())
    assert list(names) == params and len(set(names.values())) == len(params)
    want = (["0.weight", "0.bias", "1.weight", "1.bias"] if named else
            ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0",
             "allreduce.noname.1.1"])
    assert [names[p] for p in params] == want
    assert all(n == want for n in hvd.allgather_object([names[p] for p in params]))


@pytest.mark.mpi(min_size=2)
def test_ranks_outside_the_process_set_step_alone() -> None:
    """An optimizer on a set that leaves this rank out is the wrapped optimizer there, as
    in Horovod: the members average their gradients, every other rank steps on its own."""
    n, me = hvd.size(), hvd.rank()
    members = list(range(0, n, 2))
    ps = hvd.add_process_set(members)
    try:
        w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0),
                                       named_parameters=[("w", w)], process_set=ps)
        (w * (me + 1)).sum().backward()  # this rank's gradient: me + 1
        opt.step()
        mean = sum(r + 1 for r in members) / len(members)
        want = -(mean if me in members else me + 1)
        assert torch.equal(w.detach(), torch.full((3,), want, dtype=torch.float64))
    finally:
        hvd.remove_process_set(ps)


@pytest.mark.mpi(min_size=2)
def test_wrapper_delegates_and_refuses_misuse() -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults == inner.defaults and "SGD" in repr(opt)
    opt.param_groups[0]["lr"] = 0.2
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.2
    x, y = data(0)
    loss_fn(model, x, y, 1.0).backward()
    with pytest.raises(ValueError, match=r"zero_grad\(\) was called after backward"):
        opt.zero_grad()
    with pytest.raises(ValueError, match="increase backward_passes_per_step"):
        loss_fn(model, x, y, 1.0).backward()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    extra = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="not named"):
        opt.add_param_group({"params": [extra]})  # named_parameters lacks it
    plain = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain.add_param_group({"params": [extra]})
    (extra * (hvd.rank() + 1)).sum().backward()
    plain.step()
    assert_all_ranks(hvd_comm(), torch.allclose(
        extra, torch.full((2,), 1 - 0.1 * (hvd.size() + 1) / 2, dtype=torch.float64)),
        "add_param_group parameters are averaged")
    with pytest.raises(ValueError, match="sequence of tuples"):
        hvd.DistributedOptimizer(inner, named_parameters=list(model.parameters()))
    with pytest.raises(ValueError, match="must be unique"):
        hvd.DistributedOptimizer(inner, named_parameters=[("w", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(inner, named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match="needs op=Average"):
        hvd.DistributedOptimizer(inner, op=hvd.Adasum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="needs op=Average"):
        hvd.DistributedOptimizer(inner, op=hvd.Sum, gradient_predivide_factor=2.0)


def shards(size: int) -> list[slice]:
    """Each rank's rows of the batch (``np.array_split``'s, for any rank count)."""
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(BATCH), size)])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.mpi(min_size=2)
def test_skip_synchronize_for_clipping() -> None:
    """After synchronize() every rank holds the average over ranks of their gradients
    (each rank's loss is the mean over its shard), computed here on one process; the
    step inside skip_synchronize() is plain SGD with it."""
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(0)
    mine = shards(hvd.size())
    loss_fn(model, x[mine[hvd.rank()]], y[mine[hvd.rank()]],
            1.0 / (mine[hvd.rank()].stop - mine[hvd.rank()].start)).backward()
    opt.synchronize()
    ref = make_model()
    for rows in mine:  # the average over ranks of each rank's mean gradient
        loss_fn(ref, x[rows], y[rows], 1.0 / ((rows.stop - rows.start) * hvd.size())).backward()
    grads = [p.grad for p in model.parameters()]
    assert_close_all_ranks(grads, [p.grad for p in ref.parameters()], 1e-12,
                           "after synchronize(): the average gradient")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # what it is for: no-op here
    with opt.skip_synchronize():
        opt.step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert_close_all_ranks([p.detach() for p in model.parameters()], list(ref.parameters()),
                           1e-12, "the step with the averaged gradient")
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.synchronize()
        opt.step()


@pytest.mark.mpi(min_size=2)
def test_mismatched_models_raise_runtime_error() -> None:
    width = 3 if hvd.rank() == 0 else 4
    p = torch.nn.Parameter(torch.ones(width, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)])
    p.sum().backward()
    with pytest.raises(RuntimeError, match=r"grad\.p"):
        opt.step()
