"""Checkpoints: atomic writes, no pickle, bit-identical resume (numpy and torch)."""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import time
from typing import Any, Iterator

import numpy as np
import pytest
from helpers import assert_all_ranks

import mpitrain as mt
from mpitrain import checkpoint, trainer
from mpitrain.errors import CheckpointError

SAMPLES = 40
BATCH = 4  # per rank


@pytest.fixture
def shared_dir(comm: mt.Communicator) -> Iterator[str]:
    """A directory every rank sees (rank 0 creates and removes it)."""
    path = comm.broadcast_object(tempfile.mkdtemp(prefix="mpitrain-ckpt-") if comm.rank == 0
                                 else None)
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def batches(sampler: trainer.DistributedSampler, skip: int) -> Iterator[np.ndarray]:
    order = sampler.indices()
    for b in range(skip, len(order) // BATCH):
        yield order[b * BATCH:(b + 1) * BATCH]


def train_numpy(comm: mt.Communicator, directory: str, steps: int, save_at: int | None,
                resume: bool) -> list[np.ndarray]:
    """SGD with momentum on noisy regression; every source of randomness is used."""
    x_all = np.random.default_rng(7).standard_normal((SAMPLES, 3))
    y_all = x_all @ np.array([1.0, -2.0, 0.5])
    params = [trainer.Parameter(np.zeros(3), "w")]
    opt = trainer.DistributedOptimizer(trainer.SGD(params, lr=0.05, momentum=0.9))
    sampler = trainer.DistributedSampler(SAMPLES, seed=11)
    gen = np.random.default_rng(1000 + comm.rank)
    random.seed(2000 + comm.rank)
    np.random.seed(3000 + comm.rank)
    step, epoch, skip = 0, 0, 0
    if resume:  # a fresh process: everything above was re-created, then overwritten
        gen = np.random.default_rng(99)
        ckpt = checkpoint.load(checkpoint.latest(directory), rank=comm.rank)
        params[0].data[...] = ckpt.state["params"]["w"]
        opt.load_state_dict(ckpt.state["optimizer"])
        sampler.load_state_dict(ckpt.state["sampler"])
        step, epoch, skip = ckpt.state["step"], ckpt.state["epoch"], ckpt.state["batch"]
        checkpoint.restore_rng(ckpt.rank_state, gen)
    while step < steps:
        sampler.set_epoch(epoch)
        for b, idx in enumerate(batches(sampler, skip), start=skip):
            if step == save_at and not resume:
                checkpoint.save(directory, {"params": {"w": params[0].data},
                                            "optimizer": opt.state_dict(),
                                            "sampler": sampler.state_dict(), "step": step,
                                            "epoch": epoch, "batch": b},
                                step, per_rank=checkpoint.capture_rng(gen))
            if step == steps:
                break
            opt.zero_grad()
            x = x_all[idx] + 0.01 * gen.standard_normal((len(idx), 3))
            noise = random.random() * 1e-3 + np.random.random() * 1e-3
            params[0].grad = x.T @ (x @ params[0].data - y_all[idx]) / len(idx) + noise
            opt.step()
            step += 1
        epoch, skip = epoch + 1, 0
    return [params[0].data]


@pytest.mark.mpi(min_size=1)
def test_numpy_resume_is_bit_identical(comm: mt.Communicator, shared_dir: str) -> None:
    full = train_numpy(comm, shared_dir, steps=17, save_at=7, resume=False)  # mid-epoch
    resumed = train_numpy(comm, shared_dir, steps=17, save_at=None, resume=True)
    assert_all_ranks(comm, np.array_equal(full[0], resumed[0]),
                     f"resumed {resumed[0]} != uninterrupted {full[0]}")
    assert_all_ranks(comm, not np.array_equal(full[0], np.zeros(3)), "training moved")


def train_torch(comm: mt.Communicator, directory: str, steps: int, save_at: int | None,
                resume: bool) -> Any:
    import torch

    import mpitrain.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.3),
                                torch.nn.Linear(8, 1)).double()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    sampler = trainer.DistributedSampler(SAMPLES, seed=5)
    x_all = torch.from_numpy(np.random.default_rng(7).standard_normal((SAMPLES, 3)))
    y_all = x_all.sum(1, keepdim=True)
    torch.manual_seed(100 + comm.rank)  # dropout masks differ by rank
    step, epoch, skip = 0, 0, 0
    if resume:
        torch.manual_seed(12345)
        ckpt = hvd.load_checkpoint(checkpoint.latest(directory), model, opt)
        sampler.load_state_dict(ckpt.state["extra"]["sampler"])
        step, epoch, skip = (ckpt.state["extra"][k] for k in ("step", "epoch", "batch"))
    while step < steps:
        sampler.set_epoch(epoch)
        for b, idx in enumerate(batches(sampler, skip), start=skip):
            if step == save_at and not resume:
                hvd.save_checkpoint(directory, step, model, opt,
                                    extra={"sampler": sampler.state_dict(), "step": step,
                                           "epoch": epoch, "batch": b})
            if step == steps:
                break
            opt.zero_grad()
            loss = ((model(x_all[idx]) - y_all[idx]) ** 2).mean()
            loss.backward()
            opt.step()
            step += 1
        epoch, skip = epoch + 1, 0
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.mpi(min_size=1)
def test_torch_resume_is_bit_identical(comm: mt.Communicator, shared_dir: str) -> None:
    torch = pytest.importorskip("torch")
    full = train_torch(comm, shared_dir, steps=9, save_at=4, resume=False)
    resumed = train_torch(comm, shared_dir, steps=9, save_at=None, resume=True)
    assert_all_ranks(comm, bool(torch.equal(full, resumed)),
                     f"resumed differs by {float((full - resumed).abs().max())}")


