"""hvd.SyncBatchNorm against torch's BatchNorm over the concatenated batch: outputs,
input and parameter gradients, running statistics, uneven and empty batches, 1d/2d/3d
inputs, eval mode and inputs that every rank refuses."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import assert_all_ranks

torch = pytest.importorskip("torch")
import mpitrain as mt  # noqa: E402
import mpitrain.torch as hvd  # noqa: E402

CHANNELS = 3


@pytest.fixture(autouse=True)
def _init(comm: Any, torch_device: str) -> None:
    hvd.init()


def check(ok: bool, what: str) -> None:
    assert_all_ranks(mt.default_communicator(), bool(ok), what)


def batch_sizes(uneven: bool) -> list[int]:
    """Rows per rank: equal, or 2 + rank with rank 1 empty (when there is a rank 1)."""
    if not uneven:
        return [4] * hvd.size()
    return [0 if r == 1 else 2 + r for r in range(hvd.size())]


def whole_batch(step: int, rows: int, trailing: tuple[int, ...], dtype: Any) -> Any:
    """The same inputs and output weights on every rank; channels with different means."""
    g = torch.Generator().manual_seed(1000 * step + rows)
    x = torch.randn(rows, CHANNELS, *trailing, generator=g, dtype=torch.float64)
    x = x * 3 + torch.arange(CHANNELS, dtype=torch.float64).view(1, -1, *[1] * len(trailing)) * 5
    coeff = torch.randn(rows, CHANNELS, *trailing, generator=g, dtype=torch.float64)
    return x.to(dtype), coeff.to(dtype)


def close(a: Any, b: Any, dtype: Any) -> bool:
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol)


def reference_module(kind: Any, dtype: Any, momentum: float | None) -> Any:
    ref = kind(CHANNELS, momentum=momentum).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([0.5, -1.5, 2.0], dtype=dtype))
        ref.bias.copy_(torch.tensor([0.1, 0.2, -0.3], dtype=dtype))
    return ref


@pytest.mark.parametrize("kind, trailing", [(torch.nn.BatchNorm1d, ()),
                                            (torch.nn.BatchNorm1d, (5,)),
                                            (torch.nn.BatchNorm2d, (3, 2)),
                                            (torch.nn.BatchNorm3d, (2, 2, 1))])
@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_matches_batch_norm_over_the_whole_batch(kind: Any, trailing: tuple[int, ...],
                                                 uneven: bool, dtype: Any,
                                                 momentum: float | None) -> None:
    sizes = batch_sizes(uneven)
    if sum(sizes) * max(1, int(torch.tensor(trailing).prod())) < 2:
        pytest.skip("one value per channel")
    start = sum(sizes[:hvd.rank()])
    mine = slice(start, start + sizes[hvd.rank()])
    ref = reference_module(kind, dtype, momentum)
    sync = hvd.SyncBatchNorm(CHANNELS, momentum=momentum).to(dtype)
    sync.load_state_dict(ref.state_dict())
    for step in range(3):
        x, coeff = whole_batch(step, sum(sizes), trailing, dtype)
        x_ref = x.clone().requires_grad_()
        out_ref = ref(x_ref)
        (out_ref * coeff).sum().backward()
        x_mine = x[mine].clone().requires_grad_()
        out = sync(x_mine)
        (out * coeff[mine]).sum().backward()
        check(close(out, out_ref[mine].detach(), dtype), f"output at step {step}")
        check(close(x_mine.grad, x_ref.grad[mine], dtype), f"input gradient at step {step}")
        for name in ("weight", "bias"):
            summed = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum)
            check(close(summed, getattr(ref, name).grad, dtype),
                  f"{name} gradient summed over ranks at step {step}")
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            check(close(getattr(sync, name).to(dtype), getattr(ref, name).to(dtype), dtype),
                  f"{name} at step {step}: {getattr(sync, name)} != {getattr(ref, name)}")
        ref.zero_grad()
        sync.zero_grad()
    sync.eval()
    ref.eval()
    x, _ = whole_batch(9, sum(sizes), trailing, dtype)
    check(close(sync(x[mine]), ref(x)[mine], dtype), "eval output")


def test_without_affine_or_running_stats() -> None:
    sizes = batch_sizes(uneven=True)
    if sum(sizes) < 2:
        pytest.skip("one value per channel")
    start = sum(sizes[:hvd.rank()])
    mine = slice(start, start + sizes[hvd.rank()])
    ref = torch.nn.BatchNorm1d(CHANNELS, affine=False, track_running_stats=False).double()
    sync = hvd.SyncBatchNorm(CHANNELS, affine=False, track_running_stats=False).double()
    x, coeff = whole_batch(0, sum(sizes), (4,), torch.float64)
    x_ref, x_mine = x.clone().requires_grad_(), x[mine].clone().requires_grad_()
    (ref(x_ref) * coeff).sum().backward()
    out = sync(x_mine)
    (out * coeff[mine]).sum().backward()
    check(close(out, ref(x)[mine], torch.float64), "output")
    check(close(x_mine.grad, x_ref.grad[mine], torch.float64), "input gradient")
    assert sync.weight is None and sync.running_mean is None


def test_trains_with_the_distributed_optimizer() -> None:
    """A model with SyncBatchNorm under DistributedOptimizer(op=Sum) steps as one process
    over the whole batch does."""
    sizes = [3 + r for r in range(hvd.size())]
    start = sum(sizes[:hvd.rank()])
    mine = slice(start, start + sizes[hvd.rank()])
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, CHANNELS), torch.nn.BatchNorm1d(CHANNELS)).double()
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(4, CHANNELS), torch.nn.BatchNorm1d(CHANNELS)).double())
    assert isinstance(model[1], hvd.SyncBatchNorm)
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
        ref_opt.zero_grad()
        ref(x).pow(2).sum().backward()
        ref_opt.step()
        opt.zero_grad()
        model(x[mine]).pow(2).sum().backward()
        opt.step()
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        check(close(p.double(), q.double(), torch.float64), f"{name} after 3 steps")


def test_wrong_channels_on_one_rank_raise_on_every_rank() -> None:
    sync = hvd.SyncBatchNorm(CHANNELS).double()
    channels = CHANNELS + 1 if hvd.rank() == hvd.size() - 1 else CHANNELS
    with pytest.raises(ValueError, match=rf"SyncBatchNorm expects input \(N, {CHANNELS}"):
        sync(torch.randn(4, channels, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"SyncBatchNorm expects input \(N, {CHANNELS}"):
        sync(torch.randn(4, dtype=torch.float64) if hvd.rank() == 0
             else torch.randn(4, CHANNELS, dtype=torch.float64))


def test_every_rank_with_the_wrong_channels_is_refused_naming_a_rank() -> None:
    sync = hvd.SyncBatchNorm(CHANNELS).double()
    with pytest.raises(ValueError, match=f"rank 0's input has {CHANNELS + 1} channels"):
        sync(torch.randn(4, CHANNELS + 1, dtype=torch.float64))
    sync.eval()
    with pytest.raises(ValueError, match="2 or more dimensions"):
        sync(torch.randn(4, dtype=torch.float64))


def test_one_value_per_channel_in_all_is_refused_everywhere() -> None:
    sync = hvd.SyncBatchNorm(CHANNELS).double()
    rows = 1 if hvd.rank() == 0 else 0
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(torch.randn(rows, CHANNELS, dtype=torch.float64))
