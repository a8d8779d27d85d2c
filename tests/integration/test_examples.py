"""The training examples end to end at 2 ranks: train, checkpoint, resume, timeline."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from mpirun import ROOT, finish, start

EXAMPLES = {"numpy": "train_numpy.py", "torch": "train.py"}


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_example_trains_checkpoints_and_resumes(kind: str, tmp_path: Path) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    script = str(ROOT / "examples" / EXAMPLES[kind])
    ckpt, timeline = tmp_path / "ckpt", tmp_path / "timeline.json"
    args = ["--checkpoint", str(ckpt), "--batch-size", "32"]
    code, out = finish(start(2, [sys.executable, script, "--epochs", "1", *args,
                                 "--timeline", str(timeline)], OMP_NUM_THREADS="1"), 300)
    assert code == 0, out
    assert re.search(r"epoch 1/1 \[#+\] \d+/\d+ .* accuracy 0\.\d{4} \(averaged over 2 rank",
                     out), out
    assert re.search(r"test accuracy: 0\.\d{4} on 360 held-out digits", out), out
    assert (ckpt / "ckpt-000000000.safetensors").exists()
    events = json.loads(timeline.read_text())
    assert any(e.get("ph") == "X" for e in events), "the timeline recorded the allreduces"

    code, out = finish(start(2, [sys.executable, script, "--epochs", "2", *args],
                             OMP_NUM_THREADS="1"), 300)
    assert code == 0, out
    assert "resumed from" in out and "epoch 1 of 2" in out, out
    assert "epoch 1/2" not in out and "epoch 2/2" in out, out
    accuracy = float(re.search(r"test accuracy: (0\.\d{4})", out).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.5, f"two epochs should beat chance by far: {accuracy}"
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-000000000.safetensors",
                                                      "ckpt-000000001.safetensors"]
