"""Process sets of mpitrain.torch: registration, every collective on a subset of the
ranks against a local reference, async ops on several sets, the optimizer, misuse."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator

import pytest
from helpers import assert_all_ranks
from mpi4py import MPI

torch = pytest.importorskip("torch")
import mpitrain as mt  # noqa: E402
import mpitrain.torch as hvd  # noqa: E402


@pytest.fixture(autouse=True)
def _init(comm: Any, torch_device: str) -> Iterator[None]:
    if hvd.is_initialized():  # set ids count from 1 in a fresh registry: start afresh
        hvd.shutdown()  # even after other files' tests (set ids are never reused)
    hvd.init()
    yield
    if hvd.is_initialized():
        hvd.shutdown()  # frees the sets a test registered (the next test starts afresh)


def check(ok: bool, what: str) -> None:
    assert_all_ranks(mt.default_communicator(), bool(ok), what)


def candidate_sets(n: int) -> list[list[int]]:
    """Even ranks, odd ranks, all but the last (overlapping both) and the last rank alone;
    those that repeat another or are every rank are left out."""
    sets: list[list[int]] = []
    for ranks in ([r for r in range(n) if r % 2 == 0], [r for r in range(n) if r % 2],
                  list(range(n - 1)), [n - 1]):
        if ranks and ranks != list(range(n)) and ranks not in sets:
            sets.append(ranks)
    return sets


def value(r: int, count: int = 6, dtype: Any = torch.float64) -> Any:
    """Global rank ``r``'s input: differs by rank and index, sums exactly."""
    return (torch.arange(count, dtype=torch.float64) * 3 + r * 7 - 5).to(dtype)


def rows(r: int) -> Any:
    """Rank ``r``'s allgather input: ``r % 3 + 1`` rows of 2."""
    return torch.arange(2 * (r % 3 + 1), dtype=torch.float32).reshape(-1, 2) + 10 * r


