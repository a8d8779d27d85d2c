"""A call before init names the init the program knows: ``hvd.init()`` in a Horovod
script (``import mpitrain.torch as hvd``), ``mpitrain.init()`` otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _error_of(script: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPITRAIN_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


CALL = """
try:
    {call}
except mt.NotInitializedError as exc:
    print(exc)
"""


def test_the_numpy_api_names_mpitrain_init() -> None:
    message = _error_of("import mpitrain as mt" + CALL.format(call="mt.rank()"))
    assert message == "rank 0: mpitrain is not initialised: call mpitrain.init() first"


def test_a_horovod_script_is_told_to_call_hvd_init() -> None:
    pytest.importorskip("torch")
    message = _error_of("import mpitrain as mt\nimport mpitrain.torch as hvd"
                        + CALL.format(call="hvd.size()"))
    assert message.startswith("rank 0: mpitrain is not initialised: call hvd.init()"), message
