"""``python -m benchmarks train`` at 2 ranks with the small models: the table, the JSON,
and a perturbed run that the verification must report as a mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobrun import mpirun, run

pytest.importorskip("torch")

TIMEOUT_S = 180.0
SHORT = ["-m", "benchmarks", "train", "--small", "--steps", "2", "--rounds", "2", "-w", "1"]


def test_train_benchmark_prints_the_table_and_verifies(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    result = run(mpirun(2, [*SHORT, "--json", str(out)]), TIMEOUT_S)
    assert result.rc == 0, result.out
    rows = [line.split() for line in result.out.splitlines()
            if line.startswith(("      mlp", "  convnet"))]
    assert [(r[0], r[4], " ".join(r[6:-10])) for r in rows] == [
        ("mlp", "1", "1 rank"), ("mlp", "2", "mpitrain"), ("mlp", "2", "ddp"),
        ("convnet", "1", "1 rank"), ("convnet", "2", "mpitrain"), ("convnet", "2", "ddp")]
    assert [r[-1] for r in rows] == ["-", "OK", "OK", "-", "OK", "OK"]
    assert "# Mismatched models : 0 OK" in result.out
    doc = json.loads(out.read_text())
    assert doc["case"] == "train" and doc["machine"]["ranks"] == 2
    assert doc["machine"]["idle_wait"] == "yield"
    assert {(r["model"], r["impl"]) for r in doc["results"]} == {
        (m, i) for m in ("mlp", "convnet") for i in ("1 rank", "mpitrain", "ddp")}
    for r in doc["results"]:
        assert r["step_ms"] > 0 and r["steps"] == 4
        if r["impl"] != "1 rank":
            assert r["ok"] and r["difference"] < doc["settings"]["tolerance"]


def test_train_benchmark_reports_a_perturbed_gradient_as_a_mismatch() -> None:
    """The hidden --perturb scales mpitrain's loss on the last rank: its averaged
    gradients then differ from DDP's, and the check must fail the run."""
    result = run(mpirun(2, [*SHORT, "--model", "mlp", "--perturb", "0.1"]), TIMEOUT_S)
    assert result.rc not in (0, -1), result.out
    assert "# Mismatched models : 1 FAILED" in result.out
    assert "Verification      mlp" in result.out and "FAILED" in result.out


def test_train_benchmark_checks_against_a_one_process_reference() -> None:
    """--against reference (what --device cuda uses): no DDP; mpitrain's parameters
    against a one-process training on every rank's batches, which a perturbed gradient
    on one rank must fail."""
    result = run(mpirun(2, [*SHORT, "--model", "mlp", "--against", "reference"]), TIMEOUT_S)
    assert result.rc == 0, result.out
    assert "|mpitrain - reference| / |reference update|" in result.out
    assert "# Mismatched models : 0 OK" in result.out
    rows = [line for line in result.out.splitlines() if line.startswith("      mlp")]
    assert len(rows) == 2 and "1 rank" in rows[0] and "mpitrain" in rows[1], result.out
    bad = run(mpirun(2, [*SHORT, "--model", "mlp", "--against", "reference",
                         "--perturb", "0.1"]), TIMEOUT_S)
    assert bad.rc not in (0, -1), bad.out
    assert "# Mismatched models : 1 FAILED" in bad.out