@pytest.mark.mpi(min_size=2)
def test_registration_and_attributes() -> None:
    n, me = hvd.size(), hvd.rank()
    assert hvd.global_process_set.process_set_id == 0
    assert hvd.global_process_set.ranks == list(range(n))
    assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == me
    loose = hvd.ProcessSet([n - 1, 0])
    assert loose.ranks == sorted({0, n - 1}) and loose.process_set_id is None
    assert loose.size() is None and loose.rank() is None and loose.included() is None
    evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    assert isinstance(evens, hvd.ProcessSet) and evens.process_set_id == 1
    assert evens.size() == (n + 1) // 2
    assert evens.included() == (me % 2 == 0)
    assert evens.rank() == (me // 2 if me % 2 == 0 else -1)
    assert evens == hvd.ProcessSet(list(range(0, n, 2))) and evens != hvd.global_process_set
    assert "process_set_id=1" in repr(evens) and str(evens.ranks) in repr(evens)
    last = hvd.add_process_set(hvd.ProcessSet([n - 1]))
    assert last.process_set_id == 2 and last.size() == 1
    assert last.rank() == (0 if me == n - 1 else -1)


@pytest.mark.mpi(min_size=2)
def test_every_collective_on_each_set() -> None:
    n, me = hvd.size(), hvd.rank()
    sets = [hvd.add_process_set(ranks) for ranks in candidate_sets(n)]
    for ps in sets:
        if not ps.included():
            continue
        ranks, k, mine = ps.ranks, ps.size(), ps.rank()
        what = f"set {ranks}"
        exact = sum(value(r) for r in ranks)
        got = hvd.allreduce(value(me), op=hvd.Sum, process_set=ps)
        assert torch.equal(got, exact), f"{what} Sum {got}"
        got = hvd.allreduce(value(me), process_set=ps)
        assert torch.allclose(got, exact / k), f"{what} Average {got}"
        got = hvd.allreduce(value(me, dtype=torch.int32), op=hvd.Average, process_set=ps)
        assert torch.equal(got, torch.trunc(exact / k).to(torch.int32)), f"{what} int avg"
        got = hvd.allreduce(value(me), op=hvd.Max, process_set=ps)
        assert torch.equal(got, value(max(ranks))), f"{what} Max"
        inplace = value(me)
        hvd.allreduce_(inplace, op=hvd.Sum, process_set=ps)
        assert torch.equal(inplace, exact), f"{what} allreduce_"
        handle = hvd.allreduce_async(value(me), op=hvd.Sum, name="x", process_set=ps)
        assert torch.equal(hvd.synchronize(handle), exact), f"{what} allreduce_async"
        inplace = value(me)
        hvd.synchronize(hvd.allreduce_async_(inplace, op=hvd.Sum, process_set=ps))
        assert torch.equal(inplace, exact), f"{what} allreduce_async_"
        pair = hvd.grouped_allreduce([value(me), value(me, 3)], op=hvd.Sum, process_set=ps)
        assert torch.equal(pair[1], sum(value(r, 3) for r in ranks)), f"{what} grouped"
        pair = [value(me), value(me, 3)]
        hvd.grouped_allreduce_(pair, op=hvd.Sum, process_set=ps)
        assert torch.equal(pair[0], exact), f"{what} grouped_allreduce_"
        gathered = torch.cat([rows(r) for r in ranks])
        assert torch.equal(hvd.allgather(rows(me), process_set=ps), gathered), what
        both = hvd.synchronize(hvd.grouped_allgather_async([rows(me), value(me).reshape(3, 2)],
                                                           process_set=ps))
        assert torch.equal(both[0], gathered), f"{what} grouped_allgather_async"
        assert torch.equal(hvd.grouped_allgather([rows(me)], process_set=ps)[0], gathered)
        root = ranks[-1]  # a global rank
        assert torch.equal(hvd.broadcast(value(me), root, process_set=ps), value(root))
        tensor = value(me)
        hvd.broadcast_(tensor, root, process_set=ps)
        assert torch.equal(tensor, value(root)), f"{what} broadcast_"
        out = hvd.synchronize(hvd.broadcast_async(value(me), ranks[0], process_set=ps))
        assert torch.equal(out, value(ranks[0])), f"{what} broadcast_async"
        big = torch.stack([value(me) + i for i in range(2 * k + 1)])
        total = torch.stack([sum(value(r) for r in ranks) + k * i for i in range(2 * k + 1)])
        start = 3 * mine if mine < 1 else 3 + 2 * (mine - 1)
        mine_rows = 3 if mine < 1 else 2
        block = hvd.reducescatter(big, op=hvd.Sum, process_set=ps)
        assert torch.equal(block, total[start:start + mine_rows]), f"{what} reducescatter"
        blocks = hvd.grouped_reducescatter([big, big], op=hvd.Sum, process_set=ps)
        assert torch.equal(blocks[1], block), f"{what} grouped_reducescatter"
        sent = torch.stack([torch.full((2,), 100.0 * me + j) for j in range(k)])
        received = hvd.alltoall(sent, process_set=ps)
        assert torch.equal(received, torch.stack([torch.full((2,), 100.0 * r + mine)
                                                  for r in ranks])), f"{what} alltoall"
        splits = [1] * k
        out, counts = hvd.synchronize(hvd.alltoall_async(sent, splits, process_set=ps))
        assert torch.equal(out, received) and counts.tolist() == [1] * k
        hvd.barrier(process_set=ps)
        assert hvd.broadcast_object({"from": me}, root_rank=root, process_set=ps) == \
            {"from": root}, f"{what} broadcast_object"
        assert hvd.allgather_object(me, process_set=ps) == ranks, f"{what} allgather_object"
        assert hvd.join(process_set=ps) in ranks, f"{what} join"
    hvd.barrier()


@pytest.mark.mpi(min_size=2)
def test_gradients_flow_within_the_set() -> None:
    n, me = hvd.size(), hvd.rank()
    ps = hvd.add_process_set(list(range(1, n)) if n > 2 else [1])
    if ps.included():
        x = value(me).requires_grad_()
        hvd.allreduce(x, op=hvd.Sum, process_set=ps).sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, float(ps.size())))
        y = rows(me).requires_grad_()
        (hvd.allgather(y, process_set=ps) * (me + 1)).sum().backward()  # averaged over the set
        mean = sum(r + 1 for r in ps.ranks) / ps.size()
        assert torch.allclose(y.grad, torch.full_like(y, mean))
        z = value(me).requires_grad_()
        (hvd.broadcast(z, ps.ranks[0], process_set=ps) * (me + 1)).sum().backward()
        expected = mean if me == ps.ranks[0] else 0.0
        assert torch.allclose(z.grad, torch.full_like(z, expected))
    hvd.barrier()


