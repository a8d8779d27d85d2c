"""The ``train`` case: whole training steps with mpitrain against torch DDP and FSDP.

``python -m benchmarks train [--model mlp,convnet] [--impl mpitrain,ddp,ddp-mpitrain]
[--batch 32] [--steps 10] [--rounds 3] [--device cpu|cuda]``

One job trains the same torch model several ways, from the same initial parameters
(seeded, then broadcast from rank 0) and on the same synthetic batches (a different
batch per rank and step, generated outside the timed region). ``--impl`` picks them:

* ``mpitrain``: ``hvd.DistributedOptimizer`` around SGD with momentum
  (``import mpitrain.torch as hvd``), ``hvd.broadcast_parameters`` first;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over torch.distributed's
  gloo backend, started inside the same MPI job (rank 0 picks the TCP port and
  broadcasts it with mpi4py, :mod:`.gloo`);
* ``ddp-mpitrain``: the same DDP over a process group of mpitrain's torch.distributed
  backend (``dist.new_group(backend="mpitrain")``);
* ``fsdp`` and ``fsdp-mpitrain``: FSDP2 (``fully_shard`` of every layer with
  parameters, then of the model) over a ``DeviceMesh`` of the gloo group or of the
  mpitrain group, SGD on the sharded parameters;
* ``1 rank``: plain SGD on rank 0 alone, the baseline of the scaling efficiency; the
  other ranks wait in an ``Ibarrier`` that they poll with 1 ms sleeps, so they leave
  the cores to rank 0;
* ``no comm``: plain SGD on every rank at once, each on its own copy of the model and
  its own batches, with no communication at all: the step of a data-parallel
  implementation whose communication cost nothing. It is longer than the ``1 rank``
  step wherever ranks that compute at once share cores, memory bandwidth or caches, so
  DDP's step over it is the highest ``gloo/impl`` any implementation can reach
  (the line under each table of the report).

The default is ``mpitrain,ddp,ddp-mpitrain``; ``1 rank`` and ``no comm`` always run.
With ``--fp16`` gradients travel as float16: ``hvd.Compression.fp16``, DDP's
``fp16_compress_hook``, FSDP's ``MixedPrecisionPolicy(reduce_dtype=torch.float16)``.

With ``--device cuda`` every rank trains on GPU ``local_rank % count`` (ranks of a node
share its GPUs) and nothing runs over gloo: NCCL refuses two ranks on one GPU, and gloo
copies every gradient through the host. The trainings are checked against a
one-process reference instead (below); ``--against reference`` asks for that check on
the CPU too.

After ``--warmup`` untimed steps of each, ``--rounds`` rounds run ``--steps`` timed steps
of each implementation in turn (``1 rank`` first, then the others, their order rotated
by one every round). A step is ``zero_grad``, forward, loss, backward and ``step()``,
timed on its own with ``time.perf_counter`` (on a GPU, until the device has finished
it); the step time reported is the maximum over ranks of each rank's median.
``samples/s`` is ``ranks * batch / step``; the scaling efficiency is the one-rank step
time over the step time (the per-rank batch is fixed: weak scaling), 1.0 for perfect
scaling; ``gloo/impl`` is the step time of the gloo implementation of the same kind
(DDP for ``mpitrain`` and the ``ddp`` rows, FSDP for the ``fsdp`` rows) over the row's.
A ``# CPU/step`` line per model says where each implementation's processor time went:
the rank's CPU time per timed step, all threads, and the part outside the training
thread (a backend's communication threads: mpitrain's engine and stall inspector,
gloo's), each the maximum over ranks. Where a rank has one core, the step cannot be
shorter than its CPU time; a wait counts where it spins (mpitrain's shared-memory
barriers, where every rank has a core), not where it blocks.

Verification: every implementation took the same steps on the same data, so their
parameters must agree at the end. The measure is the norm of the difference from the
baseline over the norm of the baseline's total update (:func:`update_difference`), max
over ranks, against a tolerance that depends on the compression. The baseline is DDP
over gloo (``--against ddp``, the default when ``ddp`` runs on the CPU) or a
one-process reference that every rank trains after the timed rounds, untimed, on its
own device (``--against reference``): the same number of steps, each on the mean of
every rank's loss on its batch of that step (the same batches), which is what
averaging the ranks' gradients computes. A larger difference, or no update at all, is
a failure: the row says ``FAILED`` and the job exits with 1.

Both models use SiLU, not ReLU: with ReLU's kink, the last-bit differences that a
different summation order leaves in an average (DDP and mpitrain add the ranks'
gradients in different orders) can send the two trainings of the ConvNet apart by
percents within a few steps, even with plain float32 sums in two orders and no
communication library at all; a smooth activation keeps them within about 1e-5.

Every rank runs ``torch.set_num_threads(1)``: one core per rank. Started as ``python -m
benchmarks train``, torch puts its tensors of 2 MiB and more on transparent huge pages
(:func:`~benchmarks.common.ask_for_huge_pages`; not with ``--small-pages``), so that
the order in which the implementations' models are built does not change their speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import mpitrain.torch as hvd

from . import gloo
from .common import (
    HUGE_PAGES_VARIABLE,
    SMALL_PAGES_FLAG,
    OneRankParser,
    command_line,
    huge_pages,
    machine_info,
    program_name,
)
from .report import ALONE, BASELINES, GLOO_OF, NO_COMM, thread_bounds

MODELS = ("mlp", "convnet")
IMPLS = ("mpitrain", "ddp", "ddp-mpitrain", "fsdp", "fsdp-mpitrain")
"""The data-parallel implementations ``--impl`` can pick (:data:`BASELINES` always run)."""
DEFAULT_IMPLS = ("mpitrain", "ddp", "ddp-mpitrain")
OVER_GLOO = ("ddp", "fsdp")
TOLERANCE = {"none": 1e-4, "fp16": 2e-2}
"""Largest accepted :func:`update_difference` per compression (on a GPU the float32
tolerance is :data:`GPU_TOLERANCE`: cuDNN convolutions compute in TF32 by default, and
some of its kernels add in an order of their own)."""
GPU_TOLERANCE = {"none": 1e-3, "fp16": 2e-2}
DEVICES = ("cpu", "cuda")
AGAINST = ("ddp", "reference")

MLP_WIDTH, MLP_LAYERS = 1920, 4
CONV_WIDTH, CONV_IMAGE, CONV_CLASSES = 32, 16, 10
SMALL_MLP_WIDTH, SMALL_CONV_WIDTH, SMALL_CONV_IMAGE = 64, 4, 16
# ConvNet stages: (channels as multiples of the width, stride) of each 3x3 convolution.
CONV_LAYERS = ((1, 1), (1, 1), (1, 1), (2, 2), (2, 1), (2, 1), (2, 1), (4, 2), (4, 1), (4, 1),
               (4, 1), (8, 2), (8, 1))
IDLE_POLL_S = 0.001


# -- options --------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainOptions:
    """The parsed command line of the train case."""

    models: list[str]
    batch: int
    steps: int
    rounds: int
    warmup: int
    fp16: bool
    small: bool
    lr: float
    momentum: float
    seed: int
    json: str | None
    perturb: float = 0.0
    device: str = "cpu"
    against: str = "ddp"
    parallel: tuple[str, ...] = DEFAULT_IMPLS

    @property
    def compression(self) -> str:
        """``fp16`` or ``none``: how gradients travel."""
        return "fp16" if self.fp16 else "none"

    @property
    def tolerance(self) -> float:
        """The largest accepted :func:`update_difference` of this run."""
        return (GPU_TOLERANCE if self.device == "cuda" else TOLERANCE)[self.compression]

    @property
    def impls(self) -> tuple[str, ...]:
        """The implementations timed, the two baselines first."""
        return (*BASELINES, *self.parallel)

    @property
    def baseline(self) -> str | None:
        """The implementation the others are checked against (``None``: the reference)."""
        return "ddp" if self.against == "ddp" else None

    @property
    def over_gloo(self) -> bool:
        """True if an implementation needs torch.distributed's gloo backend."""
        return any(impl in OVER_GLOO for impl in self.parallel)

    @property
    def over_backend(self) -> bool:
        """True if an implementation needs mpitrain's torch.distributed backend."""
        return any(impl.endswith("-mpitrain") for impl in self.parallel)


