"""The harness's baselines and measurements beyond the table: gloo columns, mpitrain
through torch.distributed, columns without validation, peak memory, copy bandwidth,
and the BENCHMARKS.md report."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from mpi4py import MPI

import mpitrain as mt
from benchmarks import common, gloo, harness, memory, report
from benchmarks.collectives import COLLECTIVES
from benchmarks.hooks import Case


@pytest.fixture(scope="module")
def comms() -> Any:
    """A validating and a non-validating communicator and a duplicate, over COMM_SELF,
    and, when torch is installed, torch.distributed on a one-rank gloo group, on a group
    of mpitrain's backend and on one of the torch-mpi baseline (the harness's ``dists``)."""
    comm = mt.Communicator(MPI.COMM_SELF, check=True)
    unchecked = mt.Communicator(MPI.COMM_SELF, check=False)
    world = MPI.COMM_SELF.Dup()
    groups = gloo.groups(world, True, True, True) if gloo.available() else {}
    dists = {kind: gloo.OnGroup(groups[backend])
             for kind, backend in harness.OVER_TORCH.items() if backend in groups}
    yield comm, unchecked, world, dists
    if groups:
        gloo.finish()
    for c in (comm, unchecked):
        c.free()
    world.Free()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint32"])
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_every_baseline_and_check_column_verifies(comms: Any, name: str, dtype: str) -> None:
    comm, unchecked, world, dists = comms
    impls = "mpitrain,mpi,gloo,torch-mpitrain,torch-mpi" if dists else "mpitrain,mpi"
    opts = harness.parse_args([name, "-b", "8", "-e", "64", "-n", "2", "-w", "1", "-d", dtype,
                               "-o", "avg", "--impl", impls, "--check", "on,off"], nranks=1)
    case = Case(16, opts.dtype, opts.op, opts.root, 0, 1)
    results = harness.measure(opts, case, comm, world, unchecked, dists)
    labels = {r.impl for r in results}
    assert {"mpitrain", "mpitrain[nocheck]", "mpi"} <= labels
    if dists and dtype != "uint32":  # gloo reduces no wide unsigned type
        assert {"gloo", "torch-mpitrain"} <= labels
    if dists:  # MPI has no 16-bit float type
        assert ("torch-mpi" in labels) == (dtype != "bfloat16"), labels
    assert all(r.wrong == 0 for r in results), results
    assert all(r.extra_mib >= 0 or r.extra_mib == memory.UNKNOWN for r in results)


@pytest.mark.parametrize("op", ["sum", "prod"])
@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter"])
def test_torch_columns_skip_the_complex_reductions_torch_refuses(comms: Any, name: str,
                                                                 op: str) -> None:
    """torch.distributed refuses PRODUCT (and MIN, MAX) of complex tensors: its columns
    print N/A there instead of ending the run; sums of complex numbers still run."""
    comm, unchecked, world, dists = comms
    if not dists:
        pytest.skip("needs torch")
    opts = harness.parse_args([name, "-b", "64", "-e", "64", "-n", "2", "-w", "1", "-d",
                               "complex64", "-o", op, "--impl",
                               "mpitrain,mpi,gloo,torch-mpitrain,torch-mpi"], nranks=1)
    case = Case(8, opts.dtype, opts.op, opts.root, 0, 1)
    results = harness.measure(opts, case, comm, world, unchecked, dists)
    torch_columns = {"gloo", "torch-mpitrain", "torch-mpi"}
    labels = {r.impl for r in results}
    assert {"mpitrain", "mpi"} <= labels
    assert (torch_columns <= labels) == (op == "sum"), labels
    assert not (torch_columns & labels) or op == "sum", labels
    assert all(r.wrong == 0 for r in results), results


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_the_torch_mpitrain_column_calls_torch_on_mpitrain_backend(
        comms: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch-mpitrain`` and ``torch-mpi`` make the gloo column's torch.distributed
    call, on a group of mpitrain's backend and of the baseline's; their results are
    verified like every column's."""
    comm, unchecked, world, dists = comms
    if not dists:
        pytest.skip("needs torch")
    import torch.distributed as dist

    seen: list[str] = []
    for function in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single",
                     "all_gather_into_tensor", "all_gather_single", "broadcast"):
        real = getattr(dist, function, None)
        if real is None:  # the *_single calls are not in every torch
            continue

        def spy(*args: Any, real: Any = real, group: Any = None, **kwargs: Any) -> Any:
            seen.append(dist.get_backend(group))
            return real(*args, group=group, **kwargs)

        monkeypatch.setattr(dist, function, spy)
    opts = harness.parse_args([name, "-b", "64", "-e", "64", "-n", "2", "-w", "1",
                               "--impl", "gloo,torch-mpitrain,torch-mpi"], nranks=1)
    case = Case(16, opts.dtype, opts.op, opts.root, 0, 1)
    results = harness.measure(opts, case, comm, world, unchecked, dists)
    assert {r.impl for r in results} == {"gloo", "torch-mpitrain", "torch-mpi"}
    assert all(r.wrong == 0 for r in results), results
    assert set(seen) == {"gloo", "mpitrain", "pympi"}
    # torch-mpi is compared with torch-mpitrain only
    assert harness.ratio_pairs(opts.impls) == [("gloo", "torch-mpitrain"),
                                               ("torch-mpi", "torch-mpitrain")]


