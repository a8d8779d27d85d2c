"""torch.distributed over the "mpitrain" backend: every collective against a numpy
reference, async work and futures, groups and meshes, misuse on one rank, and DDP,
FSDP2 and a pipeline schedule against one-process references.

The default process group is made once for the module, as a user's script makes it
under ``mpirun`` (no MASTER_ADDR: the backend's rendezvous takes ranks from MPI). Every
test runs on CPU tensors and again with them taken for tensors on the fake GPU of
``tests/fake_device.py`` (the ``torch_device`` fixture).
"""

from __future__ import annotations

import copy
import datetime
from typing import Any, Iterator

import numpy as np
import pytest
from helpers import assert_all_ranks, crafted, reference, register_ddp_hook

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import mpitrain as mt  # noqa: E402
import mpitrain.torch  # noqa: E402  (registers the backend)
from mpitrain.torch.tensors import from_host  # noqa: E402

R = dist.ReduceOp
INTS = ["uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]


@pytest.fixture(scope="module", autouse=True)
def group() -> Iterator[Any]:
    """The default process group over every rank, made as a user's script makes it."""
    dist.init_process_group("mpitrain", timeout=datetime.timedelta(seconds=120))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _device(torch_device: str) -> None:
    """Every test on CPU tensors, and again on the fake GPU (the path of CUDA tensors)."""


def world() -> mt.Communicator:
    return mt.init()


def check(ok: Any, what: str) -> None:
    assert_all_ranks(world(), bool(ok), what)


def tensor(rank: int, count: int, dtype: str, op: mt.ReduceOp = mt.Sum) -> Any:
    """The crafted values of ``tests/helpers.py`` as a tensor (exact reductions)."""
    return from_host(crafted(rank, count, dtype, op).copy())


def expected(count: int, dtype: str, op: mt.ReduceOp) -> Any:
    return from_host(reference(dist.get_world_size(), count, dtype, op))


def same(got: Any, want: Any) -> bool:
    """Exact equality of dtype, shape and values."""
    return got.dtype == want.dtype and got.shape == want.shape and bool(
        torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.dtype == torch.bool
        else torch.equal(got, want))


# -- all_reduce -------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", INTS + FLOATS + COMPLEX)
def test_all_reduce_every_dtype_and_op(dtype: str) -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    ops = [(R.SUM, mt.Sum)]
    if "complex" not in dtype:  # (torch reduces complex tensors as real pairs: sums only)
        ops += [(R.PRODUCT, mt.Product), (R.MIN, mt.Min), (R.MAX, mt.Max)]
    if dtype in FLOATS + COMPLEX:
        ops += [(R.AVG, mt.Average)]
    for count in (1, n + 1, 1001):
        for torch_op, op in ops:
            t = tensor(r, count, dtype, op)
            dist.all_reduce(t, op=torch_op)
            check(same(t, expected(count, dtype, op)), f"all_reduce {torch_op} {dtype}[{count}]")
    if dtype in ("float32", "float64", "bfloat16"):
        t = tensor(r, 33, dtype)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        check(same(t, expected(33, dtype, mt.Sum) * 2), f"PREMUL_SUM {dtype}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["bool", "uint8", "int32", "int64"])
def test_bitwise_and_bool_reductions(dtype: str) -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    values = [np.arange(40, dtype=np.int64) * (3 * s + 1) % 256 for s in range(n)]
    if dtype == "bool":
        values = [v % 3 == 0 for v in values]
    mine = lambda: torch.from_numpy(values[r].astype(dtype))  # noqa: E731
    for op, fold in ((R.BAND, np.bitwise_and), (R.BOR, np.bitwise_or),
                     (R.BXOR, np.bitwise_xor)):
        t = mine()
        dist.all_reduce(t, op=op)
        want = values[0].astype(dtype)
        for v in values[1:]:
            want = fold(want, v.astype(dtype))
        check(np.array_equal(t.numpy(), want), f"{op} {dtype}")
    if dtype == "bool":  # a sum is an or, a product an and, as over gloo and NCCL
        for op, fold in ((R.MIN, np.logical_and), (R.MAX, np.logical_or),
                         (R.SUM, np.logical_or), (R.PRODUCT, np.logical_and)):
            t = mine()
            dist.all_reduce(t, op=op)
            want = values[0]
            for v in values[1:]:
                want = fold(want, v)
            check(np.array_equal(t.numpy(), want), f"{op} bool")
            t = mine()
            dist.reduce(t, dst=n - 1, op=op)
            check(np.array_equal(t.numpy(), want if r == n - 1 else values[r]),
                  f"reduce {op} bool")
            block = torch.empty(40 // n if 40 % n == 0 else 0, dtype=torch.bool)
            if block.numel():
                dist.reduce_scatter_tensor(block, mine(), op=op)
                check(np.array_equal(block.numpy(), want[r * block.numel():][:block.numel()]),
                      f"reduce_scatter_tensor {op} bool")
        flags, counts = [mine(), mine()], torch.ones(3)
        with dist._coalescing_manager(async_ops=True) as cm:
            for x in (*flags, counts):  # bool beside float: an or beside a sum
                dist.all_reduce(x)
        cm.wait()
        want = np.logical_or.reduce(values)
        check(all(np.array_equal(x.numpy(), want) for x in flags) and
              torch.equal(counts, torch.full((3,), float(n))), "coalesced bool sum")
        for op in (R.AVG, dist._make_nccl_premul_sum(2.0)):
            try:
                dist.all_reduce(mine(), op=op)
                problem = "no error"
            except (RuntimeError, TypeError, ValueError) as exc:
                problem = "" if "bool tensors take" in str(exc) else str(exc)
            check(not problem, f"bool {op}: {problem}")


@pytest.mark.mpi(min_size=1)
def test_async_work_future_and_coalescing() -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    t = tensor(r, 1001, "float32")
    work = dist.all_reduce(t, async_op=True)
    future = work.get_future()
    work.wait()
    check(work.is_completed() and future.wait()[0] is t, "work and future")
    check(same(t, expected(1001, "float32", mt.Sum)), "async all_reduce")
    chained = dist.all_reduce(tensor(r, 5, "float64"), async_op=True).get_future().then(
        lambda f: f.value()[0] * 2)
    check(same(chained.wait(), expected(5, "float64", mt.Sum) * 2), "future.then")
    tensors = [tensor(r + i, 7 + i, "float32") for i in range(4)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for x in tensors:
            dist.all_reduce(x)
    cm.wait()
    for i, x in enumerate(tensors):
        want = sum(tensor(s + i, 7 + i, "float32") for s in range(n))
        check(same(x, want), f"coalesced #{i}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_sparse_all_reduce(dtype: str) -> None:
    """``all_reduce`` of sparse COO tensors (as gloo takes them, and DDP gives them for an
    ``Embedding(sparse=True)``): SUM and AVG of uncoalesced tensors with other non-zeros
    on every rank, written into the tensor; other ops, and a rank whose tensor is of
    another shape, fail every rank. DDP with a sparse embedding equals one process."""
    n, r = dist.get_world_size(), dist.get_rank()

    def mine(rank: int, rows: int = n + 2) -> Any:  # rank + 1 entries, one repeated
        at = torch.tensor([[rank % rows] + [(rank + k) % rows for k in range(rank + 1)],
                           [0] + [k % 3 for k in range(rank + 1)]])
        values = torch.arange(2, rank + 4).to(getattr(torch, dtype)) * (rank + 1)
        return torch.sparse_coo_tensor(at, values, (rows, 3))

    total = sum((mine(q).to_dense() for q in range(n)), torch.zeros(n + 2, 3, dtype=getattr(
        torch, dtype)))
    t = mine(r)
    dist.all_reduce(t)
    check(t.is_sparse and torch.equal(t.to_dense(), total), "SUM")
    t = mine(r)
    work = dist.all_reduce(t, op=R.AVG, async_op=True)
    got = work.get_future().wait()[0]
    want = total / n if dtype == "float32" else torch.div(total, n, rounding_mode="trunc")
    check(got is t and torch.allclose(t.to_dense(), want), "AVG, async, its future")
    if dtype == "int64":  # (one DDP check is enough)
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.EmbeddingBag(20, 4, sparse=True),
                                    torch.nn.Linear(4, 1)).double()
        reference = copy.deepcopy(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ddp, reference)]
        for step in range(3):
            ids = torch.randint(0, 20, (n, 4, 3), generator=torch.Generator().manual_seed(step))
            for o in opts:
                o.zero_grad()
            ddp(ids[r]).sum().backward()
            (sum(reference(ids[q]).sum() for q in range(n)) / n).backward()
            for o in opts:
                o.step()
        check(close(list(model.parameters()), list(reference.parameters()), 1e-12),
              "DDP with a sparse embedding")
    for what, op, sent in [("MAX", R.MAX, mine(r)),
                           ("a rank of another shape", R.SUM,
                            mine(r, n + 3) if r == n - 1 else mine(r))]:
        if n == 1 and op == R.SUM:
            continue
        try:
            dist.all_reduce(sent, op=op)
            problem = "no error"
        except (RuntimeError, ValueError) as exc:
            problem = "" if what in str(exc) or "shape" in str(exc) else f"{exc}"
        check(not problem, f"{what}: {problem}")
    t = mine(r)
    dist.all_reduce(t)
    check(torch.equal(t.to_dense(), total), "after")


# -- the other collectives ----------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["uint8", "int64", "float16", "bfloat16", "float64",
                                   "complex64", "bool"])
def test_gathers_broadcasts_and_reduce(dtype: str) -> None:
    n, r = dist.get_world_size(), dist.get_rank()

    def mine(rank: int, count: int) -> Any:
        if dtype == "bool":
            return torch.arange(count) % (rank + 2) == 0
        return tensor(rank, count, dtype)

    root = n - 1
    b = mine(r, 17)
    dist.broadcast(b, src=root)
    check(same(b, mine(root, 17)), "broadcast")
    outs = [torch.empty_like(mine(0, 9)) for _ in range(n)]
    dist.all_gather(outs, mine(r, 9))
    check(all(same(o, mine(s, 9)) for s, o in enumerate(outs)), "all_gather")
    out = torch.empty(9 * n, dtype=mine(0, 1).dtype)
    dist.all_gather_into_tensor(out, mine(r, 9))
    check(same(out, torch.cat([mine(s, 9) for s in range(n)])), "all_gather_into_tensor")
    if dtype == "bool":
        return
    x = tensor(r, 21, dtype)
    dist.reduce(x, dst=0)
    check(same(x, expected(21, dtype, mt.Sum) if r == 0 else tensor(r, 21, dtype)),
          "reduce (the others' tensors unchanged)")
    block = torch.empty(6, dtype=x.dtype)
    dist.reduce_scatter_tensor(block, tensor(r, 6 * n, dtype))
    check(same(block, expected(6 * n, dtype, mt.Sum)[6 * r:6 * (r + 1)]),
          "reduce_scatter_tensor")
    block = torch.empty(4, dtype=x.dtype)
    dist.reduce_scatter(block, [tensor(r + s, 4, dtype) for s in range(n)])
    want = sum(tensor(q + r, 4, dtype) for q in range(n))
    check(same(block, want.to(block.dtype)), "reduce_scatter of a list")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("counting", ["bytes", "units"])
def test_gather_scatter_all_to_all_and_uneven_splits(counting: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """gather, scatter, all_to_all and all_to_all_single (uneven splits; into its own
    input), with MPI's counts in bytes, and in rows or elements, as from 2 GiB on
    (forced here at any size)."""
    if counting == "units":
        from mpitrain.torch import distributed as backend

        monkeypatch.setattr(backend, "BYTE_COUNT_LIMIT", 1)
    n, r = dist.get_world_size(), dist.get_rank()
    root = n - 1
    got = [torch.empty(3, dtype=torch.int32) for _ in range(n)] if r == root else None
    dist.gather(torch.full((3,), r, dtype=torch.int32), got, dst=root)
    if r == root:
        check(all(torch.equal(g, torch.full((3,), s, dtype=torch.int32))
                  for s, g in enumerate(got or [])), "gather")
    else:
        check(True, "gather")
    piece = torch.empty(2, dtype=torch.bfloat16)
    dist.scatter(piece, [torch.full((2,), float(s), dtype=torch.bfloat16) for s in range(n)]
                 if r == 0 else None, src=0)
    check(torch.equal(piece, torch.full((2,), float(r), dtype=torch.bfloat16)), "scatter")
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * r + s)) for s in range(n)])
    check(all(torch.equal(o, torch.full((2,), float(10 * s + r))) for s, o in enumerate(outs)),
          "all_to_all")
    outs = [torch.empty(r + s + 1, dtype=torch.complex64) for s in range(n)]  # uneven
    dist.all_to_all(outs, [torch.full((s + r + 1,), complex(r, s)) for s in range(n)])
    check(all(torch.equal(o, torch.full((r + s + 1,), complex(s, r))) for s, o in enumerate(outs)),
          "all_to_all of tensors of different sizes")
    # uneven: rank r sends s + r + 1 rows of 3 to rank s
    sends = [s + r + 1 for s in range(n)]
    receives = [r + s + 1 for s in range(n)]
    source = torch.cat([torch.full((k, 3), float(100 * r + s)) for s, k in enumerate(sends)])
    output = torch.empty(sum(receives), 3)
    dist.all_to_all_single(output, source, receives, sends)
    want = torch.cat([torch.full((k, 3), float(100 * s + r)) for s, k in enumerate(receives)])
    check(torch.equal(output, want), "all_to_all_single, uneven splits")
    same = torch.arange(n * 3, dtype=torch.float32) + 100 * r  # output is the input
    dist.all_to_all_single(same, same)
    want = torch.cat([torch.arange(3, dtype=torch.float32) + 3 * r + 100 * s for s in range(n)])
    check(torch.equal(same, want), f"all_to_all_single into its own input: {same}")