@pytest.mark.mpi(min_size=1)
def test_write_is_atomic_and_cleans_up(comm: mt.Communicator, shared_dir: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": np.arange(5.0) + comm.rank, "meta": {"lr": 0.1, 3: (1, "a")}}
    if comm.rank == 0:  # a writer killed before this job started left a temporary file
        stale = os.path.join(shared_dir, ".tmp-ckpt-stale.npz")
        with open(stale, "wb") as f:
            f.write(b"torn")
        os.utime(stale, (time.time() - 3600,) * 2)
    first = checkpoint.save(shared_dir, state, step=1)
    listing = sorted(os.listdir(shared_dir))
    assert_all_ranks(comm, listing == ["ckpt-000000001.safetensors"], f"directory: {listing}")
    loaded = checkpoint.load(first)
    assert_all_ranks(comm, np.array_equal(loaded.state["w"], np.arange(5.0)) and
                     loaded.state["meta"] == {"lr": 0.1, 3: (1, "a")} and loaded.step == 1,
                     "rank 0's state round-trips")

    def crash(src: str, dst: str) -> None:
        raise OSError("disk full")
    if comm.rank == 0:
        monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(CheckpointError, match=r"rank 0 could not write.*disk full"):
        checkpoint.save(shared_dir, state, step=2)  # every rank raises rank 0's error
    monkeypatch.undo()
    listing = sorted(os.listdir(shared_dir))
    assert_all_ranks(comm, listing == ["ckpt-000000001.safetensors"] and
                     checkpoint.latest(shared_dir) == first, f"after a failed write: {listing}")
    for step in (3, 4, 5):
        checkpoint.save(shared_dir, state, step=step, keep=2)
    steps = [s for s, _ in checkpoint.list_checkpoints(shared_dir)]
    assert_all_ranks(comm, steps == [4, 5], f"keep=2 kept {steps}")


@pytest.mark.mpi(min_size=1)
def test_no_pickle(comm: mt.Communicator, shared_dir: str) -> None:
    with pytest.raises(CheckpointError, match="Python objects"):
        checkpoint.save(shared_dir, {"bad": np.array([{"x": 1}], dtype=object)}, step=1)
    with pytest.raises(CheckpointError, match="set"):
        checkpoint.save(shared_dir, {"bad": {1, 2}}, step=1)
    forged = os.path.join(shared_dir, "ckpt-000000009.npz")
    if comm.rank == 0:  # a file with a pickled object array, as np.savez writes it
        meta = b'{"format": "mpitrain-checkpoint", "version": 1, "step": 9, ' \
               b'"state": {"__array__": {"key": "a0"}}, "per_rank": null}'
        with open(forged, "wb") as f:
            np.savez(f, a0=np.array([print], dtype=object),
                     __meta__=np.frombuffer(meta, np.uint8))
    comm.barrier()
    with pytest.raises(CheckpointError, match="without pickle"):
        checkpoint.load(forged)
    plain = os.path.join(shared_dir, "plain.npz")
    if comm.rank == 0:
        np.savez(plain, x=np.ones(2))
    comm.barrier()
    with pytest.raises(CheckpointError, match="not an mpitrain checkpoint"):
        checkpoint.load(plain)
    path = checkpoint.save(shared_dir, {"x": 1}, step=10, per_rank={"r": comm.rank})
    assert checkpoint.load(path, rank=comm.rank).rank_state == {"r": comm.rank}
    with pytest.raises(CheckpointError, match=f"per-rank state of {comm.size} ranks"):
        checkpoint.load(path, rank=comm.size)


@pytest.mark.mpi(min_size=2)
def test_cleanup_spares_temporary_files_being_written(comm: mt.Communicator, shared_dir: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank removes abandoned temporary files when it resumes, and rank 0 when it
    saves, but none removes the file of a save another rank is writing, however old."""
    renamed: list[str] = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: renamed.append(src) or replace(src, dst))
    checkpoint.save(shared_dir, {"x": 1}, step=1)
    monkeypatch.undo()
    named = re.fullmatch(r"\.tmp-ckpt-\d+@(.+)\.[a-z0-9_]+\.safetensors",
                         os.path.basename(renamed[0])) if comm.rank == 0 else None
    host = comm.broadcast_object(named.group(1) if named else None)
    assert host is not None, renamed
    old = time.time() - 3600
    writing = f".tmp-ckpt-{os.getpid()}@{host}.slow12.safetensors"
    if comm.rank == comm.size - 1:  # this rank's own save is still being written
        with open(os.path.join(shared_dir, writing), "wb") as f:
            f.write(b"half")
        os.utime(os.path.join(shared_dir, writing), (old, old))
    if comm.rank == 0:
        with open(os.path.join(shared_dir, ".tmp-ckpt-killed.npz"), "wb") as f:
            f.write(b"torn")
        os.utime(os.path.join(shared_dir, ".tmp-ckpt-killed.npz"), (old, old))
    writing = comm.broadcast_object(writing, root=comm.size - 1)
    comm.barrier()
    assert checkpoint.load_latest(shared_dir).step == 1
    checkpoint.save(shared_dir, {"x": 2}, step=2)
    listing = sorted(os.listdir(shared_dir))
    want = sorted([writing, "ckpt-000000001.safetensors", "ckpt-000000002.safetensors"])
    assert_all_ranks(comm, listing == want, f"directory: {listing}")