def test_torch_columns_refuse_device_buffers() -> None:
    with pytest.raises(SystemExit):
        harness.parse_args(["allreduce", "--impl", "mpitrain,torch-mpitrain", "--array", "cupy"],
                           nranks=1, quiet=True)


def test_make_impls_expands_checks_and_keeps_baselines() -> None:
    impls = harness.make_impls(["mpitrain", "mpi", "gloo"], ["auto", "ring"], [True, False])
    assert [i.label for i in impls] == [
        "mpitrain:auto", "mpitrain:ring", "mpitrain:auto[nocheck]", "mpitrain:ring[nocheck]",
        "mpi", "gloo"]
    assert [i.check for i in impls[:4]] == [True, True, False, False]
    pairs = harness.ratio_pairs(impls)
    assert ("mpi", "mpitrain:ring[nocheck]") in pairs and ("gloo", "mpitrain:auto") in pairs
    with pytest.raises(SystemExit):
        harness.parse_args(["allreduce", "--check", "maybe"], nranks=1, quiet=True)


def test_peak_extra_sees_a_large_allocation() -> None:
    import numpy as np

    held = []
    extra = memory.peak_extra(lambda: held.append(np.ones(64 << 17)))  # 64 MiB, touched
    if extra == memory.UNKNOWN:
        pytest.skip("no resettable high-water mark here")
    assert 60 <= extra <= 80
    assert memory.peak_extra(lambda: None) < 8


def test_copy_bandwidth_is_positive() -> None:
    one, together = memory.copy_bandwidth(MPI.COMM_SELF, nbytes=8 << 20, reps=2)
    assert one > 0.1 and together > 0.1


def test_overhead_lines_and_bound() -> None:
    def result(impl: str, size: int, time_us: float) -> harness.Result:
        return harness.Result(size, 1, "float32", "sum", -1, impl, False, time_us, time_us,
                              time_us, 1.0, 1.0, 0)

    lines = harness.overhead_lines([result("mpitrain", 4, 5.0), result("mpi", 4, 2.0),
                                    result("mpitrain[nocheck]", 4, 4.5),
                                    result("mpitrain", 64, 9.0)])
    assert lines[0].startswith("# Per-call cost at 4 B : mpitrain 5.00 us = native 2.00 us "
                               "+3.00 us (2.50x native)")
    assert "+0.50 us per call" in lines[1]
    bound = harness.direct_bound(COLLECTIVES["allreduce"], 2, 30.0)
    assert bound == pytest.approx(30.0 / 5 * 1.0)


def _doc(collective: str, ranks: int, impls: list[str], times: dict[str, dict[int, float]],
         command: str) -> dict[str, Any]:
    results = [{"size": size, "impl": impl, "inplace": False, "time_us": t,
                "busbw": size / t / 1e3, "extra_mib": 1.0}
               for impl, by_size in times.items() for size, t in by_size.items()]
    return {"collective": collective, "command": command,
            "machine": {"ranks": ranks, "copy_gbps_one": 20.0, "copy_gbps_all": 30.0},
            "settings": {"impls": impls, "iters": 10}, "results": results}


