"""The training examples end to end at 2 ranks: train, checkpoint, resume, timeline;
their progress: one line per epoch in logs, a bar on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path
from typing import Any

import pytest
from jobrun import ROOT, environment
from mpirun import run, start

EXAMPLES = {"numpy": "train_numpy.py", "torch": "train.py"}


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_example_trains_checkpoints_and_resumes(kind: str, tmp_path: Path) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    script = str(ROOT / "examples" / EXAMPLES[kind])
    ckpt, timeline = tmp_path / "ckpt", tmp_path / "timeline.json"
    args = ["--checkpoint", str(ckpt), "--batch-size", "32"]
    code, out = run(2, [sys.executable, script, "--epochs", "1", *args,
                        "--timeline", str(timeline)], 300, OMP_NUM_THREADS="1")
    assert code == 0, out
    assert re.search(r"epoch 1/1: \d+ steps in [\d.]+s, .* accuracy 0\.\d{4} \(averaged over "
                     r"2 rank", out), out
    assert re.search(r"test accuracy: 0\.\d{4} on 360 held-out digits", out), out
    assert (ckpt / "ckpt-000000000.safetensors").exists()
    events = json.loads(timeline.read_text())
    assert any(e.get("ph") == "X" for e in events), "the timeline recorded the allreduces"

    code, out = run(2, [sys.executable, script, "--epochs", "2", *args], 300,
                    OMP_NUM_THREADS="1")
    assert code == 0, out
    assert "resumed from" in out and "(after epoch 1 of 2; training epochs 2 to 2)" in out, out
    assert "epoch 1/2" not in out and "epoch 2/2" in out, out
    accuracy = float(re.search(r"test accuracy: (0\.\d{4})", out).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.5, f"two epochs should beat chance by far: {accuracy}"
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-000000000.safetensors",
                                                      "ckpt-000000001.safetensors"]


def read_all(proc: subprocess.Popen[Any], stream: Any, timeout: float) -> bytes:
    """Every byte of ``stream`` until ``proc`` closes it, as it was written (no newline
    translation); the job's process group is killed if it outlives ``timeout``."""
    timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(stream, 65536)
            except OSError:  # a terminal whose other side closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        proc.wait()
    finally:
        timer.cancel()
    return b"".join(chunks)


EPOCH_LINE = r"epoch {}/3: \d+ steps in [\d.]+s, loss \d+\.\d{{4}} accuracy 0\.\d{{4}} " \
             r"\(averaged over {} rank\(s\)\)"


def test_progress_under_mpirun_is_one_line_per_epoch_from_rank_0() -> None:
    pytest.importorskip("sklearn")
    proc = start(2, [sys.executable, str(ROOT / "examples" / "train_numpy.py"), "--epochs", "3",
                     "--batch-size", "32"], OMP_NUM_THREADS="1")
    assert proc.stdout is not None
    raw = read_all(proc, proc.stdout.fileno(), 300)
    assert proc.returncode == 0, raw
    assert b"\r" not in raw, raw  # no bar redrawn in place: the output is a pipe
    assert b"\n\n" not in raw, raw  # nor the empty line of a bar that could not be drawn
    epochs = [line for line in raw.decode().splitlines() if line.startswith("epoch")]
    assert len(epochs) == 3, raw  # rank 0's lines only
    for i, line in enumerate(epochs, 1):
        assert re.fullmatch(EPOCH_LINE.format(i, 2), line), line


@pytest.mark.parametrize("launched", [False, True], ids=["python", "mpitrain-run"])
def test_progress_on_a_terminal_is_a_bar_then_the_epoch_line(launched: bool) -> None:
    """On a terminal the bar is drawn and stays; through mpitrain-run too, whose ranks
    write to Open MPI's sizeless pseudo-terminal (the launcher passes the width on)."""
    pytest.importorskip("sklearn")
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    env = environment(OMP_NUM_THREADS="1")
    script = [sys.executable, str(ROOT / "examples" / "train_numpy.py"), "--epochs", "3",
              "--batch-size", "32"]
    if launched:
        script = [sys.executable, "-m", "mpitrain.run", "-np", "2", *script]
        env["MPITRAIN_FALLBACK_NOTICE"] = "0"
    ranks = 2 if launched else 1
    proc = subprocess.Popen(script, stdin=subprocess.DEVNULL,
                            stdout=secondary, stderr=secondary, env=env, start_new_session=True)
    os.close(secondary)
    try:
        raw = read_all(proc, primary, 300)
    finally:
        os.close(primary)
    assert proc.returncode == 0, raw
    text = raw.decode().replace("\r\n", "\n")  # the terminal ends lines with \r\n
    assert re.search(r"\repoch 1/3:  *\d+%\|", text), text  # tqdm's bar, drawn in place
    shown = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]  # what stays on screen
    epochs = [line for line in shown if line.startswith("epoch")]
    # per epoch the bar stays, complete, then the epoch's line
    assert len(epochs) == 6, text
    for i, (bar, line) in enumerate(zip(epochs[::2], epochs[1::2]), 1):
        assert re.match(rf"epoch {i}/3: 100%\|", bar), text
        assert re.fullmatch(EPOCH_LINE.format(i, ranks), line), text


def test_train_refuses_cuda_without_a_gpu_on_every_rank() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/mpi/test_torch_cuda.py covers training on it")
    code, out = run(2, [sys.executable, str(ROOT / "examples" / "train.py"), "--device", "cuda",
                        "--epochs", "1"], 120, OMP_NUM_THREADS="1")
    assert code != 0
    for rank in (0, 1):
        assert f"rank {rank}: --device cuda needs a GPU and a CUDA build of torch" in out, out
