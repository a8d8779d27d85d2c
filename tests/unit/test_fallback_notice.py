"""The pure-Python fallback is told once at run time: rank 0, one line, why, how to
build the compiled parts and how to silence it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpitrain import _builds, session

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_to_say_when_everything_is_compiled(tmp_path: Path) -> None:
    assert _builds.why_not_compiled(True, True, tmp_path / "mpitrain") == ""


def test_a_source_tree_not_built_in_place_is_told_to_build(tmp_path: Path) -> None:
    (tmp_path / "setup.py").write_text("")
    why = _builds.why_not_compiled(False, True, tmp_path / "mpitrain")
    assert f"the engine core of the source tree {tmp_path} is not built" in why
    assert "run `make` there" in why and "build_ext --inplace" in why


def test_an_installation_without_a_compiler_is_told_to_reinstall(tmp_path: Path) -> None:
    why = _builds.why_not_compiled(False, False, tmp_path / "mpitrain")
    assert "built without the engine core and the host copy extension" in why
    assert "MPITRAIN_COMPILE=1 pip install --force-reinstall" in why


def test_the_notice_names_its_setting_and_obeys_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session._engine, "compiled", lambda: False)
    monkeypatch.delenv("MPITRAIN_FALLBACK_NOTICE", raising=False)
    notice = session.fallback_notice()
    assert notice.startswith("mpitrain: running the pure-Python fallback")
    assert "MPITRAIN_FALLBACK_NOTICE=0 silences this line" in notice
    assert "\n" not in notice
    monkeypatch.setenv("MPITRAIN_FALLBACK_NOTICE", "0")
    assert session.fallback_notice() == ""


SCRIPT = """
import mpitrain as mt
import mpitrain.session as s
s._engine.compiled = lambda: False  # as in a build without a C compiler
mt.init()
mt.shutdown()
mt.init()
print("done")
"""


@pytest.mark.parametrize("silenced", [False, True])
def test_init_says_it_once(silenced: bool) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPITRAIN_")}
    env["PYTHONPATH"] = str(ROOT)
    if silenced:
        env["MPITRAIN_FALLBACK_NOTICE"] = "0"
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    lines = [line for line in done.stderr.splitlines() if "pure-Python fallback" in line]
    assert len(lines) == (0 if silenced else 1), done.stderr


DEBUG_SCRIPT = """
import numpy as np
import mpitrain as mt
comm = mt.init()
for _ in range(3):
    comm.allreduce(np.ones(8, np.float32))
print("done")
"""


def test_log_level_debug_prints_rank_tagged_choices_once() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPITRAIN_")}
    env.update(PYTHONPATH=str(ROOT), MPITRAIN_LOG_LEVEL="debug", MPITRAIN_FALLBACK_NOTICE="0")
    done = subprocess.run([sys.executable, "-c", DEBUG_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    choices = [line for line in done.stderr.splitlines() if "allreduce of 32 B" in line]
    assert len(choices) == 1, done.stderr
    assert choices[0].startswith("[rank 0] mpitrain DEBUG: mpitrain rank 0: allreduce of 32 B "
                                 "of float32 on numpy buffers: algorithm "), choices
    assert "a communicator of 1 rank(s) on 1 node(s)" in done.stderr