def test_report_tables_and_targets(tmp_path: Any) -> None:
    mib = 1 << 20
    times = {"mpitrain": {4: 3.0, 16 * mib: 1000.0}, "mpi": {4: 2.0, 16 * mib: 2000.0},
             "gloo": {4: 300.0, 16 * mib: 5000.0}}
    (tmp_path / "allreduce-np2.json").write_text(json.dumps(
        _doc("allreduce", 2, list(times), times, "mpirun -np 2 python -m benchmarks x")))
    over = {"mpitrain": {4: 5.0}, "mpitrain[nocheck]": {4: 4.0}, "mpi": {4: 2.0}}
    (tmp_path / "allreduce-np2-overhead.json").write_text(json.dumps(
        _doc("allreduce", 2, list(over), over, "cmd-overhead")))
    (tmp_path / "BENCHMARKS.template.md").write_text("# Benchmarks\n\n{{results}}\n")
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([str(tmp_path), "-t", str(tmp_path / "BENCHMARKS.template.md"),
                        "-o", str(out)]) == 0
    text = out.read_text()
    assert "| allreduce >= 256 KiB: >= 1.5x native | 2 | 2.00 (16 MiB) | 1.50 | yes |" \
        in text
    assert "| allreduce <= 16 KiB: latency <= 2x native (validation on) | 2 | 0.40 (4 B) | " \
           "0.50 | no, 80% of the goal |" in text
    assert "| 4 B | 3.0 us | 2.0 us | 300.0 us | 0.67 | 100.00 |" in text
    # recorded before the harness wrote every flag: shown with make bench's, as root
    assert "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca osc ^ucx -np 2 " \
           "python -m benchmarks x" in text and "cmd-overhead" in text
    assert report.main([str(tmp_path / "nothing-here")]) == 1
    assert os.path.exists(out)


def test_report_multinode_tables(tmp_path: Any) -> None:
    """The han and flat runs of multinode.sh become one table per rate and node count,
    with the mean of mpitrain's two runs and the inter-node bound at the link rate."""
    mib = 1 << 20
    folder = tmp_path / "multinode"
    folder.mkdir()
    for native, mpi_us, hier_us in (("han", 700_000.0, 690_000.0), ("flat", 1_000_000.0,
                                                                     710_000.0)):
        times = {"mpitrain:ring": {16 * mib: 1_050_000.0},
                 "mpitrain:hierarchical": {16 * mib: hier_us}, "mpi": {16 * mib: mpi_us}}
        doc = _doc("allreduce", 4, list(times), times, "cmd")
        doc["settings"]["sizes"] = [16 * mib]
        (folder / f"allreduce-200mbit-2n-{native}.json").write_text(json.dumps(doc))
    (folder / "allreduce-1gbit-2n-han.json").write_text(json.dumps(doc))  # no flat twin
    lines = report.multinode(str(folder))
    assert lines[0] == "### 2 nodes x 2 ranks, 200mbit links"
    assert "| 16 MiB | 1050.0 ms | 700.0 ms | 700.0 ms | 1000.0 ms | 1.50 | 1.00 | 1.43 | " \
           "671.1 ms | 96% |" in lines
    assert not any("1gbit" in line for line in lines)
    assert report.link_rate("1gbit") == 125e6 and report.link_rate("200mbit") == 25e6
    with pytest.raises(ValueError):
        report.link_rate("10kbaud")


def test_run_order_is_shared_and_gives_every_call_every_neighbour() -> None:
    keys = [(name, False) for name in "abcde"]
    orders = [common.run_order(keys, rep) for rep in range(200)]
    assert all(sorted(order) == sorted(keys) for order in orders)
    assert orders == [common.run_order(keys, rep) for rep in range(200)]  # every rank alike
    before: dict[Any, set[Any]] = {key: set() for key in keys}
    for order in orders:
        for prev, key in zip(order, order[1:]):
            before[key].add(prev)
    assert all(before[key] == set(keys) - {key} for key in keys)
    first = {order[0] for order in orders}
    assert first == set(keys)


def test_time_calls_runs_in_run_order() -> None:
    from benchmarks.hooks import Call, no_reset

    ran: list[str] = []
    calls = {(name, False): Call(lambda name=name: ran.append(name), no_reset)
             for name in "abc"}
    common.time_calls(calls, iters=3, warmup=0, barrier=lambda: None)
    want = [key[0] for rep in range(3) for key in common.run_order(list(calls), rep)]
    assert ran == want