def _models(text: str) -> list[str]:
    return list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))


def _impls(text: str) -> list[str]:
    return [i for i in _models(text) if i not in BASELINES]


def parse_args(argv: Sequence[str], quiet: bool = False) -> TrainOptions:
    """Parse and check the command line of ``python -m benchmarks train``."""
    p = OneRankParser(quiet, prog=f"{program_name()} train",
                      description="Time and verify whole training steps: mpitrain.torch's "
                                  "DistributedOptimizer, DDP and FSDP over gloo and over "
                                  "mpitrain's torch.distributed backend, and one rank "
                                  "alone. Run under mpirun.")
    p.add_argument("--model", type=_models, default=list(MODELS),
                   help="comma list of models: mlp (4 Linear 1920x1920, 14.7 M parameters "
                        "in 8 tensors), convnet (13 conv + GroupNorm layers, 1.55 M "
                        "parameters in 41 tensors); default both")
    p.add_argument("--impl", type=_impls, default=None,
                   help="comma list of implementations: " + ", ".join(IMPLS)
                        + " (default " + ",".join(DEFAULT_IMPLS) + "; on CUDA mpitrain)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    p.add_argument("--steps", type=int, default=10,
                   help="timed steps per implementation and round (default 10)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of interleaved blocks (default 3)")
    p.add_argument("-w", "--warmup", type=int, default=2,
                   help="untimed steps of each implementation first (default 2)")
    p.add_argument("--fp16", action="store_true",
                   help="compress gradients to float16: hvd.Compression.fp16, DDP's "
                        "fp16_compress_hook, FSDP's float16 reduce_dtype")
    p.add_argument("--small", action="store_true",
                   help="small versions of the models (a quick check of the whole path)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--seed", type=int, default=1, help="seed of parameters and data (default 1)")
    p.add_argument("--json", metavar="FILE", help="write the results to this JSON file")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where every rank trains: cpu (default), or cuda (GPU local_rank %% "
                        "count; nothing over gloo, checked against a one-process reference)")
    p.add_argument("--against", choices=AGAINST, default=None,
                   help="what the parameters are checked against: ddp (DDP over gloo, the "
                        "default when it runs) or reference (a one-process training)")
    p.add_argument(SMALL_PAGES_FLAG, action="store_true",
                   help="leave torch's tensors on 4 KiB pages (by default `python -m "
                        f"benchmarks train` sets {HUGE_PAGES_VARIABLE}=1 before torch "
                        "starts, so that every implementation's parameters, gradients and "
                        "buckets are on huge pages: on 4 KiB pages the model built first "
                        "can train faster than the same one built second)")
    # Scales mpitrain's loss on the last rank by 1 + F: the check must then fail.
    p.add_argument("--perturb", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    bad = [m for m in a.model if m not in MODELS]
    if bad or not a.model:
        p.error(f"--model takes a comma list of {', '.join(MODELS)}, got {','.join(a.model)}")
    if a.batch < 1 or a.steps < 1 or a.rounds < 1 or a.warmup < 0:
        p.error(f"need --batch, --steps, --rounds >= 1 and --warmup >= 0, got --batch "
                f"{a.batch} --steps {a.steps} --rounds {a.rounds} --warmup {a.warmup}")
    parallel = a.impl if a.impl is not None else \
        (["mpitrain"] if a.device == "cuda" else list(DEFAULT_IMPLS))
    bad = [i for i in parallel if i not in IMPLS]
    if bad or not parallel:
        p.error(f"--impl takes a comma list of {', '.join(IMPLS)}, got {','.join(parallel)}")
    gloo_impls = [i for i in parallel if i in OVER_GLOO]
    if a.device == "cuda" and gloo_impls:
        p.error(f"--device cuda runs nothing over gloo (it copies every gradient through "
                f"the host, and NCCL refuses ranks that share a GPU); drop "
                f"{','.join(gloo_impls)} from --impl")
    against = a.against or ("ddp" if "ddp" in parallel else "reference")
    if against == "ddp" and "ddp" not in parallel:
        p.error("--against ddp checks against DDP over gloo: add ddp to --impl, or use "
                "--against reference")
    return TrainOptions(a.model, a.batch, a.steps, a.rounds, a.warmup, a.fp16, a.small, a.lr,
                        a.momentum, a.seed, a.json, a.perturb, a.device, against,
                        tuple(parallel))


# -- models and data ------------------------------------------------------------------
def build_model(name: str, small: bool = False) -> nn.Module:
    """The model ``name`` (``mlp`` or ``convnet``), full size or ``small``."""
    if name == "mlp":
        width = SMALL_MLP_WIDTH if small else MLP_WIDTH
        layers: list[nn.Module] = []
        for i in range(MLP_LAYERS):
            layers += [nn.Linear(width, width)] + ([nn.SiLU()] if i < MLP_LAYERS - 1 else [])
        return nn.Sequential(*layers)
    if name == "convnet":
        width = SMALL_CONV_WIDTH if small else CONV_WIDTH
        layers, channels = [], 3
        for multiple, stride in CONV_LAYERS:
            out = multiple * width
            layers += [nn.Conv2d(channels, out, 3, stride, 1, bias=False),
                       nn.GroupNorm(min(8, out), out), nn.SiLU()]
            channels = out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, CONV_CLASSES)]
        return nn.Sequential(*layers)
    raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODELS)}")