@pytest.mark.mpi(min_size=2)
def test_async_ops_on_two_sets_interleave() -> None:
    n, me = hvd.size(), hvd.rank()
    first = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    second = hvd.add_process_set(list(range(1, n)) if n > 2 else [1])
    handles: list[tuple[int, Any]] = []
    for i in range(4):  # the same names on both sets: each set's engine matches its own
        for ps in (first, second):
            if ps.included():
                expected = sum(value(r) * (i + 1) for r in ps.ranks)
                handles.append((hvd.allreduce_async(value(me) * (i + 1), op=hvd.Sum,
                                                    name=f"grad.{i}", process_set=ps),
                                expected))
    for handle, expected in reversed(handles):
        got = hvd.synchronize(handle)
        assert torch.equal(got, expected), f"rank {me}: {got} != {expected}"
    hvd.barrier()


def make_model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 2)).double()


def batch(r: int, step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 * step + r)
    return (torch.randn(6, 4, generator=g, dtype=torch.float64),
            torch.randn(6, 2, generator=g, dtype=torch.float64))


@pytest.mark.mpi(min_size=2)
def test_optimizer_on_a_set_equals_the_single_process_math() -> None:
    n, me = hvd.size(), hvd.rank()
    ps = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    if ps.included():
        model = make_model()
        if me != ps.ranks[-1]:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # differs until broadcast_parameters
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        hvd.broadcast_parameters(model.state_dict(), root_rank=ps.ranks[-1], process_set=ps)
        hvd.broadcast_optimizer_state(inner, root_rank=ps.ranks[-1], process_set=ps)
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                       process_set=ps)
        reference = make_model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            x, y = batch(me, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            ref_opt.zero_grad()
            parts = [batch(r, step) for r in ps.ranks]
            loss = sum(torch.nn.functional.mse_loss(reference(px), py) for px, py in parts)
            (loss / len(parts)).backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-12), f"rank {me}: {p} != {q}"
    hvd.barrier()


def every_collective(ps: Any) -> list[tuple[str, Callable[[], Any]]]:
    t = torch.ones(4)
    return [
        ("allreduce", lambda: hvd.allreduce(t, process_set=ps)),
        ("allreduce_", lambda: hvd.allreduce_(t.clone(), process_set=ps)),
        ("allreduce_async", lambda: hvd.allreduce_async(t, process_set=ps)),
        ("allreduce_async_", lambda: hvd.allreduce_async_(t.clone(), process_set=ps)),
        ("grouped_allreduce", lambda: hvd.grouped_allreduce([t], process_set=ps)),
        ("grouped_allreduce_", lambda: hvd.grouped_allreduce_([t.clone()], process_set=ps)),
        ("grouped_allreduce_async", lambda: hvd.grouped_allreduce_async([t], process_set=ps)),
        ("allgather", lambda: hvd.allgather(t, process_set=ps)),
        ("allgather_async", lambda: hvd.allgather_async(t, process_set=ps)),
        ("grouped_allgather", lambda: hvd.grouped_allgather([t], process_set=ps)),
        ("broadcast", lambda: hvd.broadcast(t, 0, process_set=ps)),
        ("broadcast_", lambda: hvd.broadcast_(t.clone(), 0, process_set=ps)),
        ("broadcast_async", lambda: hvd.broadcast_async(t, 0, process_set=ps)),
        ("reducescatter", lambda: hvd.reducescatter(t, process_set=ps)),
        ("grouped_reducescatter", lambda: hvd.grouped_reducescatter([t], process_set=ps)),
        ("alltoall", lambda: hvd.alltoall(t, process_set=ps)),
        ("alltoall_async", lambda: hvd.alltoall_async(t, process_set=ps)),
        ("barrier", lambda: hvd.barrier(process_set=ps)),
        ("join", lambda: hvd.join(process_set=ps)),
        ("broadcast_object", lambda: hvd.broadcast_object(1, 0, process_set=ps)),
        ("allgather_object", lambda: hvd.allgather_object(1, process_set=ps)),
        ("broadcast_parameters", lambda: hvd.broadcast_parameters([t], 0, process_set=ps)),
    ]  # DistributedOptimizer: the wrapped optimizer outside its set (test_torch_optimizer)