@pytest.mark.mpi(min_size=1)
def test_point_to_point_and_objects() -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty(5, dtype=torch.float64)
    requests = [dist.isend(torch.full((5,), float(r), dtype=torch.float64), right, tag=3),
                dist.irecv(incoming, left, tag=3)]
    for req in requests:
        req.wait()
    check(torch.equal(incoming, torch.full((5,), float(left), dtype=torch.float64)),
          "isend/irecv around the ring")
    ops = [dist.P2POp(dist.isend, torch.arange(4) + r, right),
           dist.P2POp(dist.irecv, incoming2 := torch.empty(4, dtype=torch.int64), left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    check(torch.equal(incoming2, torch.arange(4) + left), "batch_isend_irecv")
    ok = True
    if r == n - 1 and n > 1:
        dist.send(torch.full((2,), 7.0), 0, tag=5)
    if r == 0 and n > 1:  # from any source: recv names the rank it came from
        got = torch.empty(2)
        sender = dist.recv(got, tag=5)
        ok = sender == n - 1 and torch.equal(got, torch.full((2,), 7.0))
    check(ok, "recv from any source")
    objects: list[Any] = [None] * n
    dist.all_gather_object(objects, {"rank": r, "text": "x" * r})
    check(objects == [{"rank": s, "text": "x" * s} for s in range(n)], "all_gather_object")
    box = [r, "r"] if r == n - 1 else [None, None]
    dist.broadcast_object_list(box, src=n - 1)
    check(box == [n - 1, "r"], "broadcast_object_list")
    dist.barrier()


@pytest.mark.mpi(min_size=2)
def test_a_message_of_another_size_is_refused() -> None:
    """A receive into a tensor of another size than the one sent raises ArgumentError
    on the receiving rank (MPI itself fills a larger tensor in part and says nothing),
    from a given rank and from any rank; the next message is received as sent."""
    r = dist.get_rank()
    errors = []
    for sent, room, any_rank in [(4, 8, False), (8, 4, False), (4, 8, True), (8, 4, True)]:
        if r == 1:
            dist.send(torch.arange(sent, dtype=torch.float64), 0, tag=9)
            dist.send(torch.arange(3, dtype=torch.float64) + sent, 0, tag=9)
        elif r == 0:
            try:
                dist.recv(torch.empty(room, dtype=torch.float64), None if any_rank else 1,
                          tag=9)
                errors.append(f"{sent} into {room}: no error")
            except mt.ArgumentError as exc:
                if "send and receive tensors of the same size" not in str(exc):
                    errors.append(f"{sent} into {room}: {exc}")
            after = torch.empty(3, dtype=torch.float64)
            dist.recv(after, 1, tag=9)
            if not torch.equal(after, torch.arange(3, dtype=torch.float64) + sent):
                errors.append(f"{sent} into {room}: then received {after}")
    check(not errors, f"{errors}")
    dist.barrier()


@pytest.mark.mpi(min_size=1)
def test_point_to_point_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of a message's size or more are sent in several (pieces of 24 bytes here,
    and the rest), received from a given rank and from any rank, around the ring."""
    from mpitrain.torch import distributed as backend

    monkeypatch.setattr(backend, "PIECE_BYTES", 24)
    n, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    wrong = []
    for count in (50, 6, 1):  # 16 pieces and 16 bytes; 2 pieces and an empty one; whole
        mine = torch.arange(count, dtype=torch.float64) * (r + 1)
        incoming = torch.empty(count, dtype=torch.float64)
        for req in [dist.isend(mine, right, tag=4), dist.irecv(incoming, left, tag=4)]:
            req.wait()
        ok = torch.equal(incoming, torch.arange(count, dtype=torch.float64) * (left + 1))
        if n > 1:
            if r == 1:
                dist.send(mine, 0, tag=6)
            if r == 0:
                got = torch.empty(count, dtype=torch.float64)
                ok = ok and dist.recv(got, tag=6) == 1 and torch.equal(got, mine / (r + 1) * 2)
        if not ok:
            wrong.append(count)
    check(not wrong, f"point to point in pieces: wrong for {wrong} float64s")


@pytest.mark.mpi(min_size=2)
@pytest.mark.host_only("2 GiB in host memory")
def test_a_message_of_more_than_2_gib() -> None:
    """A send of more than 2 GiB (which Open MPI refuses as one message) arrives whole,
    from rank 1 to rank 0; run at 2 ranks only, for its memory."""
    n, r = dist.get_world_size(), dist.get_rank()
    if n != 2:
        pytest.skip("2 ranks only")
    count = (1 << 31) + 24
    ok = True
    if r == 1:
        sent = torch.zeros(count, dtype=torch.uint8)
        sent[:3], sent[-3:], sent[1 << 30] = 1, 2, 3
        dist.send(sent, 0, tag=2)
    else:
        got = torch.empty(count, dtype=torch.uint8)
        dist.recv(got, 1, tag=2)
        ok = (got[:3].tolist() == [1] * 3 and got[-3:].tolist() == [2] * 3
              and int(got[1 << 30]) == 3 and int(got[(1 << 30) + 1]) == 0)
    check(ok, "a message of 2 GiB and 24 bytes")


@pytest.mark.mpi(min_size=2)
def test_wait_with_a_timeout_leaves_the_operation_in_flight() -> None:
    """Work.wait(timeout) on a receive whose message has not been sent raises
    DistBackendError after the timeout; once the message is sent, wait() finishes the
    same receive with its data. The same for an all_reduce the other ranks join late."""
    r = dist.get_rank()
    got = torch.zeros(3)
    problem = ""
    if r == 0:
        work = dist.irecv(got, src=1, tag=11)
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.2))
            problem = "no error at the timeout"
        except dist.DistBackendError as exc:
            problem = "" if "timeout of 0.2 s" in str(exc) else f"unexpected message: {exc}"
    check(not problem, problem)  # rank 1 sends only after rank 0's wait timed out
    if r == 1:
        dist.send(torch.full((3,), 5.0), 0, tag=11)
    if r == 0:
        work.wait()
    check(r != 0 or torch.equal(got, torch.full((3,), 5.0)), f"received {got}")
    total = torch.ones(2)  # the same for a collective that the other ranks join late
    dist.all_reduce(torch.ones(1))  # (the group's engine starts in a collective of its own)
    if r == 0:
        work = dist.all_reduce(total, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.2))
            problem = "all_reduce: no error at the timeout"
        except dist.DistBackendError:
            problem = ""
    check(not problem, problem)
    if r == 0:
        work.wait()
    else:
        dist.all_reduce(total)
    check(torch.equal(total, torch.full((2,), float(dist.get_world_size()))), f"{total}")


# -- groups -------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_groups_and_device_meshes() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    n, r = dist.get_world_size(), dist.get_rank()
    evens = dist.new_group(list(range(0, n, 2)))
    if r % 2 == 0:
        t = torch.full((3,), float(r))
        dist.all_reduce(t, group=evens)
        check_members = torch.equal(t, torch.full((3,), float(sum(range(0, n, 2)))))
    else:
        check_members = dist.get_rank(evens) == -1  # not a member
    check(check_members, "all_reduce on the even ranks")
    mesh = init_device_mesh("cpu", (n,))
    t = torch.ones(2)
    dist.all_reduce(t, group=mesh.get_group())
    check(torch.equal(t, torch.full((2,), float(n))), "1-d mesh")
    if n == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = torch.full((1,), float(r))
        dist.all_reduce(t, group=mesh2.get_group("tp"))
        pair = [2 * (r // 2), 2 * (r // 2) + 1]
        check(torch.equal(t, torch.full((1,), float(sum(pair)))), "2-d mesh, tp")


@pytest.mark.mpi(min_size=1)
def test_what_torch_asks_of_the_groups_backends() -> None:
    """What torch does with a group's backends, done here on CPU (torch without CUDA
    refuses a CUDA ``device_id``): ``init_process_group(device_id=cuda:N)`` asks the
    new group for the backend of that device and whether it splits, then binds the
    group to it (a bound group makes DeviceMesh split groups, which this backend
    cannot); Inductor asks the CUDA backend for time estimates; torch's own error for a
    device the backend does not serve."""
    group = dist.group.WORLD
    cuda = torch.device("cuda", 0)
    answers = (group._get_backend(cuda).supports_splitting,
               group._get_backend(torch.device("cpu")).supports_splitting,
               group._get_backend(cuda).supports_time_estimate)
    group.bound_device_id = cuda
    try:
        group._get_backend(torch.device("meta"))
        refused = False
    except RuntimeError as exc:
        refused = "No backend type associated with device type meta" in str(exc)
    check(answers == (False, False, False) and group.bound_device_id is None and refused,
          f"splits / time estimates: {answers}; bound to {group.bound_device_id}; "
          f"meta refused: {refused}")


@pytest.mark.mpi(min_size=1)
def test_destroying_a_group_releases_it() -> None:
    """destroy_process_group(group) stops the group's engine thread and frees its
    communicators (torch calls the backend's shutdown): groups made and destroyed in a
    loop leave no threads behind, and each works while it lives."""
    import threading

    n = dist.get_world_size()
    before = threading.active_count()
    for round in range(3):
        group = dist.new_group(list(range(n)))
        t = torch.full((2,), float(round))
        dist.all_reduce(t, group=group)  # starts the group's engine (its thread)
        check(torch.equal(t, torch.full((2,), float(round * n))), f"round {round}")
        dist.destroy_process_group(group)
    after = threading.active_count()
    check(after == before, f"{after - before} threads left behind by 3 destroyed groups")


# -- misuse ------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_disagreeing_ranks_raise_on_every_rank() -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    last = r == n - 1
    for make in (lambda: torch.ones(5 if last else 4),                          # shape
                 lambda: torch.ones(4, dtype=torch.float64 if last else torch.float32)):
        try:
            dist.all_reduce(make())
            problem = "no error"
        except RuntimeError as exc:
            problem = "" if "disagree" in str(exc) or "different arguments" in str(exc) \
                else f"not named as a disagreement: {exc}"
        check(not problem, problem)
    try:  # refused on one rank by its own checks: the others fail too, naming it
        dist.all_reduce(torch.ones(3, dtype=torch.bool) if last else torch.ones(3), op=R.AVG)
        problem = "no error"
    except (RuntimeError, TypeError, ValueError) as exc:
        problem = "" if last or f"rank {n - 1}" in str(exc) else f"does not name the rank: {exc}"
    check(not problem, problem)
    t = torch.ones(3)
    dist.all_reduce(t)
    check(torch.equal(t, torch.full((3,), float(n))), "usable after")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["uint8", "bfloat16", "float32", "complex128", "bool"])
def test_all_gather_of_tensors_of_different_sizes(dtype: str) -> None:
    """torch's ``all_gather`` takes tensors of other sizes on other ranks (the outputs
    sized as each rank's input): odd sizes, an empty tensor, 2-D rows; a rank whose
    outputs are sized otherwise than the ranks send, or ranks sending other dtypes,
    fail every rank, naming it."""
    n, r = dist.get_world_size(), dist.get_rank()

    def mine(rank: int, count: int) -> Any:
        if dtype == "bool":
            return torch.arange(count) % (rank + 2) == 0
        return tensor(rank, count, dtype)

    counts = [2 * q + 1 for q in range(n)]
    outs = [torch.empty_like(mine(q, c)) for q, c in enumerate(counts)]
    dist.all_gather(outs, mine(r, counts[r]))
    check(all(same(o, mine(q, c)) for q, (o, c) in enumerate(zip(outs, counts))), "odd sizes")
    rows = [torch.empty(q, 3, dtype=mine(0, 1).dtype) for q in range(n)]  # rank 0's empty
    work = dist.all_gather(rows, mine(r, 3 * r).reshape(r, 3), async_op=True)
    work.wait()
    check(all(same(o, mine(q, 3 * q).reshape(q, 3)) for q, o in enumerate(rows)),
          "rows, async, an empty tensor")
    if n == 1:
        return
    last = r == n - 1
    wrong = {"outputs all of the input's size": lambda: (
                 [torch.empty_like(mine(r, counts[r])) for _ in range(n)] if last else outs,
                 mine(r, counts[r])),
             "a rank's sizes swapped": lambda: (outs[::-1] if last else outs,
                                                mine(r, counts[r])),
             "another dtype": lambda: ([o.to(torch.float64) for o in outs] if last else outs,
                                       mine(r, counts[r]).to(torch.float64) if last
                                       else mine(r, counts[r]))}
    for what, make in wrong.items():
        outputs, sent = make()
        try:
            dist.all_gather(outputs, sent)
            problem = "no error"
        except RuntimeError as exc:
            problem = "" if isinstance(exc, mt.MismatchError) else f"{type(exc).__name__}: {exc}"
        check(not problem, f"{what}: {problem}")
    outs = [torch.empty_like(mine(q, c)) for q, c in enumerate(counts)]
    dist.all_gather(outs, mine(r, counts[r]))
    check(all(same(o, mine(q, c)) for q, (o, c) in enumerate(zip(outs, counts))), "after")


@pytest.mark.mpi(min_size=1)
def test_all_gather_coalesced_fills_one_list_per_rank() -> None:
    """``all_gather_coalesced(output_lists, inputs)``: ``output_lists[q][i]`` is rank
    ``q``'s ``inputs[i]`` (one list per rank, the transpose of ``all_gather``'s lists);
    as many inputs as ranks, of one shape, so a transposed result would fit too. A rank
    whose lists are not one per rank fails every rank."""
    n, r = dist.get_world_size(), dist.get_rank()

    def inputs(rank: int) -> list[Any]:
        return [tensor(rank * n + i, 3, "float32") for i in range(n)]

    outputs = [[torch.empty(3) for _ in range(n)] for _ in range(n)]
    dist.all_gather_coalesced(outputs, inputs(r))
    check(all(torch.equal(outputs[q][i], inputs(q)[i]) for q in range(n) for i in range(n)),
          "outputs[q][i] = rank q's input i")
    def pairs(rank: int) -> list[Any]:  # (torch wants one dtype for every input)
        return [torch.view_as_complex(tensor(rank, 2 * c, "float64").reshape(-1, 2, 2))
                for c in (2, 6)]

    mixed = pairs(r)
    outputs = [[torch.empty_like(t) for t in mixed] for _ in range(n)]
    dist.all_gather_coalesced(outputs, mixed, async_op=True).wait()
    want = [pairs(q) for q in range(n)]
    check(all(same(outputs[q][i], want[q][i]) for q in range(n) for i in range(2)),
          "two shapes, complex, async")
    if n == 1:
        return
    short = outputs[:-1] if r == n - 1 else outputs
    try:
        dist.all_gather_coalesced(short, mixed)
        problem = "no error"
    except (RuntimeError, ValueError) as exc:  # (the last rank's own ArgumentError)
        problem = "" if f"rank {n - 1}" in str(exc) else f"does not name it: {exc}"
    check(not problem, f"a rank with one list too few: {problem}")
    dist.all_gather_coalesced(outputs, mixed)
    check(all(same(outputs[q][i], want[q][i]) for q in range(n) for i in range(2)), "after")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["int64", "bfloat16", "float32", "bool"])
def test_reduce_scatter_of_tensors_of_different_sizes(dtype: str) -> None:
    """torch's ``reduce_scatter`` takes a list of inputs of different sizes (rank ``q``'s
    output sized as the ``q``-th); ranks that size them otherwise, or a rank whose
    output is of another size, fail every rank."""
    n, r = dist.get_world_size(), dist.get_rank()
    sizes = [q + 1 for q in range(n)] if n > 1 else [2, 3]  # (one rank: a list of one)
    sizes = sizes[:n]
    if len(set(sizes)) == 1:  # one rank: nothing uneven to scatter
        return

    def inputs(rank: int) -> list[Any]:
        if dtype == "bool":
            return [torch.arange(c) % (rank + q + 2) == 0 for q, c in enumerate(sizes)]
        return [tensor(rank + q, c, dtype) for q, c in enumerate(sizes)]

    mine = inputs(r)
    before = [t.clone() for t in mine]
    out = torch.empty_like(mine[r])
    dist.reduce_scatter(out, mine)
    if dtype == "bool":
        want = torch.zeros_like(out)
        for q in range(n):
            want |= inputs(q)[r]
    else:
        want = sum(inputs(q)[r] for q in range(n)).to(out.dtype)
    check(same(out, want), "uneven reduce_scatter")
    check(all(same(a, b) for a, b in zip(mine, before)), "inputs unchanged")
    last = r == n - 1
    wrong = {"a rank's sizes swapped": lambda: (torch.empty_like(mine[r]),
                                                mine[::-1] if last else mine),
             "a rank's output of another size": lambda: (
                 torch.empty(sizes[r] + 1, dtype=out.dtype) if last else torch.empty_like(out),
                 mine)}
    for what, make in wrong.items():
        output, sent = make()
        try:
            dist.reduce_scatter(output, sent)
            problem = "no error"
        except (RuntimeError, ValueError) as exc:  # (the last rank's own ArgumentError)
            problem = "" if last or f"rank {n - 1}" in str(exc) else f"does not name it: {exc}"
        check(not problem, f"{what}: {problem}")
    out = torch.empty_like(mine[r])
    dist.reduce_scatter(out, mine)
    check(same(out, want), "after")


@pytest.mark.mpi(min_size=2)
def test_a_root_without_a_tensor_per_rank_fails_every_rank() -> None:
    """gather's root with too few outputs, scatter's with too few inputs: every rank
    raises (the root names the count it needs), and the group goes on working."""
    n, r = dist.get_world_size(), dist.get_rank()
    root = n - 1
    calls = {"gather": lambda: dist.gather(torch.ones(2), [torch.ones(2)] * (n - 1)
                                           if r == root else None, dst=root),
             "scatter": lambda: dist.scatter(torch.ones(2), [torch.ones(2)] * (n - 1)
                                             if r == root else None, src=root)}
    for what, call in calls.items():
        try:
            call()
            problem = f"{what}: no error"
        except (RuntimeError, ValueError) as exc:
            problem = "" if r != root or f"a list of {n}" in str(exc) else \
                f"{what}: the root's error does not say what it needs: {exc}"
        check(not problem, problem)
    t = torch.ones(3)
    dist.all_reduce(t)
    check(torch.equal(t, torch.full((3,), float(n))), "usable after")


@pytest.mark.mpi(min_size=2)
def test_ranks_in_different_collectives_raise_on_every_rank() -> None:
    """gather on the last rank, all_to_all_single on the others: MPI's own collectives
    begin with a validated rendezvous named by the call, so every rank raises, naming
    both, instead of entering different MPI collectives; the group goes on working."""
    n, r = dist.get_world_size(), dist.get_rank()
    try:
        if r == n - 1:
            dist.gather(torch.ones(2), None, dst=0)
        else:
            dist.all_to_all_single(torch.zeros(n), torch.ones(n))
        problem = "no error"
    except RuntimeError as exc:
        text = str(exc)
        problem = "" if f"{n - 1} called gather" in text and "called all_to_all_single" \
            in text else f"does not name both calls: {text}"
    check(not problem, problem)
    t = torch.ones(3)
    dist.all_reduce(t)
    check(torch.equal(t, torch.full((3,), float(n))), "usable after")


def _gather_three(n: int) -> None:
    """Three ``all_gather_into_tensor`` coalesced: one call of three allgathers."""
    with dist._coalescing_manager():
        for _ in range(3):
            dist.all_gather_into_tensor(torch.zeros(2 * n), torch.ones(2))


OUT_OF_STEP = {
    # case: (the last rank's call, the others' call, words the error has on every rank)
    "all_gather": (lambda n: dist.all_gather_into_tensor(torch.zeros(4 * n), torch.ones(4)),
                   lambda n: dist.all_reduce(torch.ones(4)),
                   ["called allgather", "called allreduce"]),
    "sparse": (lambda n: dist.all_reduce(torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))),
               lambda n: dist.all_reduce(torch.ones(4)),
               ["called allgather int64", "called allreduce sum float32[4]"]),
    "coalesced": (lambda n: _gather_three(n), lambda n: dist.all_reduce(torch.ones(4)),
                  ["called allgather"]),
    "barrier": (lambda n: dist.barrier(), lambda n: dist.all_reduce(torch.ones(4)),
                ["called barrier", "called allreduce"]),
    "gather": (lambda n: dist.gather(torch.ones(2), None, dst=0),
               lambda n: dist.broadcast(torch.ones(4), src=0),
               ["called gather", "called broadcast root=0 float32[4]"]),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(OUT_OF_STEP))
def test_ranks_out_of_step_raise_at_once(case: str) -> None:
    """The last rank makes another collective than the others (one that submits more to
    the engine than theirs, one of MPI's own after a meeting point): every rank raises
    MismatchError naming both calls at once (the group's timeout, 120 s, is past the
    test's: waiting for each other fails it), and the group goes on working."""
    n, r = dist.get_world_size(), dist.get_rank()
    mine, theirs, words = OUT_OF_STEP[case]
    try:
        (mine if r == n - 1 else theirs)(n)
        problem = "no error"
    except mt.MismatchError as exc:
        problem = "" if all(w in str(exc) for w in words) and "call" in str(exc) \
            else f"does not name both calls: {exc}"
    check(not problem, problem)
    for _ in range(2):
        t = torch.ones(3)
        dist.all_reduce(t)
        check(torch.equal(t, torch.full((3,), float(n))), "usable after")
    dist.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ordered", [True, False])
def test_a_rank_that_skips_an_mpi_collective_is_a_stall(ordered: bool) -> None:
    """all_to_all on rank 0 alone: the rendezvous before MPI's own collective (on an
    ordered communicator, as the backend's groups are, the meeting point in the async
    engine's order, whose exchange waits for the other ranks' engines) is watched by
    the stall inspector, so rank 0 gets StallError naming the ranks that never came at
    the group's stall timeout (it used to wait in MPI forever)."""
    from mpi4py import MPI

    from mpitrain.torch.distributed import ProcessGroupMpitrain

    n = dist.get_world_size()
    comm = mt.Communicator(MPI.COMM_WORLD, settings=mt.Settings.from_environment(
        stall_timeout_s=1.5, stall_warning_s=0.5), ordered=ordered)
    if ordered:
        comm.engine()  # started on every rank: rank 0 then waits in its exchange
    pg = ProcessGroupMpitrain(comm, "skipped")
    problem = ""
    try:
        if comm.rank == 0:
            try:
                pg.alltoall([torch.zeros(1) for _ in range(n)], [torch.ones(1)] * n)
                problem = "no error"
            except mt.StallError as exc:
                missing = "rank 1 has" if n == 2 else \
                    f"ranks {', '.join(str(i) for i in range(1, n))} have"
                if f"{missing} not called it" not in str(exc):
                    problem = f"StallError does not name the missing ranks: {exc}"
                elif " timeout " not in str(exc):  # what torch's own tests look for
                    problem = f"StallError does not say it timed out: {exc}"
        MPI.COMM_WORLD.Barrier()  # the others wait outside mpitrain until rank 0 is done
    finally:
        comm.free()  # a stalled communicator frees only what it can
    check(not problem, problem)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_receive_that_no_rank_sends_is_a_stall() -> None:
    """recv from a rank that never sends, and from any rank when none sends: StallError
    at the group's stall timeout naming the receive (it used to wait in MPI forever)."""
    from mpi4py import MPI

    from mpitrain.torch.distributed import ProcessGroupMpitrain

    comm = mt.Communicator(MPI.COMM_WORLD, settings=mt.Settings.from_environment(
        stall_timeout_s=1.0, stall_warning_s=0.5))
    problems = []
    try:
        for what, receive in (
                ("recv from rank 1 (tag 7)", lambda pg: pg.recv([torch.empty(3)], 1, 7).wait()),
                ("recv from any rank (tag 8)", lambda pg: pg.recv_anysource([torch.empty(3)], 8))):
            pg = ProcessGroupMpitrain(comm, "unsent")  # (a stall leaves its messages unusable)
            if comm.rank == 0:
                try:
                    receive(pg)
                    problems.append(f"{what}: no error")
                except mt.StallError as exc:
                    if what not in str(exc):
                        problems.append(f"StallError does not name the {what}: {exc}")
    finally:
        comm.free()
    check(not problems, "; ".join(problems))


# -- training -----------------------------------------------------------------------------
BATCH, STEPS = 4, 3


def make_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()


def batch(step: int, rows: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randn(rows, 3, generator=g, dtype=torch.float64))


def loss(model: Any, x: Any, y: Any) -> Any:
    return ((model(x) - y) ** 2).mean()


def one_process(steps: int, passes: int = 1) -> list[Any]:
    """SGD on every rank's data at once (the mean of the ranks' mean losses)."""
    n = dist.get_world_size()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, BATCH * n * passes)
        loss(model, x, y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def train_on_my_rows(forward: Any, model: Any) -> None:
    """STEPS of SGD on ``model``'s parameters, ``forward`` (the model, or a wrapper of
    it) given this rank's rows of each step's batch."""
    n, r = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, BATCH * n)
        loss(forward, x[r::n], y[r::n]).backward()
        opt.step()


def close(got: Any, want: list[Any], tol: float) -> bool:
    err = max(float((g.detach() - w).abs().max()) for g, w in zip(got, want))
    return err <= tol


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60, method="thread")  # a deadlock blocks in C++, where no signal lands
@pytest.mark.parametrize("hook, passes", [("none", 1), ("fp16", 1), ("powersgd", 1),
                                          ("none", 2)])
