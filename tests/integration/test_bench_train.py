"""``python -m benchmarks train`` at 2 ranks with the small models: the table, the JSON,
and a perturbed run that the verification must report as a mismatch."""

from __future__ import annotations

import json
import os
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
    impls = ["1 rank", "no comm", "mpitrain", "ddp", "ddp-mpitrain"]
    assert [(r[0], r[4], " ".join(r[6:-10])) for r in rows] == [
        (m, "1" if i == "1 rank" else "2", i) for m in ("mlp", "convnet") for i in impls]
    assert [r[-1] for r in rows] == ["-", "-", "OK", "-", "OK"] * 2
    # the rows without communication: no compression, no ratio to gloo, nothing checked
    assert all((r[5], r[-4], r[-2]) == ("-", "N/A", "N/A") for r in rows
               if " ".join(r[6:-10]) in ("1 rank", "no comm"))
    assert "# Mismatched trainings : 0 OK" in result.out
    cpu = [line for line in result.out.splitlines() if line.startswith("# CPU/step")]
    assert [line.split()[2] for line in cpu] == ["mlp", "convnet"], result.out
    assert all(f"; {i} " in line for line in cpu for i in impls[1:]), cpu
    bound = [line for line in result.out.splitlines() if line.startswith("# Bound")]
    # the training thread's CPU bounds the step where every rank has a core
    want = ["mlp", "convnet"] if (os.cpu_count() or 1) >= 2 else []
    assert [line.split()[2] for line in bound] == want, result.out
    doc = json.loads(out.read_text())
    assert doc["case"] == "train" and doc["machine"]["ranks"] == 2
    assert doc["machine"]["idle_wait"] == "yield"
    # torch's large tensors on huge pages (asked for before torch starts) where allowed
    assert doc["machine"]["pages"] in (
        "huge pages", "4 KiB pages (transparent huge pages are off in the kernel)"), doc
    assert f"on {doc['machine']['pages']}" in result.out
    assert {(r["model"], r["impl"]) for r in doc["results"]} == {
        (m, i) for m in ("mlp", "convnet") for i in impls}
    for r in doc["results"]:
        assert r["step_ms"] > 0 and r["steps"] == 4
        assert r["cpu_ms"] > 0 and 0 <= r["other_cpu_ms"] <= r["cpu_ms"], r
        assert 0 < r["train_cpu_ms"] <= r["cpu_ms"] + 1e-6, r
        if r["impl"] not in ("1 rank", "no comm", "ddp"):
            assert r["ok"] and r["difference"] < doc["settings"]["tolerance"]


def test_train_benchmark_reports_a_perturbed_gradient_as_a_mismatch() -> None:
    """The hidden --perturb scales the loss of every implementation but the baseline on
    the last rank: their averaged gradients then differ from DDP's, and the check must
    fail the run for each."""
    result = run(mpirun(2, [*SHORT, "--model", "mlp", "--perturb", "0.1"]), TIMEOUT_S)
    assert result.rc not in (0, -1), result.out
    assert "# Mismatched trainings : 2 FAILED" in result.out
    for impl in ("mpitrain", "ddp-mpitrain"):
        assert any(line.startswith(f"# Verification      mlp {impl:>13} ")
                   and line.endswith("FAILED") for line in result.out.splitlines()), result.out


def test_train_benchmark_checks_against_a_one_process_reference() -> None:
    """--against reference (what --device cuda uses): no DDP; mpitrain's parameters
    against a one-process training on every rank's batches, which a perturbed gradient
    on one rank must fail."""
    result = run(mpirun(2, [*SHORT, "--model", "mlp", "--impl", "mpitrain",
                            "--against", "reference"]), TIMEOUT_S)
    assert result.rc == 0, result.out
    assert "|mpitrain - reference| / |reference update|" in result.out
    assert "# Mismatched trainings : 0 OK" in result.out
    rows = [line for line in result.out.splitlines() if line.startswith("      mlp")]
    assert [row.split()[6] for row in rows] == ["1", "no", "mpitrain"], result.out
    bad = run(mpirun(2, [*SHORT, "--model", "mlp", "--impl", "mpitrain", "--against",
                         "reference", "--perturb", "0.1"]), TIMEOUT_S)
    assert bad.rc not in (0, -1), bad.out
    assert "# Mismatched trainings : 1 FAILED" in bad.out


def test_train_benchmark_runs_fsdp_over_both_backends_at_three_ranks() -> None:
    """FSDP2 over gloo and over mpitrain's backend (and DDP over mpitrain's backend as
    the default group when gloo does not run) train what the reference trains."""
    result = run(mpirun(3, [*SHORT, "--model", "convnet", "--impl",
                            "fsdp,fsdp-mpitrain,ddp-mpitrain"]), TIMEOUT_S)
    assert result.rc == 0, result.out
    rows = [line.split() for line in result.out.splitlines() if line.startswith("  convnet")]
    assert [(r[6], r[-1]) for r in rows] == [("1", "-"), ("no", "-"), ("fsdp", "OK"),
                                             ("fsdp-mpitrain", "OK"), ("ddp-mpitrain", "OK")], \
        result.out
    alone = run(mpirun(2, [*SHORT, "--model", "mlp", "--impl", "ddp-mpitrain"]), TIMEOUT_S)
    assert alone.rc == 0 and "# Mismatched trainings : 0 OK" in alone.out, alone.out
