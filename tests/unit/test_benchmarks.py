"""The benchmark harness without launching MPI: sizes, hooks, crafted data, verification.

The in-process runs use a one-rank communicator (the singleton COMM_WORLD or
COMM_SELF); the harness at 2 and more ranks is exercised under mpirun.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from benchmarks import common, fusion, harness
from benchmarks.collectives import COLLECTIVES
from benchmarks.hooks import Array, Call, Case, crafted, no_reset, reduced
from mpitrain.algorithms import ALGORITHMS
from mpitrain.dtypes import BFLOAT16

RANKS = [1, 2, 3, 4, 5]
DTYPES = [np.dtype(name) for name in ("float32", "float16", "float64", "int8", "uint8",
                                      "int32", "uint64", "complex64")]
if BFLOAT16 is not None:
    DTYPES.append(BFLOAT16)
OPS = ["sum", "prod", "min", "max", "avg"]
BUS_FACTORS = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def ops_for(name: str, dtype: np.dtype[Any]) -> list[str]:
    """The ops a collective takes for a dtype (none for non-reducing ones)."""
    if not COLLECTIVES[name].reduces:
        return ["none"]
    return [op for op in OPS if not (dtype.kind == "c" and op in ("min", "max"))]


def make_case(name: str, count: int, dtype: np.dtype[Any], op: str, rank: int,
              nranks: int) -> Case:
    root = nranks - 1 if COLLECTIVES[name].rooted else -1
    return Case(count, dtype, op, root, rank, nranks)


# -- sizes ----------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "value"), [
    ("8", 8), ("1K", 1024), ("64M", 64 << 20), ("1G", 1 << 30), ("1k", 1024), ("2KB", 2048),
    (" 16 ", 16), ("0", 0),
])
def test_parse_size(text: str, value: int) -> None:
    assert common.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "M", "1.5K", "-8", "8T", "1 K", "K1"])
def test_parse_size_rejects_what_is_not_a_byte_count(text: str) -> None:
    with pytest.raises(ValueError, match="not a byte count"):
        common.parse_size(text)


@pytest.mark.parametrize("text", ["8", "1K", "64M", "1536", "3K", "1G", "1000"])
def test_format_size_spells_sizes_back(text: str) -> None:
    assert common.format_size(common.parse_size(text)) == text


def test_size_series_doubles_from_min_to_max_inclusive() -> None:
    sizes = common.size_series(8, 64 << 20, 2)
    assert sizes[0] == 8 and sizes[-1] == 64 << 20 and len(sizes) == 24
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize(("minbytes", "maxbytes", "factor", "expected"), [
    (8, 1 << 20, 8, [8, 64, 512, 4096, 32768, 262144]),
    (8, 1 << 20, 4, [8 * 4**k for k in range(9)]),
    (5, 5, 2, [5]),
    (3, 10, 3, [3, 9]),
])
def test_size_series_stops_at_the_last_size_not_above_max(
        minbytes: int, maxbytes: int, factor: int, expected: list[int]) -> None:
    assert common.size_series(minbytes, maxbytes, factor) == expected


@pytest.mark.parametrize(("minbytes", "maxbytes", "factor"), [(0, 8, 2), (16, 8, 2), (8, 64, 1)])
def test_size_series_rejects_bad_ranges(minbytes: int, maxbytes: int, factor: int) -> None:
    with pytest.raises(ValueError, match="stepfactor"):
        common.size_series(minbytes, maxbytes, factor)


# -- hooks: bus factors, counts -------------------------------------------------------
@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_bus_factor_is_nccl_tests(name: str, nranks: int) -> None:
    assert COLLECTIVES[name].bus_factor(nranks) == pytest.approx(BUS_FACTORS[name](nranks))


def test_bus_factor_values() -> None:
    assert COLLECTIVES["allreduce"].bus_factor(1) == 0
    assert COLLECTIVES["allreduce"].bus_factor(4) == 1.5
    assert COLLECTIVES["reduce_scatter"].bus_factor(5) == pytest.approx(0.8)
    assert COLLECTIVES["allgather"].bus_factor(2) == 0.5
    assert COLLECTIVES["broadcast"].bus_factor(3) == 1


@pytest.mark.parametrize(("name", "nbytes", "itemsize", "nranks", "count", "size"), [
    ("allreduce", 100, 4, 3, 25, 100),
    ("allreduce", 10, 4, 3, 2, 8),
    ("allreduce", 2, 4, 1, 0, 0),
    ("broadcast", 7, 2, 4, 3, 6),
    ("reduce_scatter", 100, 4, 3, 8, 96),   # 25 elements -> 24 = 3 blocks of 8
    ("reduce_scatter", 64, 2, 5, 6, 60),
    ("reduce_scatter", 8, 4, 3, 0, 0),      # 2 elements cannot give 3 ranks one each
    ("reduce_scatter", 8, 4, 1, 2, 8),
    ("allgather", 100, 4, 3, 8, 96),
    ("allgather", 1 << 20, 8, 5, 26214, 1048560),
])
def test_count_rounds_down_and_size_is_the_real_byte_count(
        name: str, nbytes: int, itemsize: int, nranks: int, count: int, size: int) -> None:
    coll = COLLECTIVES[name]
    assert coll.count(nbytes, itemsize, nranks) == count
    assert coll.size(count, itemsize, nranks) == size
    assert size <= nbytes


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("name", ["reduce_scatter", "allgather"])
def test_block_collectives_round_to_whole_blocks(name: str, nranks: int) -> None:
    coll = COLLECTIVES[name]
    for nbytes in common.size_series(8, 1 << 16, 2):
        for itemsize in (1, 2, 4, 8):
            count = coll.count(nbytes, itemsize, nranks)
            size = coll.size(count, itemsize, nranks)
            assert size % (nranks * itemsize) == 0
            assert nbytes - size < nranks * itemsize


# -- crafted data and expected results ------------------------------------------------
def brute_force(name: str, case: Case) -> Array:
    """The result of one rank, from every rank's whole input, with plain numpy."""
    coll = COLLECTIVES[name]
    inputs = [coll.make_input(dataclasses.replace(case, rank=r)) for r in range(case.nranks)]
    if name == "allgather":
        return np.concatenate(inputs)
    if name == "broadcast":
        return inputs[case.root]
    stacked, dt = np.stack(inputs), case.dtype
    if case.op in ("sum", "avg"):
        total = np.sum(stacked, axis=0, dtype=dt)
        if case.op == "avg" and dt.kind in "iu":
            total = total // case.nranks
        elif case.op == "avg":
            total = (total * (1.0 / case.nranks)).astype(dt)
    elif case.op == "prod":
        total = np.prod(stacked, axis=0, dtype=dt)
    else:
        total = stacked.min(axis=0) if case.op == "min" else stacked.max(axis=0)
    if name == "reduce_scatter":
        return np.array_split(total, case.nranks)[case.rank]
    return total


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_expected_matches_brute_force(name: str, dtype: np.dtype[Any]) -> None:
    for op in ops_for(name, dtype):
        for nranks in RANKS:
            for count in (1, 7, 100):
                for rank in range(nranks):
                    case = make_case(name, count, dtype, op, rank, nranks)
                    got = COLLECTIVES[name].expected(case)
                    want = brute_force(name, case)
                    assert got.dtype == dtype, (op, nranks, count, rank)
                    np.testing.assert_array_equal(got, want, err_msg=f"{op} n={nranks} "
                                                  f"count={count} rank={rank}")