def test_each_run_is_timed_after_its_reset_has_settled() -> None:
    from benchmarks.hooks import Call

    events: list[str] = []
    calls = {(name, False): Call(lambda: events.append("run"),
                                 lambda: events.append("reset")) for name in "ab"}
    common.time_calls(calls, iters=2, warmup=1, barrier=lambda: events.append("barrier"),
                      settle=lambda: events.append("settle"))
    assert events == ["reset", "settle", "barrier", "run"] * 6


def test_budget_cuts_repetitions_but_not_below_three() -> None:
    import time as clock

    from benchmarks.hooks import Call, no_reset

    slow = Call(lambda: clock.sleep(0.01), no_reset)
    times = common.time_calls({("a", False): slow}, iters=50, warmup=1, barrier=lambda: None,
                              budget=0.05)
    assert common.MIN_ITERS <= len(times[("a", False)]) <= 6
    times = common.time_calls({("a", False): slow}, iters=4, warmup=1, barrier=lambda: None)
    assert len(times[("a", False)]) == 4


def _train_doc(ranks: int, idle_wait: str, ok: bool) -> dict[str, Any]:
    rows = [{"model": "mlp", "params": 14_753_280, "tensors": 8, "impl": impl, "step_ms": t,
             "samples_per_s": 32 * n / t * 1e3, "scaling": 50.0 / t,
             "difference": float("nan") if impl == "1 rank" else 2e-6,
             "ok": impl == "1 rank" or ok}
            for impl, t, n in (("1 rank", 50.0, 1), ("mpitrain", 80.0, ranks),
                               ("ddp", 100.0, ranks))]
    return {"case": "train", "command": f"mpirun -np {ranks} python -m benchmarks train",
            "machine": {"ranks": ranks, "cpus": 2, "idle_wait": idle_wait},
            "settings": {"batch": 32, "rounds": 3, "steps": 10, "compression": "none"},
            "results": rows}


def test_report_puts_busy_polling_first_with_targets_per_setup(tmp_path: Any) -> None:
    """One section per setup, busy-polling (the headline) before yielding, each with its
    own targets table; the training runs fill {{train}} and are not collectives."""
    mib = 1 << 20
    times = {"mpitrain": {16 * mib: 1000.0}, "mpi": {16 * mib: 2000.0}}
    for ranks, wait, slower in ((2, "busy-poll", 1.0), (4, "yield", 1.6)):
        doc = _doc("allreduce", ranks, list(times), times, f"cmd-np{ranks}")
        doc["machine"].update(idle_wait=wait, cpus=2)
        doc["results"] = [dict(r, time_us=r["time_us"] * (slower if r["impl"] == "mpitrain"
                                                          else 1.0)) for r in doc["results"]]
        (tmp_path / f"allreduce-np{ranks}.json").write_text(json.dumps(doc))
    (tmp_path / "train-np2.json").write_text(json.dumps(_train_doc(2, "busy-poll", True)))
    (tmp_path / "train-np4-fp16.json").write_text(json.dumps(_train_doc(4, "yield", False)))
    template = tmp_path / "BENCHMARKS.template.md"
    template.write_text("# Benchmarks\n\n{{results}}\n\n## Training\n\n{{train}}\n")
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([str(tmp_path), "-t", str(template), "-o", str(out)]) == 0
    text = out.read_text()
    busy = text.index("## 2 ranks on 2 cores, busy-polling (plain `mpirun -np 2`)")
    yielding = text.index("## 4 ranks on 2 cores, yielding (`--mca mpi_yield_when_idle 1`)")
    assert busy < yielding < text.index("## Training")
    assert text.count("### Targets") == 2
    assert text.index("| allreduce >= 256 KiB: >= 1.5x native | 2 | 2.00 (16 MiB) | 1.50 "
                      "| yes |") < yielding
    assert text.index("| allreduce >= 256 KiB: >= 1.5x native | 4 | 1.25 (16 MiB) | 1.50 "
                      "| no, 83% of the goal |") > yielding
    assert "### train" not in text and "cmd-np2" in text
    training = text[text.index("## Training"):]
    assert training.index("### 2 ranks on 2 cores, busy-polling") \
        < training.index("### 4 ranks on 2 cores, yielding")
    assert "| mlp | 14.75 M (8) | mpitrain | 80.0 ms | 800.0 | 0.62 | 1.25 | 2.0e-06 | OK |" \
        in training
    assert "| mlp | 14.75 M (8) | 1 rank | 50.0 ms | 640.0 | 1.00 | - | - | - |" in training
    assert "| 2.0e-06 | FAILED |" in training
