"""The train benchmark's pure parts: models, data, the verification measure, the table
(the whole benchmark runs under mpirun in tests/integration/test_bench_train.py)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from benchmarks import report, train  # noqa: E402  (needs torch)


@pytest.mark.parametrize("small", [False, True])
def test_models_have_the_documented_shape(small: bool) -> None:
    mlp, convnet = train.build_model("mlp", small), train.build_model("convnet", small)
    assert len(list(mlp.parameters())) == 8
    assert len(list(convnet.parameters())) == 41
    if not small:
        assert sum(p.numel() for p in mlp.parameters()) == 4 * (1920 * 1920 + 1920)
        assert 1_400_000 < sum(p.numel() for p in convnet.parameters()) < 1_700_000


@pytest.mark.parametrize("name", train.MODELS)
def test_batches_fit_their_model_and_differ_by_rank_and_step(name: str) -> None:
    x, y = train.make_batch(name, True, 4, 1, 0, 0)
    out = train.build_model(name, True)(x)
    assert out.shape[0] == 4 and int(y.max()) < out.shape[1]
    again, _ = train.make_batch(name, True, 4, 1, 0, 0)
    assert torch.equal(x, again)
    assert not torch.equal(x, train.make_batch(name, True, 4, 1, 1, 0)[0])
    assert not torch.equal(x, train.make_batch(name, True, 4, 1, 0, 1)[0])


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        train.build_model("resnet", False)


def test_update_difference_is_relative_to_the_update() -> None:
    start = [torch.zeros(3), torch.zeros(2)]
    theirs = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])]  # moved by 5
    ours = [torch.tensor([3.0, 0.0, 0.5]), torch.tensor([0.0, 4.0])]
    assert train.update_difference(ours, theirs, start) == pytest.approx(0.1)
    assert train.update_difference(theirs, theirs, start) == 0.0


def test_update_difference_flags_no_update_and_non_finite_values() -> None:
    start = [torch.ones(2)]
    assert train.update_difference([torch.ones(2)], [torch.ones(2)], start) == math.inf
    assert math.isnan(train.update_difference([torch.tensor([math.nan, 1.0])],
                                              [torch.tensor([2.0, 1.0])], start))
    assert not train.matches(math.inf, 1.0) and not train.matches(math.nan, 1.0)
    assert train.matches(1e-6, 1e-4) and not train.matches(2e-4, 1e-4)


def test_rounds_rotate_the_implementations_after_the_one_rank_block() -> None:
    two = ("1 rank", "mpitrain", "ddp")
    assert train.block_order(two, 0) == ["1 rank", "mpitrain", "ddp"]
    assert train.block_order(two, 1) == ["1 rank", "ddp", "mpitrain"]
    assert train.block_order(two, 2) == train.block_order(two, 0)
    three = ("1 rank", "a", "b", "c")
    orders = [train.block_order(three, r) for r in range(3)]
    assert [o[1:] for o in orders] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(o[0] == "1 rank" for o in orders)
    assert train.block_order(("1 rank", "mpitrain"), 5) == ["1 rank", "mpitrain"]
    # the block without communication takes its turn among the others
    assert train.block_order(("1 rank", "no comm", "ddp"), 1) == ["1 rank", "ddp", "no comm"]


def test_throughput_and_weak_scaling() -> None:
    assert train.samples_per_second(32, 2, 0.5) == 128.0
    assert train.scaling_efficiency(0.1, 0.125) == pytest.approx(0.8)


def _row(impl: str, step_ms: float, ok: bool = True) -> train.TrainResult:
    return train.TrainResult("mlp", 100, 8, 32, 1 if impl == "1 rank" else 2, "none", impl,
                             step_ms, step_ms, step_ms, 1.0, 1.0, 10,
                             math.nan if impl == "1 rank" else 1e-6, ok)


def test_table_shows_ratio_against_gloo_of_the_same_kind_and_the_check() -> None:
    rows = [_row("1 rank", 5.0), _row("mpitrain", 8.0), _row("ddp", 10.0),
            _row("ddp-mpitrain", 4.0), _row("fsdp", 30.0), _row("fsdp-mpitrain", 20.0, ok=False)]
    rows[2] = train.TrainResult(*[math.nan if f == "difference" else getattr(rows[2], f)
                                  for f in train.TrainResult.__dataclass_fields__])
    lines = train.table_rows(rows)
    assert len(lines) == 6 and all(len(line) == len(lines[0]) for line in lines)
    assert "N/A" in lines[0] and lines[0].rstrip().endswith("-")
    assert " 1.25 " in lines[1] and lines[1].rstrip().endswith("OK")
    assert " 1.00 " in lines[2] and lines[2].split()[-2:] == ["N/A", "-"]  # the baseline
    assert " 2.50 " in lines[3]  # DDP over gloo 10 ms over 4 ms
    assert " 1.50 " in lines[5] and lines[5].rstrip().endswith("FAILED")  # FSDP 30 over 20
    assert len(train.table_header()[0]) == len(lines[0])


def test_cpu_line_says_where_each_implementations_cpu_went() -> None:
    rows = [train.TrainResult(*[getattr(_row(impl, 10.0), f) for f in
                                train.TrainResult.__dataclass_fields__][:-3], cpu, other)
            for impl, cpu, other in (("1 rank", 9.5, 0.04), ("ddp", 14.25, 4.5))]
    assert train.cpu_line(rows) == (
        "# CPU/step      mlp : 1 rank 9.5 ms (0.0 off the training thread); "
        "ddp 14.2 ms (4.5 off the training thread)")
    assert math.isnan(_row("ddp", 1.0).cpu_ms)  # results written before it have none


def test_thread_bound_is_the_gloo_step_over_the_training_threads_cpu() -> None:
    def row(impl: str, step_ms: float, thread_ms: float) -> train.TrainResult:
        base = _row(impl, step_ms)
        return train.TrainResult(*[getattr(base, f) for f in
                                   train.TrainResult.__dataclass_fields__][:-3],
                                 thread_ms + 5.0, 5.0, thread_ms)
    rows = [row("no comm", 8.0, 7.5), row("ddp", 12.0, 9.0), row("ddp-mpitrain", 10.0, 8.0),
            row("mpitrain", 9.0, 6.0), row("fsdp", 20.0, 10.0), row("fsdp-mpitrain", 15.0, 12.5)]
    # not the baselines nor gloo's own rows; each against the gloo step of its kind
    assert report.thread_bounds([asdict(r) for r in rows], 2) == {"mlp": {
        "ddp-mpitrain": 1.5, "mpitrain": 2.0, "fsdp-mpitrain": 1.6}}
    assert train.bound_line(rows, 2) == (
        "# Bound          mlp : gloo/impl at most ddp-mpitrain 1.50, mpitrain 2.00, "
        "fsdp-mpitrain 1.60 (the gloo step over the training thread's CPU per step)")
    # no gloo row, or rows written before the training thread was timed: no bound
    assert train.bound_line([r for r in rows if r.impl not in ("ddp", "fsdp")], 2) is None
    assert report.thread_bounds([asdict(_row("ddp", 12.0)), asdict(_row("mpitrain", 9.0))],
                                2) == {}
    old_file = [{k: v for k, v in asdict(r).items() if k != "train_cpu_ms"} for r in rows]
    assert report.thread_bounds(old_file, 2) == {}
    # two ranks on one core: a training thread has half a core, its CPU bounds nothing
    assert report.thread_bounds([asdict(r) for r in rows], 1) == {}
    assert train.bound_line(rows, 1) is None


def test_verification_lines_count_failures_of_every_checked_implementation() -> None:
    good = train.verification_lines([_row("mpitrain", 1.0), _row("ddp", 1.0),
                                     _row("ddp-mpitrain", 1.0)], 1e-4)
    assert good[-1] == "# Mismatched trainings : 0 OK" and len(good) == 3  # not the baseline
    assert "|ddp-mpitrain - ddp|" in good[1]
    bad = train.verification_lines([_row("mpitrain", 1.0, ok=False), _row("1 rank", 1.0),
                                    _row("no comm", 1.0),
                                    _row("fsdp-mpitrain", 1.0, ok=False)], 1e-4, "reference")
    assert bad[-1] == "# Mismatched trainings : 2 FAILED" and "FAILED" in bad[0]
    assert "|fsdp-mpitrain - reference|" in bad[1]


@pytest.mark.parametrize("extra", [["--model", "resnet"], ["--steps", "0"], ["--batch", "0"],
                                   ["--rounds", "0"], ["--warmup", "-1"], ["--impl", "horovod"],
                                   ["--impl", "mpitrain", "--against", "ddp"],
                                   ["--device", "cuda", "--impl", "mpitrain,fsdp"]])
def test_bad_options_exit_with_usage(extra: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train.parse_args(extra, quiet=True)
    assert exc.value.code == 2


def test_options_default_to_both_models_without_compression() -> None:
    opts = train.parse_args([])
    assert opts.models == ["mlp", "convnet"] and opts.compression == "none"
    assert train.parse_args(["--fp16", "--model", "convnet"]).compression == "fp16"


def test_command_line_reproduces_how_the_ranks_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import common

    for name in common.YIELD_MCA:
        monkeypatch.delenv(f"OMPI_MCA_{name}", raising=False)
    monkeypatch.delenv("MPITRAIN_CHECK", raising=False)
    monkeypatch.setattr(common.os, "cpu_count", lambda: 2)
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    # pinned, busy-polling (plain mpirun where the ranks fit the cores)
    monkeypatch.setattr(common, "bound_to_cores", lambda: True)
    assert common.command_line(["train"], 2) == " ".join(
        ["mpirun", *root, "--mca osc ^ucx -np 2 python -m benchmarks train"])
    assert common.idle_wait() == "busy-poll"
    # unpinned and yielding because the ranks outnumber the cores: what mpitrain-run does
    monkeypatch.setattr(common, "bound_to_cores", lambda: False)
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", "1")
    monkeypatch.setenv("OMPI_MCA_threads_pthreads_yield_strategy", "nanosleep")
    monkeypatch.setenv("MPITRAIN_RESTART", "0")
    assert common.command_line(["train"], 4) == "mpitrain-run -np 4 python -m benchmarks train"
    assert common.idle_wait() == "yield"
    # unpinned and yielding although the ranks fit: mpirun with every flag
    assert common.command_line(["train"], 2) == " ".join(
        ["mpirun", *root, "--bind-to none --mca mpi_yield_when_idle 1 --mca "
         "threads_pthreads_yield_strategy nanosleep --mca osc ^ucx -np 2 python -m "
         "benchmarks train"])


def test_the_report_bounds_ddp_over_impl_by_the_step_without_communication() -> None:
    """With free communication a step takes the ``no comm`` step (every rank training at
    once), not the one-rank step: DDP's step over it is the highest gloo/impl, and the
    report says so under the table."""
    from benchmarks import report

    def doc(rows: list[tuple[str, float]]) -> dict[str, Any]:
        return {"machine": {"ranks": 2, "cpus": 2, "idle_wait": "busy-poll"}, "command": "c",
                "settings": {"compression": "none", "batch": 32, "rounds": 3, "steps": 10},
                "results": [{"model": "m", "impl": i, "step_ms": t, "params": 1e6,
                             "tensors": 4, "samples_per_s": 1.0, "scaling": 1.0,
                             "difference": math.nan, "ok": True} for i, t in rows]}

    full = doc([("1 rank", 10.0), ("no comm", 20.0), ("mpitrain", 24.0), ("ddp", 30.0)])
    assert report.scaling_bounds(full) == {"m": 1.5}
    assert report.scaling_bounds(doc([("1 rank", 10.0), ("ddp", 30.0)])) == {}
    assert report.scaling_bounds(doc([("no comm", 10.0), ("mpitrain", 30.0)])) == {}
    lines = report.train_tables([report.Run("train", 2, "", "train-np2.json", full)])
    assert any(line.startswith("Highest `gloo/impl` of DDP") and line.endswith(": m 1.50.")
               for line in lines), lines
    no_comm = next(line for line in lines if line.startswith("| m | ") and "no comm" in line)
    assert no_comm.split(" | ")[6:] == ["-", "-", "- |"]


def test_device_implementation_and_reference_options() -> None:
    cpu = train.parse_args(["--small"], quiet=True)
    assert (cpu.device, cpu.against, cpu.impls) == ("cpu", "ddp", ("1 rank", "no comm",
                                                                   *train.DEFAULT_IMPLS))
    assert cpu.baseline == "ddp" and cpu.over_gloo and cpu.over_backend
    cuda = train.parse_args(["--device", "cuda"], quiet=True)
    assert (cuda.against, cuda.impls) == ("reference", ("1 rank", "no comm", "mpitrain"))
    assert cuda.baseline is None and not cuda.over_gloo and not cuda.over_backend
    ours = train.parse_args(["--device", "cuda", "--impl", "ddp-mpitrain,fsdp-mpitrain"],
                            quiet=True)
    assert ours.impls == ("1 rank", "no comm", "ddp-mpitrain", "fsdp-mpitrain")
    assert ours.over_backend
    picked = train.parse_args(["--impl", "fsdp,fsdp-mpitrain"], quiet=True)
    assert (picked.against, picked.over_gloo) == ("reference", True)
    assert cuda.tolerance == train.GPU_TOLERANCE["none"] > cpu.tolerance
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cuda", "--against", "ddp"], quiet=True)


def test_reference_averages_every_ranks_gradient() -> None:
    """One step of the reference equals SGD on the mean of the ranks' gradients."""
    torch.manual_seed(3)
    model = train.build_model("mlp", True)
    opts = train.parse_args(["--small", "--momentum", "0"], quiet=True)
    batches = {(r, 0): train.make_batch("mlp", True, 4, 1, r, 0) for r in range(3)}
    grads = []
    for r in range(3):
        clone = train.copy.deepcopy(model)
        torch.nn.functional.cross_entropy(clone(batches[r, 0][0]), batches[r, 0][1]).backward()
        grads.append([p.grad for p in clone.parameters()])
    want = [p.detach() - opts.lr * sum(g[i] for g in grads) / 3
            for i, p in enumerate(model.parameters())]
    got = train.reference_parameters(model, opts, 1, lambda r, s: batches[r, s], 3)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6)