def test_ddp_equals_one_process(hook: str, passes: int) -> None:
    """DDP (with DDP's fp16 compression hook; with PowerSGD, whose callbacks wait for
    collectives of their own; with no_sync accumulation over two passes) against SGD
    on the whole batch in one process. PowerSGD of rank 8 is exact on these weights
    (at most 8 x 6); it compresses from the third step on."""
    n, r = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    register_ddp_hook(ddp, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, BATCH * n * passes)
        chunks = [(x[i::n * passes], y[i::n * passes])  # my rows of each pass
                  for i in range(r, n * passes, n)]
        for i, (xs, ys) in enumerate(chunks):
            if i < len(chunks) - 1:
                with ddp.no_sync():
                    (loss(ddp, xs, ys) / passes).backward()
            else:
                (loss(ddp, xs, ys) / passes).backward()
        opt.step()
    tol = {"none": 1e-12, "powersgd": 1e-9}.get(hook, 5e-3)
    check(close(list(model.parameters()), one_process(STEPS, passes), tol),
          f"DDP hook={hook} passes={passes}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.host_only("torch.compile of CPU modules")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_ddp_and_functional_collectives(backend: str) -> None:
    """``torch.compile`` of a DDP model, and of a function with functional collectives:
    torch calls the backend's methods from C++ inside the compiled region, and they must
    run as they are, not be traced (TorchDynamo refused the group's attributes)."""
    import torch.distributed._functional_collectives as fc

    torch._dynamo.reset()
    n, r = dist.get_world_size(), dist.get_rank()
    model = make_model()
    compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(model), backend=backend)
    train_on_my_rows(compiled, model)
    trained = close(list(model.parameters()), one_process(STEPS), 1e-12)

    @torch.compile(backend=backend)
    def collectives(t: Any) -> tuple[Any, Any]:
        total = fc.all_reduce(t * 2, "sum", dist.group.WORLD)
        return total + 1, fc.all_gather_single(t, 0, dist.group.WORLD)

    total, gathered = collectives(torch.full((3,), float(r)))
    want = torch.arange(n, dtype=torch.float32).repeat_interleave(3)
    check(trained and torch.equal(total, torch.full((3,), 2.0 * sum(range(n)) + 1))
          and torch.equal(gathered, want),
          f"compiled DDP equals one process: {trained}; all_reduce {total}; all_gather "
          f"{gathered}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.host_only("the training benchmark's DDP on CPU tensors")
def test_the_training_benchmarks_fp16_hook_runs_over_the_group_it_is_given() -> None:
    """``python -m benchmarks train --fp16`` gives DDP ``fp16_compress_hook``: its
    allreduces must go over the group the DDP is given (the benchmark's mpitrain group
    beside gloo's default one), not over the default group, which a hook without state
    uses."""
    from benchmarks import train

    given = dist.new_group(backend="mpitrain")
    opts = train.parse_args(["--fp16", "--small", "--impl", "ddp-mpitrain"], quiet=True)
    trainer = train.ddp_trainer(train.build_model("mlp", small=True), opts, given)
    engines = {name: g.comm.engine()  # the group is the backend's ProcessGroup itself
               for name, g in (("given", given), ("default", dist.group.WORLD))}
    before = {name: e.snapshot().operations for name, e in engines.items()}
    for step in range(2):
        trainer.step(*train.make_batch("mlp", True, 4, 1, dist.get_rank(), step))
    ran = {name: e.snapshot().operations - before[name] for name, e in engines.items()}
    check(ran["given"] > 0 and ran["default"] == 0,
          f"the hook's allreduces ran on these groups' engines: {ran}")
    dist.destroy_process_group(given)


@pytest.mark.mpi(min_size=2)
def test_ddp_join_with_uneven_inputs() -> None:
    """Rank r trains STEPS + r steps under DDP.join(): in each step the ranks that have
    joined contribute zeros, and the sum is divided by the whole world size (DDP's
    divide_by_initial_world_size): a one-process reference of exactly that."""
    n, r = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(STEPS + r):
            opt.zero_grad()
            x, y = batch(step, BATCH * n)
            loss(ddp, x[r::n], y[r::n]).backward()
            opt.step()
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS + n - 1):
        ref_opt.zero_grad()
        x, y = batch(step, BATCH * n)
        active = [q for q in range(n) if step < STEPS + q]
        (sum(loss(ref, x[q::n], y[q::n]) for q in active) / n).backward()
        ref_opt.step()
    check(close(list(model.parameters()), [p.detach() for p in ref.parameters()], 1e-12),
          "DDP.join with uneven inputs")


