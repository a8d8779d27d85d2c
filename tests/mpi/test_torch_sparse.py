"""Sparse allreduce (hvd.sparse_allreduce_async) against the dense allreduce of the same
tensors, sparse gradients through DistributedOptimizer (SparseAdam, sparse_as_dense)
against one process over every rank's batch, and the inputs every rank refuses."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from helpers import assert_all_ranks

torch = pytest.importorskip("torch")
import mpitrain as mt  # noqa: E402
import mpitrain.torch as hvd  # noqa: E402


@pytest.fixture(autouse=True)
def _init(comm: Any, torch_device: str) -> None:
    hvd.init()


def check(ok: bool, what: str) -> None:
    assert_all_ranks(mt.default_communicator(), bool(ok), what)


def rank_sparse(r: int, dense_dims: tuple[int, ...], dtype: Any) -> Any:
    """Rank ``r``'s sparse (10, *dense_dims) tensor: rows that overlap other ranks',
    a duplicate index (uncoalesced), and no entries at all on rank 1."""
    rows = [] if r == 1 else [r % 10, (3 * r + 1) % 10, 7, 7]
    g = torch.Generator().manual_seed(r)
    values = torch.randint(-9, 10, (len(rows), *dense_dims), generator=g).to(dtype)
    indices = torch.tensor([rows], dtype=torch.int64).reshape(1, len(rows))
    return torch.sparse_coo_tensor(indices, values, (10, *dense_dims), check_invariants=True)


def test_sparse_handles_are_callable_as_in_horovod() -> None:
    """Horovod's sparse handle is a function: ``handle()`` waits and returns the result."""
    handles = [hvd.sparse_allreduce_async(rank_sparse(hvd.rank(), (3,), torch.float64) * (i + 1),
                                          name=f"callable.{i}", op=hvd.Sum) for i in range(3)]
    dense = sum(rank_sparse(r, (3,), torch.float64).to_dense() for r in range(hvd.size()))
    for i, handle in reversed(list(enumerate(handles))):
        assert torch.allclose(handle().to_dense(), dense * (i + 1))


@pytest.mark.parametrize("dense_dims", [(), (3,), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64])
@pytest.mark.parametrize("op", ["Sum", "Average"])
@pytest.mark.parametrize("named", [True, False])
def test_sparse_allreduce_equals_the_dense_allreduce(dense_dims: tuple[int, ...], dtype: Any,
                                                    op: str, named: bool) -> None:
    mine = rank_sparse(hvd.rank(), dense_dims, dtype)
    name = f"sparse.{dense_dims}.{dtype}.{op}" if named else None
    handle = hvd.sparse_allreduce_async(mine, name=name, op=getattr(hvd, op))
    result = hvd.synchronize(handle)
    assert hvd.poll(handle) and hvd.synchronize(handle) is result and handle() is result
    dense = sum(rank_sparse(r, dense_dims, torch.float64).to_dense()
                for r in range(hvd.size()))
    if op == "Average":
        dense = dense / hvd.size()
        if not dtype.is_floating_point:  # per-entry values truncated, as Horovod scales
            dense = sum(torch.trunc(rank_sparse(r, dense_dims, torch.float64).coalesce()
                                    .to_dense() / hvd.size()) for r in range(hvd.size()))
    check(result.is_sparse and result.is_coalesced() and result.dtype == dtype,
          f"result layout {result.layout} dtype {result.dtype}")
    check(torch.allclose(result.to_dense().double(), dense, rtol=1e-6, atol=1e-6),
          f"{op} {dtype} {dense_dims}: {result.to_dense()} != {dense}")


def test_integer_average_truncates_each_gathered_entry() -> None:
    """Average divides every gathered value (before duplicates add up): a rank's
    -5 over 2 ranks is -2, as Horovod's sparse average."""
    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([-5]), (2,),
                                check_invariants=True)
    out = hvd.synchronize(hvd.sparse_allreduce_async(t, "int.average", hvd.Average))
    expected = int(-5 / hvd.size()) * hvd.size()  # int() truncates toward zero
    check(out.to_dense().tolist() == [expected, 0], f"{out.to_dense().tolist()}")


def test_bad_input_is_refused_on_every_rank() -> None:
    with pytest.raises(ValueError, match="needs a sparse COO tensor"):
        hvd.sparse_allreduce_async(torch.ones(3), "dense", hvd.Sum)
    with pytest.raises(ValueError, match="supports op=Sum and op=Average"):
        hvd.sparse_allreduce_async(rank_sparse(0, (), torch.float64), "max", hvd.Max)
    rows = 10 + (hvd.rank() == hvd.size() - 1)
    wrong = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([1.0]), (rows,),
                                    check_invariants=True)
    handle = hvd.sparse_allreduce_async(wrong, "shapes", hvd.Sum)
    if hvd.size() == 1:
        assert hvd.synchronize(handle).to_dense()[1] == 1.0
        return
    with pytest.raises(ValueError, match="needs the same shape on every rank"):
        hvd.synchronize(handle)


def embedding_batches(step: int) -> list[Any]:
    """Every rank's rows for ``step`` (rank r's batch is entry r)."""
    return [torch.tensor([(r + step) % 12, (5 * r + 2 * step + 1) % 12, 11])
            for r in range(hvd.size())]


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_embedding_trains_as_one_process_over_all_batches(sparse_as_dense: bool) -> None:
    """SparseAdam on sparse gradients (or Adam on densified ones) after the averaging
    steps as one process does on the mean of every rank's loss."""
    torch.manual_seed(5)
    emb = torch.nn.Embedding(12, 3, sparse=True).double()
    ref = copy.deepcopy(emb)
    make = (lambda ps: torch.optim.Adam(ps, lr=0.1)) if sparse_as_dense else \
        (lambda ps: torch.optim.SparseAdam(ps, lr=0.1))
    opt = hvd.DistributedOptimizer(make(list(emb.parameters())),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    ref_opt = make(list(ref.parameters()))
    for step in range(3):
        batches = embedding_batches(step)
        opt.zero_grad()
        emb(batches[hvd.rank()]).pow(2).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        for rows in batches:
            (ref(rows).pow(2).sum() / hvd.size()).backward()
        if sparse_as_dense:
            ref.weight.grad = ref.weight.grad.to_dense()
        ref_opt.step()
        check(emb.weight.grad.is_sparse != sparse_as_dense, "gradient layout")
    check(torch.allclose(emb.weight, ref.weight, rtol=1e-12, atol=1e-12),
          f"sparse_as_dense={sparse_as_dense}: weights differ by "
          f"{(emb.weight - ref.weight).abs().max().item()}")
