"""``mpitrain.torch`` under ``torch.compile``: the Horovod API's collectives, a compiled
``DistributedOptimizer.step`` and ``SyncBatchNorm`` in a compiled model give the eager
results, and TorchDynamo compiles none of mpitrain's own code (it breaks its graph at
each call into mpitrain, as at a collective written in C++)."""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
from helpers import assert_all_ranks

torch = pytest.importorskip("torch")
import mpitrain as mt  # noqa: E402
import mpitrain.torch as hvd  # noqa: E402

PACKAGE = os.path.dirname(mt.__file__) + os.sep


class Recorder:
    """A torch.compile backend that runs each graph as it is and keeps the source lines
    its nodes were traced from."""

    def __init__(self) -> None:
        self.graphs = 0
        self.traced: list[str] = []

    def __call__(self, gm: Any, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        self.traced += [str(node.meta.get("stack_trace") or "") for node in gm.graph.nodes]
        return gm.forward

    def inside_mpitrain(self) -> list[str]:
        """The traced lines that are mpitrain's code (should be none)."""
        return [t for t in self.traced if PACKAGE in t]


def check(ok: bool, what: str) -> None:
    assert_all_ranks(mt.default_communicator(), bool(ok), what)


@pytest.fixture(autouse=True)
def _fresh(comm: Any) -> None:
    hvd.init()
    torch._dynamo.reset()


@pytest.mark.mpi(min_size=1)
def test_collectives_in_a_compiled_function() -> None:
    n, r = hvd.size(), hvd.rank()
    recorder = Recorder()

    @torch.compile(backend=recorder)
    def step(x: Any) -> tuple[Any, Any]:
        total = hvd.allreduce(x * 2, op=hvd.Sum, name="compiled.sum")
        return total + 1, hvd.allgather(x.unsqueeze(0)) * 3

    for _ in range(2):  # the second call runs the compiled graphs
        total, gathered = step(torch.full((4,), float(r)))
    want = torch.arange(n, dtype=torch.float32).unsqueeze(1).expand(n, 4) * 3
    check(torch.equal(total, torch.full((4,), 2.0 * sum(range(n)) + 1))
          and torch.equal(gathered, want) and not recorder.inside_mpitrain(),
          f"allreduce {total}, allgather {gathered}; traced inside mpitrain: "
          f"{recorder.inside_mpitrain()}")


@pytest.mark.mpi(min_size=1)
def test_compiled_optimizer_step_and_sync_batch_norm() -> None:
    """A model with SyncBatchNorm compiled, and the DistributedOptimizer's step compiled
    (the wrapped SGD's step is compiled, the gradient averaging runs eagerly), against
    the same training in eager mode. (SGD: torch's compiled Adam rounds differently
    from its eager Adam, by 5e-7 here, with or without mpitrain.)"""
    n, r = hvd.size(), hvd.rank()

    def build() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), hvd.SyncBatchNorm(4),
                                   torch.nn.ReLU(), torch.nn.Flatten(),
                                   torch.nn.Linear(4 * 6 * 6, 2)).double()

    def train(compiled: bool, recorder: Recorder | None = None) -> list[Any]:
        model = build()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        forward, step = model, opt.step
        if compiled:
            forward = torch.compile(model, backend=recorder)
            step = torch.compile(opt.step, backend=recorder)
        for i in range(3):
            g = torch.Generator().manual_seed(100 + i)
            x = torch.randn(n, 2, 3, 8, 8, generator=g, dtype=torch.float64)[r]
            opt.zero_grad()
            forward(x).square().mean().backward()
            step()
        return [p.detach().clone() for p in model.parameters()]

    eager = train(False)
    recorder = Recorder()
    compiled = train(True, recorder)
    err = max(float((a - b).abs().max()) for a, b in zip(compiled, eager))
    check(err <= 1e-12 and recorder.graphs > 0 and not recorder.inside_mpitrain(),
          f"compiled training differs from eager by {err}; {recorder.graphs} graphs; "
          f"traced inside mpitrain: {recorder.inside_mpitrain()[:3]}")