@pytest.mark.parametrize("dtype", [np.dtype("float16"), np.dtype("float32"), BFLOAT16],
                         ids=str)
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_crafted_reductions_are_exact_in_low_precision(dtype: np.dtype[Any], op: str) -> None:
    for nranks in RANKS:
        exact = np.ones(4096, np.int64) if op == "prod" else np.zeros(4096, np.int64)
        for r in range(nranks):
            values = crafted(r, 0, 4096, np.dtype(np.int64), op)
            exact = exact * values if op == "prod" else exact + values
        got = reduced(nranks, 0, 4096, dtype, op)
        np.testing.assert_array_equal(got.astype(np.float64), exact.astype(np.float64))


def test_crafted_values_are_small_and_signed_only_where_the_type_is() -> None:
    signed = crafted(3, 100, 5000, np.dtype("int8"), "sum")
    unsigned = crafted(3, 100, 5000, np.dtype("uint8"), "sum")
    assert set(np.unique(signed)) == set(range(-4, 5))
    assert set(np.unique(unsigned)) == set(range(9))
    assert set(np.unique(crafted(0, 0, 5000, np.dtype("int32"), "prod"))) == {-1, 1, 2}
    assert set(np.unique(crafted(0, 0, 5000, np.dtype("uint32"), "prod"))) == {1, 2}


