"""Fusion bucket planning and the timeline writer, without launching MPI jobs."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import mpitrain as mt
from benchmarks import harness
from mpitrain import config
from mpitrain.algorithms.pieces import Pieces, read_range, write_range
from mpitrain.backends import NUMPY
from mpitrain.dispatch import Call
from mpitrain.engine.fusion import BucketRunner, fusion_key, plan_buckets
from mpitrain.engine.request import Entry, Request, Spec, Waiters
from mpitrain.timeline import Timeline


def request(name: str, *arrays: Any, kind: str = "allreduce", op: mt.ReduceOp = mt.Sum,
            grouped: bool = False, algorithm: str = "auto") -> Request:
    dtype = arrays[0].dtype
    key = fusion_key("numpy", dtype, op.value, 1.0, 1.0, algorithm) \
        if kind == "allreduce" and not grouped else ""
    call = Call(kind, NUMPY, dtype, arrays[0].shape, op=op, algorithm=algorithm)
    spec = Spec(kind, "sig", call, grouped=grouped, fusion=key)
    if grouped:
        return Request(name, spec, None, None, Waiters(),
                       entries=[Entry(a, NUMPY, a.dtype) for a in arrays])
    return Request(name, spec, arrays[0], None, Waiters())


def names(buckets: list[Any]) -> list[list[str]]:
    return [[r.name for r, _ in b.items] for b in buckets]


def test_buckets_fill_up_to_the_threshold_per_key() -> None:
    kib = np.zeros(256, np.float32)  # 1 KiB
    reqs = [request(f"f{i}", kib) for i in range(5)]
    reqs.insert(2, request("d", np.zeros(8, np.float64)))
    reqs.insert(3, request("max", kib, op=mt.Max))
    assert names(plan_buckets(reqs, 2048)) == [["f0", "f1"], ["d"], ["max"], ["f2", "f3"],
                                               ["f4"]]
    assert names(plan_buckets(reqs, 64 << 20)) == [["f0", "f1", "f2", "f3", "f4"], ["d"],
                                                   ["max"]]


def test_large_entries_other_kinds_and_threshold_zero_run_alone() -> None:
    big, small = np.zeros(1024, np.uint8), np.zeros(4, np.uint8)
    reqs = [request("s0", small), request("big", big), request("s1", small),
            request("g", small, kind="allgather"), request("s2", small),
            request("ring", small, algorithm="ring")]
    assert names(plan_buckets(reqs, 1024)) == [["s0", "s1", "s2"], ["big"], ["g"], ["ring"]]
    assert len(plan_buckets(reqs, 0)) == len(reqs)


def test_groups_stay_together_whatever_their_size() -> None:
    group = request("grp", np.zeros(1000, np.float32), np.zeros(3, np.int8),
                    np.zeros(1000, np.float32), grouped=True)
    buckets = plan_buckets([request("x", np.zeros(2, np.float32)), group], 16)
    assert [[e.array.size for _, e in b.items] for b in buckets] == [[2], [1000, 1000], [3]]


def shared_spec_requests(n: int, count: int = 256, inplace: bool = False) -> list[Request]:
    """``n`` submissions of one spec, as the engine makes them for equal arrays."""
    dtype = np.dtype(np.float32)
    call = Call("allreduce", NUMPY, dtype, (count,), mt.Sum, inplace=inplace)
    spec = Spec("allreduce", "sig", call, fusion=fusion_key("numpy", dtype, "sum", 1.0, 1.0,
                                                             None))
    return [Request(f"t{i}", spec, np.full(count, i, dtype), None, Waiters())
            for i in range(n)]


@pytest.mark.parametrize("threshold, expected", [
    (64 << 20, [5]), (5 * 1024, [5]), (5 * 1024 - 1, [4, 1]), (2048, [2, 2, 1]),
    (1024, [1, 1, 1, 1, 1]), (1023, [1, 1, 1, 1, 1]), (0, [1, 1, 1, 1, 1])])
def test_requests_of_one_spec_fill_buckets_like_any_others(threshold: int,
                                                           expected: list[int]) -> None:
    reqs = shared_spec_requests(5)  # 1 KiB each
    buckets = plan_buckets(reqs, threshold)
    assert [len(b.items) for b in buckets] == expected
    assert [r for b in buckets for r, _ in b.items] == reqs  # in order, each once
    assert all(e is r for b in buckets for r, e in b.items)  # a request is its own entry
    assert all(b.spec is reqs[0].spec and b.nbytes == 1024 * len(b.items) for b in buckets)


def test_bucket_spec_is_kept_only_when_every_item_shares_it() -> None:
    same = shared_spec_requests(3)
    other = request("other", np.zeros(256, np.float32))  # same fusion key, another spec
    other.spec.fusion = same[0].spec.fusion
    mixed = plan_buckets([*same[:2], other, same[2]], 64 << 20)
    assert len(mixed) == 1 and mixed[0].spec is None
    group = request("grp", np.zeros(4, np.float32), np.zeros(4, np.float32), grouped=True)
    assert plan_buckets([group], 64 << 20)[0].spec is None  # entries of a group: no spec


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_bucket_hands_each_request_its_own_piece(inplace: bool, pieces: bool) -> None:
    class Doubling:  # a stand-in dispatcher: the "reduction" doubles the buffer
        def takes_pieces(self, *args: Any) -> bool:
            return pieces

        def allreduce_flat(self, be: Any, src: Any, out: Any, *args: Any) -> str:
            if not pieces:
                assert src is out  # the fusion buffer is reduced in place
                out *= 2
                return "test"
            # the arrays themselves; in place the output is them, else a new buffer
            assert isinstance(src, Pieces) and (out is src) == inplace
            data = np.empty(src.size, src.arrays[0].dtype)
            read_range(be, src, 0, src.size, data)
            write_range(be, out, 0, src.size, data * 2)
            return "test"

    reqs = shared_spec_requests(4, count=3, inplace=inplace)
    arrays = [r.array for r in reqs]
    if inplace:
        for r in reqs:
            r.output = r.array
    for general in (False, True):  # the rows of one reshape, and the offsets path
        bucket = plan_buckets(reqs, 64 << 20)[0]
        if general:
            bucket.spec = None
        BucketRunner(Doubling()).run(bucket)  # type: ignore[arg-type]
        for i, r in enumerate(reqs):
            assert np.array_equal(r.output, np.full(3, i * (4 if inplace and general else 2)))
            assert (r.output is arrays[i]) == inplace
            assert r.started_at is not None


def test_timeline_file_is_valid_json_after_every_flush(tmp_path: Any) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    assert isinstance(json.loads(path.read_text()), list)
    t = tl._origin
    for i in range(3):
        tl.span(7, "engine 7", f"grad/{i}", "QUEUE", t + i, t + i + 0.5, {"bytes": 4})
        tl.span(7, "engine 7", f"grad/{i}", "ALLREDUCE(ring)", t + i + 0.5, t + i + 1)
        tl.flush()
        events = json.loads(path.read_text())
        spans = [e for e in events if e["ph"] == "X"]
        assert len(spans) == 2 * (i + 1)
    tl.close()
    events = json.loads(path.read_text())
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {"grad/0", "grad/1", "grad/2"}
    queue = next(e for e in events if e["name"] == "QUEUE" and e["ts"] > 1e6)
    assert queue["dur"] == pytest.approx(0.5e6) and queue["pid"] == 7


def test_engine_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.Settings.from_environment().fusion_threshold == 64 << 20
    monkeypatch.setenv("MPITRAIN_FUSION_THRESHOLD", "1M")
    monkeypatch.setenv("MPITRAIN_CYCLE_TIME_MS", "0.25")
    settings = config.Settings.from_environment()
    assert (settings.fusion_threshold, settings.cycle_time_ms) == (1 << 20, 0.25)
    monkeypatch.setenv("MPITRAIN_CYCLE_TIME_MS", "soon")
    with pytest.raises(ValueError, match="MPITRAIN_CYCLE_TIME_MS='soon'"):
        config.Settings.from_environment()


def test_fusion_benchmark_verifies_and_writes_json(tmp_path: Any,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.__main__ import main  # python -m benchmarks: dispatches "fusion"

    out = tmp_path / "fusion.json"
    assert main(["fusion", "-b", "1K", "-e", "2K", "-t", "7", "-n", "2", "-w", "1",
                 "-d", "int32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fused/one" in text and "Out of bounds values : 0 OK" in text
    rows = json.loads(out.read_text())["results"]
    assert [(r["size"], r["mode"], r["wrong"]) for r in rows] == [
        (1024, "out-of-place", 0), (1024, "in-place", 0), (2048, "out-of-place", 0),
        (2048, "in-place", 0)]
    assert all(r["collectives_per_fused_call"] >= 1 for r in rows)
    with pytest.raises(SystemExit) as exited:  # the harness itself knows no fusion case
        harness.parse_args(["fusion"], nranks=1, quiet=True)
    assert exited.value.code == 2


@pytest.mark.parametrize("op", ["sum", "prod"])
def test_fusion_benchmark_verifies_prescaled_calls(tmp_path: Any, op: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """With --prescale every call scales its input first; the expected values follow
    (times F, or F**n for prod), so a call that dropped the factor would count wrong."""
    from benchmarks.__main__ import main

    out = tmp_path / "fusion.json"
    assert main(["fusion", "-b", "1K", "-e", "1K", "-t", "5", "-n", "2", "-w", "1",
                 "-o", op, "--prescale", "0.25", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prescale_factor=0.25" in text and "Out of bounds values : 0 OK" in text
    saved = json.loads(out.read_text())
    assert saved["settings"]["prescale"] == 0.25
    assert [r["wrong"] for r in saved["results"]] == [0, 0]


@pytest.mark.parametrize("args", [["--prescale", "0.3"], ["--prescale", "-0.5"],
                                  ["--prescale", "0.5", "-d", "int32"]])
def test_fusion_benchmark_refuses_an_inexact_prescale(args: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import fusion

    with pytest.raises(SystemExit) as exited:
        fusion.parse_args(args)
    assert exited.value.code == 2
    assert "power of two" in capsys.readouterr().err
