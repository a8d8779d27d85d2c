"""op=hvd.Adasum in mpitrain.torch: allreduce (blocking, async, grouped) against the
numpy reference, and DistributedOptimizer's Adasum of the ranks' local steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import adasum_reference, assert_all_ranks

torch = pytest.importorskip("torch")
import mpitrain as mt  # noqa: E402
import mpitrain.torch as hvd  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
TOLERANCE = {"float64": 1e-12, "float32": 4e-6, "float16": 8e-3, "bfloat16": 6e-2}

pytestmark = pytest.mark.power_of_two


@pytest.fixture(autouse=True)
def _init(comm: Any, torch_device: str) -> None:
    hvd.init()
    if hvd.size() & (hvd.size() - 1):
        pytest.skip("Adasum runs on power-of-two rank counts")


def check(ok: bool, what: str) -> None:
    assert_all_ranks(mt.default_communicator(), bool(ok), what)


def rank_vector(r: int, count: int, dtype: str) -> torch.Tensor:
    """Random, different per rank and count, scaled by ``r + 1``."""
    g = torch.Generator().manual_seed(1000 * r + count)
    return (torch.randn(count, generator=g, dtype=torch.float64) * (r + 1)).to(DTYPES[dtype])


def want(count: int, dtype: str) -> np.ndarray[Any, Any]:
    """The numpy reference, on the same (rounded) inputs, in float64."""
    xs = [rank_vector(r, count, dtype).double().numpy() for r in range(hvd.size())]
    np_dtype = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    if dtype == "bfloat16":  # numpy has no bfloat16: check in float64 with its tolerance
        return adasum_reference(xs)
    return adasum_reference([x.astype(np_dtype) for x in xs]).astype(np.float64)


def close(got: torch.Tensor, expected: np.ndarray[Any, Any], dtype: str) -> bool:
    g = got.double().numpy()
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    return g.shape == expected.shape and got.dtype == DTYPES[dtype] and \
        float(np.max(np.abs(g - expected), initial=0.0)) <= TOLERANCE[dtype] * scale


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_allreduce_matches_reference(dtype: str) -> None:
    r = hvd.rank()
    for count in (0, 1, 1001):
        x = rank_vector(r, count, dtype)
        expected = want(count, dtype)
        check(close(hvd.allreduce(x, op=hvd.Adasum), expected, dtype), f"allreduce n={count}")
        check(torch.equal(x, rank_vector(r, count, dtype)), "input unchanged")
        y = x.clone()
        check(close(hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Adasum)), expected, dtype)
              and close(y, expected, dtype), f"allreduce_async_ n={count}")
        check(close(hvd.allreduce_(x.clone(), op="adasum"), expected, dtype),
              f"allreduce_ n={count}")


@pytest.mark.mpi(min_size=1)
def test_grouped_allreduce_weighs_each_tensor_alone() -> None:
    r, counts = hvd.rank(), (3, 40, 9)
    got = hvd.grouped_allreduce([rank_vector(r, c, "float32") for c in counts], op=hvd.Adasum)
    for c, g in zip(counts, got):
        check(close(g, want(c, "float32"), "float32"), f"grouped entry of {c}")


def make_model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 2)).double()


def batch(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + r)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randn(8, 2, generator=g, dtype=torch.float64))


def local_delta(r: int, kind: str) -> list[np.ndarray[Any, Any]]:
    """What one step of rank ``r`` alone changes in each parameter."""
    model = make_model()
    opt = optimizer(kind, model)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(r)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    return [(p.detach() - b).reshape(-1).numpy() for p, b in zip(model.parameters(), before)]


def optimizer(kind: str, model: Any) -> Any:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.05)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_distributed_optimizer_combines_local_steps(kind: str) -> None:
    """Each parameter ends at its start plus the Adasum of the ranks' local deltas."""
    model = make_model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(optimizer(kind, model),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x, y = batch(hvd.rank())
    ((model(x) - y) ** 2).mean().backward()
    opt.synchronize()  # as in Horovod: nothing to do before step() with Adasum
    opt.step()
    deltas = [local_delta(r, kind) for r in range(hvd.size())]
    for i, (p, s) in enumerate(zip(model.parameters(), start)):
        expected = s.reshape(-1).numpy() + adasum_reference([d[i] for d in deltas])
        err = float(np.max(np.abs(p.detach().reshape(-1).numpy() - expected)))
        check(err < 1e-12, f"{kind} parameter {i} off by {err}")
    opt.zero_grad()
    if hvd.size() > 1:
        with pytest.raises(mt.UnsupportedError, match="skip_synchronize"):
            opt.skip_synchronize()
