"""``python -m benchmarks.stacks``: py-spy's collapsed stacks added up thread by thread."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import stacks

RANK0 = "".join(line + "\n" for line in (
    "thread (101): MainThread;step (benchmarks/train.py:10);"
    "backward (torch/autograd/__init__.py:5) 60",
    "thread (101): MainThread;step (benchmarks/train.py:10);"
    "allreduce (mpitrain/torch/distributed.py:700);submit (mpitrain/communicator.py:405) 20",
    "thread (101);step (benchmarks/train.py:11);fold (mpitrain/x.py:1);fold (mpitrain/x.py:2) 5",
    "thread (202): mpitrain-engine-2-rank0;run (mpitrain/engine/fusion.py:130);"
    "_poll (mpitrain/comm/shm.py:250) 10",
))
RANK1 = """\
thread (303): MainThread;step (benchmarks/train.py:10);backward (torch/autograd/__init__.py:5) 5
not a stack line
"""


def test_threads_functions_and_shares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s.0.txt").write_text(RANK0)
    (tmp_path / "s.1.txt").write_text(RANK1)
    threads = stacks.read(RANK0.splitlines())
    main = threads["MainThread"]  # the stack naming thread 101 by id alone is MainThread's
    assert set(threads) == {"MainThread", "mpitrain-engine-2-rank0"}
    assert main.samples == 85
    assert main.inclusive["step (train.py)"] == 85
    assert main.inclusive["fold (x.py)"] == 5  # a recursion counts once per sample
    assert main.self == {"backward (__init__.py)": 60, "submit (communicator.py)": 20,
                         "fold (x.py)": 5}
    only_ours = stacks.read(RANK0.splitlines(), match=["mpitrain/"])["MainThread"]
    assert "step (train.py)" not in only_ours.inclusive
    assert only_ours.self == {"submit (communicator.py)": 20, "fold (x.py)": 5}
    assert stacks.main([str(tmp_path / "s.0.txt"), str(tmp_path / "s.1.txt"),
                        "--match", "mpitrain/,torch/", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "100 samples in 2 thread(s)"
    assert out[2] == "MainThread: 90 samples, 90.0 %"  # both ranks' main threads
    assert out[3].split() == ["on", "the", "stack", "65.0", "%", "65", "backward",
                              "(__init__.py)"]
    assert "mpitrain-engine-2-rank0: 10 samples, 10.0 %" in out