@pytest.mark.mpi(min_size=1)
def test_fsdp2_equals_one_process() -> None:
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    train_on_my_rows(model, model)
    full = [p.full_tensor() for p in model.parameters()]
    check(close(full, one_process(STEPS), 1e-12), "FSDP2")


def tensor_parallel_model(width: int) -> Any:
    """Two linear layers with ``width`` hidden units, float64, the same on every rank."""
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 3)).double()


@pytest.mark.mpi(min_size=1)
def test_tensor_parallelism_and_dtensor_redistribution() -> None:
    """Tensor parallelism over a 1-D DeviceMesh of the group (the first layer split by
    columns, the second by rows: DTensor's functional collectives, all_reduce in the
    forward pass and all_gather, reduce_scatter behind the gradients) gives the output
    and the gradients of the unsplit model; a DTensor sharded by rows and by columns
    gathers back to the whole tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    ref, split = tensor_parallel_model(4 * n), tensor_parallel_model(4 * n)
    parallelize_module(split, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x, y = batch(0, 5)
    loss(ref, x, y).backward()
    out = split(x)
    loss(split, x, y).backward()
    grads = [p.grad.full_tensor() for p in split.parameters()]
    whole = torch.arange(12.0 * n, dtype=torch.float64).reshape(2 * n, 6)
    rows = distribute_tensor(whole, mesh, [Shard(0)])
    columns = rows.redistribute(mesh, [Shard(1)]) if 6 % n == 0 else rows
    check(close([out], [ref(x).detach()], 1e-12) and
          close(grads, [p.grad for p in ref.parameters()], 1e-12) and
          torch.equal(rows.to_local(), whole[2 * dist.get_rank():2 * dist.get_rank() + 2]) and
          torch.equal(columns.redistribute(mesh, [Replicate()]).to_local(), whole),
          "tensor parallelism equals the unsplit model; DTensor redistributions")


@pytest.mark.mpi(min_size=4)
@pytest.mark.power_of_two  # (4 ranks run every case of it: 3 and 5 would skip it)
def test_fsdp2_with_tensor_parallelism_on_a_2d_mesh() -> None:
    """FSDP2 across the rows of a 2 x n/2 DeviceMesh, tensor parallelism along them
    (its subgroups made by DeviceMesh over the backend): STEPS of SGD equal one process
    on both data-parallel ranks' data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    if n % 2:
        pytest.skip("a 2 x n/2 mesh needs an even rank count")
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    ref, model = tensor_parallel_model(2 * n), tensor_parallel_model(2 * n)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = mesh["dp"].get_local_rank()
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = batch(step, 2 * BATCH)
        loss(model, x[mine::2], y[mine::2]).backward()
        ((loss(ref, x[0::2], y[0::2]) + loss(ref, x[1::2], y[1::2])) / 2).backward()
        opt.step()
        ref_opt.step()
    full = [p.full_tensor() for p in model.parameters()]
    check(close(full, [p.detach() for p in ref.parameters()], 1e-12),
          "FSDP2 x tensor parallelism on a 2-D mesh")