@pytest.mark.mpi(min_size=2)
def test_outside_ranks_raise_at_once_and_members_go_on() -> None:
    n, me = hvd.size(), hvd.rank()
    ps = hvd.add_process_set([0])
    if ps.included():  # the member runs collectives alone while the others fail
        for _, call in every_collective(ps):
            call()
        with pytest.raises(ValueError, match=fr"root_rank={n - 1} is not in process set 1"):
            hvd.broadcast(torch.ones(2), n - 1, process_set=ps)
    else:
        for name, call in every_collective(ps):
            with pytest.raises(ValueError, match=fr"rank {me} is not in process set 1 "
                                                 r"\(ranks \[0\]\)") as info:
                call()
            assert isinstance(info.value, mt.MpitrainError), name
    check(hvd.allreduce(torch.ones(1), op=hvd.Sum)[0] == n, "global set still usable")


@pytest.mark.mpi(min_size=2)
def test_remove_then_use_is_an_error() -> None:
    n = hvd.size()
    ps = hvd.add_process_set([n - 1])
    first_id = ps.process_set_id
    assert hvd.remove_process_set(ps) is True
    assert ps.process_set_id is None and ps.size() is None
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(2), process_set=ps)
    with pytest.raises(ValueError, match="is not registered"):
        hvd.remove_process_set(ps)
    assert hvd.remove_process_set(hvd.global_process_set) is False
    again = hvd.add_process_set([n - 1])
    assert again.process_set_id != first_id
    if again.included():
        assert torch.equal(hvd.allreduce(torch.ones(2), process_set=again), torch.ones(2))
    hvd.barrier()


@pytest.mark.mpi(min_size=1)
def test_add_process_set_validation() -> None:
    n, me = hvd.size(), hvd.rank()
    for bad, match in (([0, 0], r"repeat \[0\]"), ([0, n], fr"\[{n}\] out of range"),
                       ([-1], r"\[-1\] out of range"), ([], "at least one rank"),
                       (["a"], "must be a list of ints"), (list(range(n)), "global process set")):
        with pytest.raises(ValueError, match=match):
            hvd.add_process_set(bad)
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
    if n == 1:  # every other set is the global one
        return
    ranks = [n - 1, 0] if n > 2 else [1]
    ps = hvd.add_process_set(ranks)
    assert ps.ranks == sorted(ranks)  # sorted, as Horovod sorts
    with pytest.raises(ValueError, match=r"registered already \(id 1\)"):
        hvd.add_process_set(hvd.ProcessSet(sorted(ranks)))
    with pytest.raises(ValueError, match="registered already"):
        hvd.add_process_set(ps)
    with pytest.raises(mt.MismatchError, match="disagree"):
        hvd.add_process_set([me])  # every rank a different set
    with pytest.raises(ValueError, match=r"list of hvd\.ProcessSet"):
        hvd.init(process_sets="everything")
    check(hvd.allreduce(torch.ones(1), op=hvd.Sum)[0] == n, "global set still usable")


@pytest.mark.mpi(min_size=2)
def test_sets_from_communicators() -> None:
    n, me = hvd.size(), hvd.rank()
    world = MPI.COMM_WORLD
    evens_only = world.Split(0 if me % 2 == 0 else MPI.UNDEFINED, me)
    ps = hvd.add_process_set(hvd.ProcessSet(evens_only))
    assert ps.ranks == list(range(0, n, 2)) and ps.included() == (me % 2 == 0)
    if ps.included():
        got = hvd.allreduce(value(me), op=hvd.Sum, process_set=ps)
        assert torch.equal(got, sum(value(r) for r in ps.ranks))
        evens_only.Free()
    halves = world.Split(me % 2, me)  # a different communicator on each half
    with pytest.raises(mt.MismatchError, match="disagree"):
        hvd.add_process_set(hvd.ProcessSet(halves))
    halves.Free()