def test_crafted_values_catch_a_misplaced_block_or_rank() -> None:
    dt = np.dtype("float32")
    base = crafted(1, 0, 9000, dt, "sum")
    for shift in (1, 3, 9, 64):  # a block written `shift` elements off
        moved = crafted(1, shift, 9000, dt, "sum")
        assert np.count_nonzero(base != moved) > 0.8 * base.size
    for other in (0, 2, 10):     # a block from the wrong rank
        assert np.count_nonzero(base != crafted(other, 0, 9000, dt, "sum")) > 0.8 * base.size


# -- verification ---------------------------------------------------------------------
def test_count_wrong_counts_every_wrong_element() -> None:
    coll = COLLECTIVES["allreduce"]
    case = make_case("allreduce", 50, np.dtype("float32"), "sum", 1, 3)
    expected = coll.expected(case)

    def three_wrong() -> Array:
        result = expected.copy()
        result[[0, 7, 49]] += 1
        return result

    assert common.count_wrong(Call(three_wrong, no_reset), expected) == 3
    assert common.count_wrong(Call(expected.copy, no_reset), expected) == 0


def test_count_wrong_catches_a_rank_that_did_not_reduce() -> None:
    coll = COLLECTIVES["allreduce"]
    case = make_case("allreduce", 1000, np.dtype("int32"), "sum", 0, 3)
    data, expected = coll.make_input(case), coll.expected(case)
    wrong = common.count_wrong(Call(lambda: data, no_reset), expected)
    assert wrong == np.count_nonzero(data != expected) > 800


def test_count_wrong_counts_a_wrong_shape_or_dtype_as_wholly_wrong() -> None:
    expected = np.arange(10, dtype=np.float32)
    assert common.count_wrong(Call(lambda: expected[:-1], no_reset), expected) == 10
    assert common.count_wrong(Call(lambda: expected.astype(np.float64), no_reset),
                              expected) == 10


def test_count_wrong_resets_before_running() -> None:
    expected = np.arange(4, dtype=np.int32)
    buf = np.zeros(4, dtype=np.int32)
    call = Call(lambda: buf, lambda: np.copyto(buf, expected))
    assert common.count_wrong(call, expected) == 0


# -- one-rank runs of every hook ------------------------------------------------------
@pytest.fixture(scope="module")
def self_comms() -> Any:
    """An mpitrain communicator and a plain duplicate over COMM_SELF."""
    comm, world = mt.Communicator(MPI.COMM_SELF), MPI.COMM_SELF.Dup()
    yield comm, world
    comm.free()
    world.Free()


def options(collective: str, *extra: str) -> harness.Options:
    return harness.parse_args([collective, "-b", "8", "-e", "4K", "-f", "8", "-n", "2",
                               "-w", "1", *extra], nranks=1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "uint64"])
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_measure_verifies_every_impl_and_variant_on_one_rank(
        self_comms: Any, name: str, dtype: str) -> None:
    comm, world = self_comms
    opts = options(name, "-d", dtype, "-o", "avg", "--algorithm",
                   ",".join(("auto", *ALGORITHMS[name])))
    case = Case(100, opts.dtype, opts.op, opts.root, 0, 1)
    results = harness.measure(opts, case, comm, world)
    keys = {r.key for r in results}
    for impl in opts.impls:  # broadcast takes no out=: its plain call is its only one
        assert ((impl.label, False) in keys) != (impl.allocates and name == "broadcast")
    assert ("mpi", True) in keys and not any(k[0].endswith("[alloc]") and k[1] for k in keys)
    assert all(r.wrong == 0 for r in results), results
    assert all(r.time_min_us <= r.time_us <= r.time_max_us for r in results)