def make_batch(name: str, small: bool, batch: int, seed: int, rank: int,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic inputs and class labels of ``rank`` at ``step``: the same on every
    call with the same arguments, different for every rank and step."""
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + rank) * 1_000_003) + step)
    if name == "mlp":
        width = SMALL_MLP_WIDTH if small else MLP_WIDTH
        return (torch.randn(batch, width, generator=gen),
                torch.randint(0, width, (batch,), generator=gen))
    image = SMALL_CONV_IMAGE if small else CONV_IMAGE
    return (torch.randn(batch, 3, image, image, generator=gen),
            torch.randint(0, CONV_CLASSES, (batch,), generator=gen))


# -- the trainers ---------------------------------------------------------------------
class Trainer:
    """One implementation's model and optimizer; :meth:`step` is one timed step (on a
    GPU it returns once the device has finished it)."""

    def __init__(self, model: nn.Module, optimizer: Any, loss_scale: float = 1.0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        self.steps_done = 0
        self.device = next(model.parameters()).device

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """zero_grad, forward, loss, backward and the optimizer's step."""
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y)
        if self.loss_scale != 1.0:
            loss = loss * self.loss_scale
        loss.backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.steps_done += 1


def reference_parameters(model: nn.Module, opts: TrainOptions, steps: int,
                         batches: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                         ranks: int) -> list[torch.Tensor]:
    """The parameters after ``steps`` steps of one process: each step on the mean over
    ``ranks`` of the loss of ``batches(rank, step)`` (what averaging every rank's gradient
    of its own batch computes), with the same SGD."""
    optimizer = sgd(model, opts)
    for step in range(steps):
        optimizer.zero_grad()
        loss = sum(nn.functional.cross_entropy(model(x), y)
                   for x, y in (batches(r, step) for r in range(ranks))) / ranks
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def train_device(opts: TrainOptions) -> torch.device:
    """This rank's device: the CPU, or GPU ``local_rank % count``."""
    if opts.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    # float32 math and fixed kernels, so that the check compares summation orders only
    # (with TF32 and cuDNN's non-deterministic kernels two trainings drift apart by
    # about 3e-3 of the update in 32 ConvNet steps, whatever their communication)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())