@pytest.mark.mpi(min_size=2)
def test_init_registers_process_sets_and_shutdown_forgets_them() -> None:
    n = hvd.size()
    hvd.shutdown()
    evens = hvd.ProcessSet(list(range(0, n, 2)))
    last = hvd.ProcessSet([n - 1])
    hvd.init(process_sets=[evens, last])
    assert (evens.process_set_id, last.process_set_id) == (1, 2)
    hvd.init(process_sets="dynamic")  # accepted: sets can always be added
    if last.included():
        assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=last),
                           torch.ones(3))
    hvd.shutdown()
    assert evens.process_set_id is None and last.process_set_id is None
    hvd.init()
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(2), process_set=evens)


@pytest.mark.mpi(min_size=2)
def test_init_on_a_subset_of_the_world() -> None:
    n, me = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    hvd.shutdown()
    members = list(range(1, n))
    hvd.init(comm=members)
    assert hvd.is_initialized()
    if me in members:
        assert hvd.size() == n - 1 and hvd.rank() == me - 1
        assert hvd.global_process_set.ranks == list(range(n - 1))
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum)
        assert torch.equal(got, torch.full((2,), float(n - 1)))
    else:
        for call in (lambda: hvd.allreduce(torch.ones(2)), hvd.size, hvd.barrier):
            with pytest.raises(ValueError, match=r"rank 0 of MPI_COMM_WORLD is not in "
                                                 r"hvd.init\(comm=\["):
                call()
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="distinct ranks"):
        hvd.init(comm=[0, 0])
    hvd.init()
    check(hvd.size() == n, "back on every rank")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("on_a_set", [False, True])
def test_first_async_call_needs_no_other_rank(on_a_set: bool) -> None:
    """hvd.init (and add_process_set) start the async engine, as Horovod starts its
    background thread: a rank's first async call is then its own, so rank 0's named
    operation may wait while the others are in a barrier (a named operation is matched
    by name, a barrier waits for the ranks only), and the others submit theirs after."""
    n, me = hvd.size(), hvd.rank()
    ps = hvd.add_process_set([0, 1]) if on_a_set and n > 2 else hvd.global_process_set
    if ps.included():
        members = ps.ranks if ps.ranks else list(range(n))
        if me == members[0]:
            handle = hvd.allreduce_async(value(me), name="first", op=hvd.Sum, process_set=ps)
            hvd.barrier(process_set=ps)
        else:
            hvd.barrier(process_set=ps)
            handle = hvd.allreduce_async(value(me), name="first", op=hvd.Sum, process_set=ps)
        assert torch.equal(hvd.synchronize(handle), sum(value(r) for r in members))
    hvd.barrier()


@pytest.mark.mpi(min_size=2)
def test_a_set_barrier_returns_on_no_member_before_the_last_has_entered() -> None:
    """Even and odd ranks in two sets, each with a barrier of its own at once: each
    member of a set in turn enters late, right after creating a file, and every member
    finds that file once its barrier returns (a file, not a clock: Horovod's
    test_process_set_barrier_op times the barrier from each rank's own start, which
    ranks sharing cores do not reach together)."""
    n, me = hvd.size(), hvd.rank()
    sets = [hvd.add_process_set([r for r in range(n) if r % 2 == parity]) for parity in (0, 1)]
    mine = sets[me % 2]
    folder = hvd.broadcast_object(tempfile.mkdtemp() if me == 0 else None)
    try:
        for turn in range(max(len(s.ranks) for s in sets)):
            late = mine.ranks[turn % len(mine.ranks)]
            marker = os.path.join(folder, f"turn{turn}-rank{late}")
            hvd.allreduce_(torch.ones(1), None, f"before_set_barrier{turn}", hvd.Sum)
            if me == late:
                time.sleep(0.2)
                open(marker, "w").close()
            hvd.barrier(process_set=mine)
            check(os.path.exists(marker),
                  f"the barrier of set {mine.ranks} returned before rank {late} entered it")
    finally:
        hvd.barrier()
        if me == 0:
            shutil.rmtree(folder)