@pytest.mark.mpi(min_size=1)
def test_state_dict_from_rank0_and_async_checkpoint() -> None:
    """FSDP2's way of loading: rank 0's full state dict broadcast into the shards
    (``broadcast_from_rank0``); then ``torch.distributed.checkpoint.async_save`` and a
    load into another sharded model. torch asks the group which devices it serves
    (``_device_types``) on both paths, and they failed while it said none."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    def sharded(seed: int) -> Any:
        model = make_model(seed)
        for module in (model[0], model[2], model):
            fully_shard(module)
        return model

    def full(model: Any) -> dict[str, Any]:
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    source = make_model(7).state_dict()
    loaded = sharded(1)
    set_model_state_dict(loaded, {k: v.clone() for k, v in source.items()}
                         if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True,
                                                  broadcast_from_rank0=True))
    broadcast = all(torch.equal(v, source[k]) for k, v in full(loaded).items())
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    try:
        dcp.async_save({"model": loaded.state_dict()}, checkpoint_id=where[0]).result()
        restored = sharded(2)
        state = {"model": restored.state_dict()}
        dcp.load(state, checkpoint_id=where[0])
        restored.load_state_dict(state["model"])
        round_trip = all(torch.equal(v, source[k]) for k, v in full(restored).items())
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where[0])
    check(broadcast and round_trip,
          f"broadcast from rank 0 equal: {broadcast}; async checkpoint round trip equal: "
          f"{round_trip}")


@pytest.mark.mpi(min_size=2)
def test_gpipe_over_two_ranks_equals_the_whole_model() -> None:
    """A two-stage GPipe schedule (torch.distributed.pipelining) over the backend's
    point-to-point messages, on ranks 0 and 1: the output and the gradients of the
    unsplit model."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    r = dist.get_rank()
    pair = dist.new_group([0, 1])
    full = make_model()
    x, y = batch(0, 8)
    reference_model = copy.deepcopy(full)
    want = reference_model(x)
    loss(reference_model, x, y).backward()
    if r > 1:
        check(True, "not in the pipeline")
        return
    stage_module = full[:2] if r == 0 else full[2:]
    stage = PipelineStage(stage_module, r, 2, torch.device("cpu"), group=pair)
    schedule = ScheduleGPipe(stage, n_microbatches=4,
                             loss_fn=lambda out, target: ((out - target) ** 2).mean())
    if r == 0:
        schedule.step(x)
        grads = [p.grad for p in full[:2].parameters()]
        wants = [p.grad for p in reference_model[:2].parameters()]
        ok = all(torch.allclose(g, w, atol=1e-12) for g, w in zip(grads, wants))
    else:
        out = schedule.step(target=y)
        grads = [p.grad for p in full[2:].parameters()]
        wants = [p.grad for p in reference_model[2:].parameters()]
        ok = torch.allclose(out, want, atol=1e-12) and all(
            torch.allclose(g, w, atol=1e-12) for g, w in zip(grads, wants))
    check(ok, "GPipe output and gradients")