def sgd(model: nn.Module, opts: TrainOptions) -> torch.optim.SGD:
    """The optimizer every implementation wraps or uses."""
    return torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum)


def mpitrain_trainer(model: nn.Module, opts: TrainOptions, loss_scale: float = 1.0) -> Trainer:
    """``hvd.DistributedOptimizer`` over SGD, after ``hvd.broadcast_parameters``."""
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hvd.Compression.fp16 if opts.fp16 else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(sgd(model, opts),
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
    return Trainer(model, optimizer, loss_scale)


def ddp_trainer(model: nn.Module, opts: TrainOptions, group: Any,
                loss_scale: float = 1.0) -> Trainer:
    """``DistributedDataParallel`` over ``group`` with SGD on the wrapped model's
    parameters."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, process_group=group)
    if opts.fp16:  # the hook's state is its group (None: the default group, gloo's here)
        ddp.register_comm_hook(state=group, hook=fp16_compress_hook)
    return Trainer(ddp, sgd(ddp, opts), loss_scale)


def fsdp_trainer(model: nn.Module, opts: TrainOptions, group: Any,
                 loss_scale: float = 1.0) -> Trainer:
    """FSDP2 over ``group``: ``fully_shard`` of every layer that holds parameters, then of
    the model, and SGD on the sharded parameters."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float16 if opts.fp16 else None)
    for layer in model.children():
        if any(True for _ in layer.parameters(recurse=False)):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return Trainer(model, sgd(model, opts), loss_scale)


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters, whole (collective for a sharded model: it gathers them)."""
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for p in model.parameters()]


def trainers(opts: TrainOptions, fresh: Callable[[], nn.Module], last_rank: bool,
             groups: dict[str, Any]) -> dict[str, Trainer]:
    """A trainer of every implementation of ``--impl`` on a fresh copy of the model;
    ``groups`` holds the process groups (``gloo``, ``mpitrain``). Every one but the
    baseline scales the last rank's loss by ``1 + perturb``."""
    out = {}
    for impl in opts.parallel:
        scale = 1.0 + opts.perturb if last_rank and impl != opts.baseline else 1.0
        if impl == "mpitrain":
            out[impl] = mpitrain_trainer(fresh(), opts, scale)
        else:
            kind, _, backend = impl.partition("-")
            make = ddp_trainer if kind == "ddp" else fsdp_trainer
            out[impl] = make(fresh(), opts, groups[backend or "gloo"], scale)
    return out


IMPL_TEXT = {ALONE: "plain SGD on rank 0 alone",
             NO_COMM: "plain SGD on every rank at once, no communication",
             "mpitrain": "hvd.DistributedOptimizer",
             "ddp": "DDP over gloo", "ddp-mpitrain": "DDP over mpitrain's backend",
             "fsdp": "FSDP2 over gloo", "fsdp-mpitrain": "FSDP2 over mpitrain's backend"}


def process_groups(opts: TrainOptions, world: MPI.Intracomm) -> dict[str, Any]:
    """The torch.distributed groups the implementations need (collective):
    :func:`.gloo.groups`."""
    return gloo.groups(world, opts.over_gloo, opts.over_backend)


# -- timing ---------------------------------------------------------------------------
def block_order(impls: Sequence[str], round_index: int) -> list[str]:
    """The implementations of one round, in the order they run: ``1 rank`` first, then
    the others of ``impls``, rotated by one every round."""
    rest = [impl for impl in impls if impl != ALONE]
    shift = round_index % len(rest) if rest else 0
    return [ALONE, *rest[shift:], *rest[:shift]]


def timed_steps(trainer: Trainer, steps: int,
                batch_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Run ``steps`` steps, each on the batch of its step number; seconds per step."""
    times = []
    for _ in range(steps):
        x, y = batch_of(trainer.steps_done)
        start = time.perf_counter()
        trainer.step(x, y)
        times.append(time.perf_counter() - start)
    return times


def idle_barrier(world: MPI.Intracomm) -> None:
    """A barrier that waits in 1 ms sleeps instead of polling, leaving the cores free."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(IDLE_POLL_S)


def samples_per_second(batch: int, ranks: int, step_s: float) -> float:
    """Samples trained per second by ``ranks`` ranks of ``batch`` samples per step."""
    return ranks * batch / step_s


def scaling_efficiency(one_rank_s: float, step_s: float) -> float:
    """Weak-scaling efficiency: the one-rank step time over the step time at N ranks
    (the per-rank batch is fixed), 1.0 when adding ranks costs nothing."""
    return one_rank_s / step_s


def update_difference(ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor],
                      start: Sequence[torch.Tensor]) -> float:
    """``||ours - theirs|| / ||theirs - start||`` over all parameters: how far two
    trainings from ``start`` ended apart, relative to how far they moved.

    ``inf`` if ``theirs`` did not move; ``nan`` if a parameter is not finite.
    """
    diff = math.sqrt(sum(float((a.double() - b.double()).square().sum())
                         for a, b in zip(ours, theirs, strict=True)))
    moved = math.sqrt(sum(float((b.double() - s.double()).square().sum())
                          for b, s in zip(theirs, start, strict=True)))
    if math.isnan(diff) or math.isnan(moved) or math.isinf(diff) or math.isinf(moved):
        return math.nan
    return diff / moved if moved > 0 else math.inf


def matches(difference: float, tolerance: float) -> bool:
    """True if :func:`update_difference` is finite and within ``tolerance``."""
    return math.isfinite(difference) and difference <= tolerance


@dataclass(frozen=True)
class TrainResult:
    """One row: a model trained by one implementation."""

    model: str
    params: int
    tensors: int
    batch: int
    ranks: int
    compression: str
    impl: str
    step_ms: float
    step_min_ms: float
    step_max_ms: float
    samples_per_s: float
    scaling: float
    steps: int
    difference: float
    ok: bool
    cpu_ms: float = math.nan
    """CPU time of the rank's process per step, every thread (max over ranks)."""
    other_cpu_ms: float = math.nan
    """Of it, the threads other than the one that trains: a backend's communication
    threads (mpitrain's engine and stall inspector, gloo's), max over ranks."""
    train_cpu_ms: float = math.nan
    """CPU time of the training thread per step, max over ranks: no step is shorter."""


def measure(opts: TrainOptions, name: str, world: MPI.Intracomm,
            groups: dict[str, Any]) -> list[TrainResult]:
    """Train ``name`` with every implementation, interleaved; time and verify
    (collective over ``world``; every rank returns the same rows)."""
    rank, nranks = world.Get_rank(), world.Get_size()
    device = train_device(opts)
    torch.manual_seed(opts.seed)
    initial = build_model(name, opts.small)
    start = [p.detach().clone().to(device) for p in initial.parameters()]

    def fresh() -> nn.Module:
        return copy.deepcopy(initial).to(device)

    trained = trainers(opts, fresh, rank == nranks - 1, groups)
    if rank == 0:
        alone = fresh()
        trained[ALONE] = Trainer(alone, sgd(alone, opts))
    own = fresh()
    trained[NO_COMM] = Trainer(own, sgd(own, opts))

    def batch_on(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = make_batch(name, opts.small, opts.batch, opts.seed, r, step)
        return x.to(device), y.to(device)

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_on(rank, step)

    times: dict[str, list[float]] = {impl: [] for impl in opts.impls}
    # CPU seconds over the timed blocks: [every thread, the training thread]
    cpu = {impl: np.zeros(2) for impl in opts.impls}
    for round_index in range(-1 if opts.warmup else 0, opts.rounds):
        steps = opts.warmup if round_index < 0 else opts.steps
        for impl in block_order(opts.impls, max(round_index, 0)):
            if impl == ALONE:  # rank 0 alone, the others asleep
                begun = cpu_now()
                done = timed_steps(trained[impl], steps, batch_of) if rank == 0 else []
                used = cpu_now(end=True) - begun
                idle_barrier(world)
            else:
                world.Barrier()
                begun = cpu_now()
                done = timed_steps(trained[impl], steps, batch_of)
                used = cpu_now(end=True) - begun
            if round_index >= 0:
                times[impl] += done
                cpu[impl] += used
    ends = {impl: full_parameters(trained[impl].model) for impl in opts.parallel}
    if opts.baseline is not None:
        theirs = ends[opts.baseline]
    else:
        theirs = reference_parameters(fresh(), opts, trained[opts.parallel[0]].steps_done,
                                      batch_on, nranks)
    mine = [update_difference(ends[impl], theirs, start) for impl in opts.parallel]
    differences = np.array(world.allgather(mine), dtype=float)  # ranks x implementations
    # median, min, max per implementation; the 1-rank times are rank 0's (0 elsewhere)
    # and CPU per step: every thread, the other threads
    stats = np.array([[statistics.median(t), min(t), max(t),
                       cpu[impl][0] / len(t), (cpu[impl][0] - cpu[impl][1]) / len(t),
                       cpu[impl][1] / len(t)]
                      if t else [0.0] * 6 for impl, t in times.items()])
    world.Allreduce(MPI.IN_PLACE, stats, MPI.MAX)
    params = list(initial.parameters())
    count, tensors = sum(p.numel() for p in params), len(params)
    one_rank_s = stats[0][0]
    rows = []
    for impl, (median, fastest, longest, cpu_s, other_s, thread_s) in zip(times, stats):
        alone, checked = impl == ALONE, impl not in (*BASELINES, opts.baseline)
        column = differences[:, opts.parallel.index(impl)] if checked else np.zeros(1)
        difference = math.nan if np.isnan(column).any() else float(column.max())
        ranks = 1 if alone else nranks
        rows.append(TrainResult(name, count, tensors, opts.batch, ranks,
                                "-" if impl in BASELINES else opts.compression, impl,
                                median * 1e3, fastest * 1e3, longest * 1e3,
                                samples_per_second(opts.batch, ranks, median),
                                scaling_efficiency(one_rank_s, median),
                                opts.steps * opts.rounds, difference if checked else math.nan,
                                matches(difference, opts.tolerance) if checked else True,
                                cpu_s * 1e3, other_s * 1e3, thread_s * 1e3))
    return rows


def cpu_now(end: bool = False) -> np.ndarray[Any, Any]:
    """CPU seconds used so far by this process (every thread) and by this thread: the
    process first at the start of a span, last at its ``end``, so that this thread's
    time between the two readings counts to the process only and the difference of
    the two (the other threads') is never negative."""
    if end:
        thread = time.thread_time()
        return np.array([time.process_time(), thread])
    process = time.process_time()
    return np.array([process, time.thread_time()])


def cpu_line(rows: Sequence[TrainResult]) -> str:
    """Where each implementation's CPU time per step goes (one model's rows): all of it,
    and the part outside the training thread."""
    return f"# CPU/step {rows[0].model:>8} : " + "; ".join(
        f"{r.impl} {r.cpu_ms:.1f} ms ({r.other_cpu_ms:.1f} off the training thread)"
        for r in rows)


def bound_line(rows: Sequence[TrainResult], cores: int) -> str | None:
    """One model's :func:`~benchmarks.report.thread_bounds` on a host of ``cores``
    cores: the ``gloo/impl`` each mpitrain implementation could reach if its own threads
    cost nothing (None: no row has a gloo step to compare with, or the ranks share
    cores)."""
    bounds = thread_bounds([asdict(r) for r in rows], cores).get(rows[0].model)
    if not bounds:
        return None
    return (f"# Bound     {rows[0].model:>8} : gloo/impl at most " + ", ".join(
        f"{impl} {b:.2f}" for impl, b in bounds.items())
        + " (the gloo step over the training thread's CPU per step)")


# -- the table ------------------------------------------------------------------------
HEADER = ("#{:>8} {:>9} {:>7} {:>7} {:>5} {:>8} {:>13} | {:>9} {:>9} {:>9} {:>10} {:>7} "
          "{:>9} | {:>9} {:>6}")


def table_header() -> list[str]:
    """The column titles and units."""
    return [HEADER.format("model", "params", "tensors", "batch", "ranks", "compress", "impl",
                          "step", "min", "max", "samples/s", "scaling", "gloo/impl",
                          "rel.diff", "check"),
            HEADER.format("", "", "", "(/rank)", "", "", "", "(ms)", "(ms)", "(ms)", "", "",
                          "", "", "")]


def table_rows(rows: Sequence[TrainResult]) -> list[str]:
    """The lines of one model: one per implementation; ``gloo/impl`` is the step time of
    the gloo implementation of the row's kind (:data:`GLOO_OF`) over the row's (above 1:
    faster than gloo); ``rel.diff`` is :func:`update_difference` against the baseline
    (``N/A`` on the rows without communication and on the baseline's own)."""
    steps = {r.impl: r.step_ms for r in rows}
    lines = []
    for r in rows:
        gloo_ms = steps.get(GLOO_OF.get(r.impl, ""))
        checked = not math.isnan(r.difference) or not r.ok
        lines.append(HEADER.format(
            r.model, r.params, r.tensors, r.batch, r.ranks, r.compression, r.impl,
            f"{r.step_ms:.2f}", f"{r.step_min_ms:.2f}", f"{r.step_max_ms:.2f}",
            f"{r.samples_per_s:.1f}", f"{r.scaling:.2f}",
            f"{gloo_ms / r.step_ms:.2f}" if gloo_ms else "N/A",
            f"{r.difference:.2e}" if checked else "N/A",
            ("OK" if r.ok else "FAILED") if checked else "-").replace("#", " ", 1))
    return lines


def verification_lines(results: Sequence[TrainResult], tolerance: float,
                       against: str = "ddp") -> list[str]:
    """The closing lines: per model and checked implementation the verification
    (against ``ddp`` or the one-process ``reference``), then the count of failures."""
    lines = []
    failed = 0
    for r in results:
        if r.impl in (*BASELINES, against):
            continue
        failed += not r.ok
        lines.append(f"# Verification {r.model:>8} {r.impl:>13} : |{r.impl} - {against}| / "
                     f"|{against} update| = {r.difference:.2e} after {r.steps} timed steps "
                     f"(tolerance {tolerance:g}): {'OK' if r.ok else 'FAILED'}")
    lines.append(f"# Mismatched trainings : {failed} {'OK' if failed == 0 else 'FAILED'}")
    return lines


def describe_device(opts: TrainOptions) -> str:
    """Where the ranks train: the CPU, or the GPUs (name, driver, CUDA)."""
    if opts.device == "cpu":
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    return (f"cuda: {torch.cuda.device_count()} x {props.name}, rank r on GPU r % count; "
            f"CUDA {torch.version.cuda}; float32 without TF32, deterministic cuDNN")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the train case; 0 if mpitrain ended with the parameters of DDP (or of the
    one-process reference), else 1."""
    args = list(sys.argv[2:] if argv is None else argv)
    world = MPI.COMM_WORLD.Dup()
    rank, nranks = world.Get_rank(), world.Get_size()
    opts = parse_args(args, quiet=rank != 0)
    torch.set_num_threads(1)
    hvd.init()
    groups = process_groups(opts, world)
    command = command_line(["train", *args], nranks)
    machine = {**machine_info(world), "torch": torch.__version__, "pages": huge_pages()}

    def emit(lines: Sequence[str]) -> None:
        if rank == 0:
            print("\n".join(lines), flush=True)

    emit([f"# mpitrain benchmark: train ({', '.join(opts.models)}"
          f"{', small' if opts.small else ''})",
          f"# command   : {command}",
          f"# MPI       : {machine['mpi_library']}; idle ranks {machine['idle_wait']}",
          f"# ranks     : {nranks} on {', '.join(machine['hosts'])}, {machine['cpus']} cpus, "
          "1 torch thread each",
          f"# versions  : python {machine['python']}, torch {machine['torch']}, "
          f"mpitrain {machine['mpitrain']}",
          f"# memory    : torch's tensors of 2 MiB and more on {machine['pages']}",
          f"# training  : SGD lr {opts.lr:g} momentum {opts.momentum:g}, cross-entropy on "
          f"synthetic data, seed {opts.seed}; gradients {opts.compression}",
          f"# device    : {describe_device(opts)}",
          "# impls     : " + "; ".join(f"{impl} = {IMPL_TEXT[impl]}" for impl in opts.impls)
          + f" (torch {torch.__version__}); checked against "
          + ("DDP over gloo" if opts.against == "ddp" else "a one-process reference on every "
             "rank's batches"),
          f"# timing    : {opts.warmup} warm-up + {opts.rounds} rounds x {opts.steps} steps "
          f"of each, blocks interleaved ({', '.join(opts.impls)}; all but 1 rank rotated "
          "every round); step = max over ranks of each rank's median; scaling = 1-rank step "
          "/ step",
          "#", *table_header()])
    results: list[TrainResult] = []
    for name in opts.models:
        rows = measure(opts, name, world, groups)
        results += rows
        emit(table_rows(rows))
    emit([cpu_line([r for r in results if r.model == name]) for name in opts.models])
    bounds = [line for name in opts.models if (line := bound_line(
        [r for r in results if r.model == name], machine["cpus"] or 0)) is not None]
    if bounds:
        emit(bounds)
    emit(verification_lines(results, opts.tolerance, opts.against))
    if rank == 0 and opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump({"case": "train", "command": command, "machine": machine,
                       "settings": {**asdict(opts), "compression": opts.compression,
                                    "tolerance": opts.tolerance},
                       "timing": "step_ms = max over ranks of each rank's median step time; "
                                 f"min/max likewise; {ALONE} = rank 0 alone; "
                                 f"{NO_COMM} = every rank alone at once; cpu_ms = the "
                                 "process's CPU time per timed step, other_cpu_ms its "
                                 "threads but the training one's, train_cpu_ms the "
                                 "training thread's, each max over ranks",
                       "results": [asdict(r) for r in results]}, f, indent=1)
            f.write("\n")
    if groups:
        gloo.finish()
    hvd.shutdown()
    world.Free()
    return 0 if all(r.ok for r in results) else 1


__all__ = ["TrainOptions", "TrainResult", "build_model", "main", "make_batch", "measure",
           "parse_args", "scaling_efficiency", "update_difference"]
