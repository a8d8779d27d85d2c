"""tools/torch_conformance.py's ``--as NAME``: groups torch's tests make with that
backend's name are mpitrain's (the integration suite runs the tool itself)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

TOOL = Path(__file__).resolve().parents[2] / "tools" / "torch_conformance.py"


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("torch_conformance", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_groups_made_under_the_alias_are_mpitrain_groups() -> None:
    tool = _tool()
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    make = tool._as_ours(lambda *a, **k: calls.append((a, k)), "gloo")
    make([1, 2], backend="gloo", timeout=5)
    make(backend="nccl")  # another backend's name stays as it is
    make([0, 1])
    assert calls == [(([1, 2],), {"backend": "mpitrain", "timeout": 5}),
                     ((), {"backend": "nccl"}), (([0, 1],), {})]
    assert set(tool.NOT_OURS) == {"gloo", "mpi"}  # the names --as takes
