"""A checkpoint writer killed mid-write leaves the previous checkpoint intact."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
from jobrun import JOBS, finish, start

from mpitrain import checkpoint

WRITER = [sys.executable, str(JOBS / "checkpoint_writer.py")]


def assert_intact(directory: Path) -> int:
    """The newest checkpoint loads and holds the state of its own step; returns the step."""
    path = checkpoint.latest(str(directory))
    assert path is not None, os.listdir(directory)
    loaded = checkpoint.load(path)
    step = loaded.step
    assert loaded.state["step"] == step
    w = loaded.state["w"]
    assert w.shape == (4 << 20,) and w[1] == step and w[-1] == (w.size - 1) * step
    return step


def test_killed_between_write_and_rename(tmp_path: Path) -> None:
    result = finish(start([*WRITER, str(tmp_path), "fsync"]), 120)
    assert result.rc == -signal.SIGKILL, result.out
    assert "saved 1" in result.out
    names = sorted(os.listdir(tmp_path))
    assert any(n.startswith(".tmp-ckpt-") for n in names), names  # the torn write
    assert [n for n in names if not n.startswith(".tmp")] == ["ckpt-000000001.safetensors"]
    assert assert_intact(tmp_path) == 1
    resumed = checkpoint.load_latest(str(tmp_path))  # removes the dead writer's file
    assert resumed is not None and resumed.step == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000001.safetensors"]
    checkpoint.save(str(tmp_path), {"w": np.zeros(1), "step": 5}, step=5)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000001.safetensors",
                                            "ckpt-000000005.safetensors"]


def test_killed_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(1)
    for attempt in range(3):
        directory = tmp_path / str(attempt)
        proc = start([*WRITER, str(directory), "loop"])
        started = time.monotonic()
        while not (directory / "ckpt-000000001.safetensors").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() - started < 60
            time.sleep(0.02)
        time.sleep(rng.uniform(0.05, 1.5))
        os.killpg(proc.pid, signal.SIGKILL)
        finish(proc, 30)
        assert assert_intact(directory) >= 1