def wrong_allreduce(comm: mt.Communicator, algorithm: str, case: Case, data: Array,
                    inplace: bool, allocates: bool) -> Call:
    """mpitrain's allreduce with one element off by one: what a buggy algorithm returns."""

    def run() -> Array:
        result = comm.allreduce(data, op=case.op, algorithm=algorithm)
        result[case.count // 2] += 1
        return result

    return Call(run, no_reset)


def test_main_counts_a_wrong_mpitrain_result_and_fails(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(COLLECTIVES, "allreduce",
                        dataclasses.replace(COLLECTIVES["allreduce"], mpitrain=wrong_allreduce))
    assert harness.main(["allreduce", "-b", "8", "-e", "64", "-f", "2", "-n", "2", "-w", "0",
                         "--outputs", "given"]) == 1
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert len(rows) == 4  # 8, 16, 32, 64 bytes
    # columns: 5 fixed, then per variant: mpitrain (5), mpi (5), ratio
    assert [(row[8], row[13], row[19], row[24]) for row in rows] == [("1", "0", "1", "0")] * 4
    assert "# Out of bounds values : 8 FAILED" in out


def test_main_prints_table_and_writes_json_and_plot(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    json_path, plot_path = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["broadcast", "-b", "8", "-e", "1K", "-f", "4", "-n", "3", "-w", "1", "-d", "half",
            "--json", str(json_path), "--plot", str(plot_path)]
    assert harness.main(argv) == 0
    out = capsys.readouterr().out
    # a lone unpinned rank, as mpitrain-run starts it
    assert f"mpitrain-run -np 1 python -m benchmarks {' '.join(argv)}\n" in out
    assert "# Out of bounds values : 0 OK" in out
    doc = json.loads(json_path.read_text())
    assert doc["command"].endswith(" ".join(argv))
    assert len(doc["results"]) == 4 * 2 * 2  # sizes x impls x variants
    first = doc["results"][0]
    assert {"size", "count", "dtype", "op", "impl", "time_us", "time_min_us", "time_max_us",
            "algbw", "busbw", "wrong"} <= set(first)
    assert first["dtype"] == "float16" and first["op"] == "none" and first["root"] == 0
    assert plot_path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "allgather"])
def test_the_alloc_column_times_the_plain_call(
        name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``[alloc]`` calls the collective without ``out=`` (it allocates its result, as a
    user's call does), the other column with a preallocated one; the summary prints the
    cost of allocating at the smallest and the largest size."""
    seen: list[bool] = []
    call = getattr(mt.Communicator, name)

    def spy(self: mt.Communicator, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("out") is not None)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(mt.Communicator, name, spy)
    assert harness.main([name, "-b", "64", "-e", "1M", "-f", "128", "-n", "2", "-w", "0",
                         "--no-inplace", "--impl", "mpitrain"]) == 0
    assert True in seen and False in seen
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "mpitrain[alloc]" in line)
    assert header.split()[1:] == ["mpitrain", "mpitrain[alloc]"]
    assert re.search(r"# Allocating the result : [+-][\d.]+ us at 64 B .*; [+-][\d.]+ us at "
                     r"1048576 B", out), out


# -- options and table ----------------------------------------------------------------
def test_algorithms_expand_into_mpitrain_columns() -> None:
    labels = [i.label for i in options("allreduce", "--algorithm", "ring,mpi").impls]
    assert labels == ["mpitrain:ring", "mpitrain:mpi", "mpitrain:ring[alloc]",
                      "mpitrain:mpi[alloc]", "mpi"]
    assert [i.label for i in options("allreduce").impls] == ["mpitrain", "mpitrain[alloc]", "mpi"]
    assert [i.label for i in options("allreduce", "--outputs", "given").impls] == \
        ["mpitrain", "mpi"]
    assert [i.label for i in options("allreduce", "--impl", "mpi").impls] == ["mpi"]
    assert options("allreduce", "--no-inplace").variants == [False]


@pytest.mark.parametrize("extra", [
    ["--algorithm", "ring"],       # broadcast offers no ring
    ["-r", "1"],                   # one rank: root 1 does not exist
    ["--impl", "nccl"],
    ["-b", "1M", "-e", "1K"],
    ["--outputs", "given,fresh"],
])
def test_bad_options_exit_with_usage(extra: list[str]) -> None:
    with pytest.raises(SystemExit):
        harness.parse_args(["broadcast", *extra], nranks=1, quiet=True)


def test_min_of_complex_is_refused() -> None:
    with pytest.raises(SystemExit):
        harness.parse_args(["allreduce", "-d", "complex64", "-o", "min"], nranks=1, quiet=True)


@pytest.mark.parametrize(("argv", "status"), [(["-h"], 0), (["--bogus"], 2), (["-n", "x"], 2)])
@pytest.mark.parametrize("quiet", [True, False])
def test_one_rank_parser_prints_on_rank_0_only_and_exits_on_every_rank(
        argv: list[str], status: int, quiet: bool, capsys: pytest.CaptureFixture[str]) -> None:
    parser = common.OneRankParser(quiet, prog="bench")
    parser.add_argument("-n", type=int, default=1)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(argv)
    assert exited.value.code == status
    out, err = capsys.readouterr()
    if quiet:
        assert (out, err) == ("", "")
    elif status == 0:
        assert out.startswith("usage: bench") and err == ""
    else:
        assert out == "" and err.startswith("usage: bench") and "bench: error: " in err


@pytest.mark.parametrize(("parse", "status"), [
    (lambda: harness.parse_args(["allreduce", "-h"], nranks=1, quiet=True), 0),
    (lambda: harness.parse_args(["allreduce", "-n", "0"], nranks=1, quiet=True), 2),
    (lambda: fusion.parse_args(["-h"], quiet=True), 0),
    (lambda: fusion.parse_args(["-t", "0"], quiet=True), 2),
])
def test_benchmark_parsers_are_silent_off_rank_0(
        parse: Any, status: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse()
    assert exited.value.code == status
    assert capsys.readouterr() == ("", "")


def test_main_module_sends_fusion_to_its_case_and_the_rest_to_the_harness(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import __main__ as entry

    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(fusion, "main", lambda args: seen.append(("fusion", args)) or 5)
    monkeypatch.setattr(harness, "main", lambda args: seen.append(("harness", args)) or 6)
    assert entry.main(["fusion", "-t", "3"]) == 5
    assert entry.main(["allreduce", "fusion"]) == 6
    monkeypatch.setattr("sys.argv", ["python -m benchmarks", "broadcast", "-n", "2"])
    assert entry.main() == 6
    assert seen == [("fusion", ["-t", "3"]), ("harness", ["allreduce", "fusion"]),
                    ("harness", ["broadcast", "-n", "2"])]


def test_table_row_shows_ratio_and_na() -> None:
    opts = options("reduce_scatter", "--outputs", "given")
    table = harness.Table(opts.impls, opts.variants)

    def result(impl: str, inplace: bool, time_us: float) -> harness.Result:
        return harness.Result(96, 8, "float32", "sum", -1, impl, inplace, time_us, time_us,
                              time_us, 1.0, 0.5, 0)

    line = table.row([result("mpitrain", False, 100.0), result("mpi", False, 250.0),
                      result("mpi", True, 50.0)])
    row = line.split()
    assert row[:5] == ["96", "8", "float32", "sum", "-1"]
    assert row[5] == "100.00" and row[10] == "250.00" and row[15] == "2.50"
    assert row[16:21] == ["N/A"] * 5 and row[-1] == "N/A"
    titles = table.header()[2]
    assert titles.split()[1:] == [c.title for c in table.columns()]
    assert len(line) == len(titles)  # right-aligned under the titles


def test_plot_without_matplotlib_is_refused_before_measuring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank parses the same command line, so every rank refuses it: no hang."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert not harness.installed("matplotlib") and harness.installed("json")
    with pytest.raises(SystemExit) as exit_info:
        harness.parse_args(["allreduce", "--plot", "x.png"], 2, quiet=True)
    assert exit_info.value.code == 2


def test_the_spread_table_has_min_avg_median_max_per_size(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert harness.main(["allreduce", "-b", "8", "-e", "16", "-n", "3", "-w", "0",
                         "--outputs", "given", "--no-inplace"]) == 0
    out = capsys.readouterr().out
    spread = out.split("# Spread of the timed runs (us): min/avg/median/max", 1)[1]
    lines = spread.splitlines()[1:4]
    assert lines[0].split()[-2:] == ["mpitrain", "mpi"]
    for size, line in zip(("8", "16"), lines[1:]):
        cells = line.lstrip("#").split()
        assert cells[0] == size
        for cell in cells[1:]:
            low, mean, median, high = map(float, cell.split("/"))
            assert low <= median <= high and low <= mean <= high


def test_the_per_call_cost_is_only_called_so_at_small_sizes() -> None:
    def result(size: int, impl: str, us: float) -> harness.Result:
        return harness.Result(size, size // 4, "float32", "sum", -1, impl, False, us, us, us,
                              0.0, 0.0, 0)

    small = [result(8, "mpitrain", 30.0), result(8, "mpi", 20.0)]
    assert harness.overhead_lines(small)[0].startswith("# Per-call cost at 8 B : ")
    large = [result(1 << 20, "mpitrain", 900.0), result(1 << 20, "mpi", 1000.0)]
    line = harness.overhead_lines(large)[0]
    assert "Per-call cost" not in line and line.startswith("# Smallest size, 1048576 B : ")


def test_help_names_the_command_and_lists_every_benchmark(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import common

    monkeypatch.setattr(common.sys, "argv", ["/venv/bin/mpitrain-bench", "--help"])
    text = harness.build_parser().format_help()
    assert text.startswith("usage: mpitrain-bench ")
    for other in ("fusion", "train", "latency"):
        assert f"mpitrain-bench {other} -h" in text, text
    monkeypatch.setattr(common.sys, "argv", ["/clone/benchmarks/__main__.py"])
    assert harness.build_parser().format_help().startswith("usage: python -m benchmarks ")


def test_latency_runs_as_a_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import __main__ as entry
    from benchmarks import latency

    seen = []
    monkeypatch.setattr(latency, "main", lambda argv: seen.append(list(argv)) or 0)
    assert entry.main(["latency", "--sizes", "4"]) == 0
    assert seen == [["--sizes", "4"]]


def test_the_training_benchmark_asks_torch_for_huge_pages_unless_told_not_to(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    variable = common.HUGE_PAGES_VARIABLE
    monkeypatch.delenv(variable, raising=False)
    common.ask_for_huge_pages(["--model", "mlp", common.SMALL_PAGES_FLAG])
    assert variable not in common.os.environ
    common.ask_for_huge_pages(["--model", "mlp"])
    assert common.os.environ[variable] == "1"
    monkeypatch.setenv(variable, "0")  # the user's own choice stands
    common.ask_for_huge_pages([])
    assert common.os.environ[variable] == "0"
    mode = tmp_path / "enabled"
    monkeypatch.setattr(common, "THP_MODE_FILE", str(mode))
    mode.write_text("always [madvise] never\n")
    assert common.huge_pages() == "4 KiB pages"
    monkeypatch.setenv(variable, "1")
    assert common.huge_pages() == "huge pages"
    mode.write_text("always madvise [never]\n")
    assert common.huge_pages().startswith("4 KiB pages (transparent huge pages are off")


def test_the_training_benchmarks_entry_sets_huge_pages_before_torch_allocates(
        tmp_path: Any) -> None:
    """What `python -m benchmarks train` does before it imports torch must reach torch:
    a 16 MiB tensor allocated afterwards is on huge pages (where the kernel allows them),
    and not with --small-pages."""
    import os
    import subprocess

    try:
        with open(common.THP_MODE_FILE, encoding="utf-8") as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off in this kernel")
    except OSError:
        pytest.skip("no transparent huge pages here")
    script = (
        "import sys; from benchmarks import common; common.ask_for_huge_pages(sys.argv[1:]); "
        "import torch; t = torch.ones(16 << 20); "
        "print([int(l.split()[1]) for l in open('/proc/self/smaps_rollup') "
        "if l.startswith('AnonHugePages')][0])")
    env = {k: v for k, v in os.environ.items() if k != common.HUGE_PAGES_VARIABLE}

    def huge_kib(*args: str) -> int:
        out = subprocess.run([sys.executable, "-c", script, *args], env=env, check=True,
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1])

    assert huge_kib("--model", "mlp") >= 2048
    with open(common.THP_MODE_FILE, encoding="utf-8") as f:
        if "[always]" not in f.read():
            assert huge_kib(common.SMALL_PAGES_FLAG) == 0


def test_the_entry_asks_for_huge_pages_before_it_imports_the_training_module(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reads the variable at its first allocation, and ``benchmarks.train``
    imports torch: ``python -m benchmarks train`` must set it before that import (a
    stand-in module records the variable as it is imported)."""
    import importlib.abc
    import importlib.machinery
    import types

    import benchmarks
    from benchmarks import __main__ as entry

    variable = common.HUGE_PAGES_VARIABLE
    seen: list[str | None] = []

    class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "benchmarks.train":
                return None
            return importlib.machinery.ModuleSpec(name, self)

        def create_module(self, spec: Any) -> None:
            return None

        def exec_module(self, module: types.ModuleType) -> None:
            seen.append(common.os.environ.get(variable))
            module.main = lambda argv: 0  # type: ignore[attr-defined]

    monkeypatch.delitem(sys.modules, "benchmarks.train", raising=False)
    monkeypatch.delattr(benchmarks, "train", raising=False)
    monkeypatch.setattr(sys, "meta_path", [StandIn(), *sys.meta_path])
    monkeypatch.delenv(variable, raising=False)
    assert entry.main(["train", "--model", "mlp"]) == 0
    assert seen == ["1"]
