"""``import mpitrain`` loads no MPI; its names are imported from their modules on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import mpitrain as mt

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_package_loads_no_mpi() -> None:
    code = ("import sys, mpitrain\n"
            "print(mpitrain.__version__, 'mpi4py' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [mt.__version__, "False"]


def test_every_name_comes_from_its_module() -> None:
    table = {name: module for module, names in mt._EXPORTS.items() for name in names}
    assert sorted(table) == sorted(set(mt.__all__) - {"elastic"})
    assert len(mt.__all__) == len(set(mt.__all__))
    for name, module in table.items():
        assert getattr(mt, name) is getattr(importlib.import_module(f"mpitrain.{module}"), name)
    assert mt.elastic is importlib.import_module("mpitrain.elastic")
    assert set(mt.__all__) <= set(dir(mt))
    from mpitrain import Sum, checkpoint  # a name, and a submodule not imported yet
    assert Sum is mt.Sum and checkpoint is importlib.import_module("mpitrain.checkpoint")


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'allreduse'"):
        mt.allreduse  # noqa: B018
    assert not hasattr(mt, "__wrapped__")