def test_the_report_table_takes_each_ratio_against_gloo_of_the_same_kind() -> None:
    from benchmarks import report

    steps = [("1 rank", 10.0), ("mpitrain", 8.0), ("ddp", 12.0), ("ddp-mpitrain", 6.0),
             ("fsdp", 40.0), ("fsdp-mpitrain", 20.0)]
    doc = {"machine": {"ranks": 2, "cpus": 2, "idle_wait": "busy-poll"}, "command": "c",
           "settings": {"compression": "none", "batch": 32, "rounds": 3, "steps": 10},
           "results": [{"model": "mlp", "impl": i, "step_ms": t, "params": 1e6, "tensors": 4,
                        "samples_per_s": 1.0, "scaling": 1.0,
                        "difference": math.nan if i in ("1 rank", "ddp") else 1e-6,
                        "ok": True} for i, t in steps]}
    lines = report.train_tables([report.Run("train", 2, "", "train-np2.json", doc)])
    rows = {line.split(" | ")[2]: line.split(" | ") for line in lines
            if line.startswith("| mlp ")}
    assert rows["ddp-mpitrain"][6] == "2.00" and rows["mpitrain"][6] == "1.50"
    assert rows["fsdp-mpitrain"][6] == "2.00" and rows["fsdp"][6] == "1.00"
    assert rows["ddp"][7:] == ["-", "- |"] and rows["1 rank"][6] == "-"
    assert rows["fsdp"][7:] == ["1.0e-06", "OK |"]
