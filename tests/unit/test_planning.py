"""Planning code and argument parsing, without launching MPI jobs."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import mpitrain as mt
from mpitrain import config
from mpitrain.algorithms.chunks import (
    MAX_SEGMENTS,
    bounds_from_counts,
    default_segment_bytes,
    segment_bounds,
    segment_count,
    split_bounds,
)
from mpitrain.dispatch import selection
from mpitrain.dtypes import SUPPORTED_DTYPES, check_dtype, check_op_for_dtype, dtype_code
from mpitrain.ops import ReduceOp, parse_op


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 10, 1001])
@pytest.mark.parametrize("unit", [1, 3])
def test_split_bounds_matches_array_split(parts: int, rows: int, unit: int) -> None:
    data = np.arange(rows * unit).reshape(rows, unit)
    blocks = np.array_split(data, parts)
    bounds = split_bounds(rows * unit, parts, unit)
    assert len(bounds) == parts
    for (lo, hi), block in zip(bounds, blocks):
        assert np.array_equal(data.reshape(-1)[lo:hi], block.reshape(-1))


def test_segments_cover_chunk_exactly() -> None:
    for chunk in [(0, 0), (5, 6), (10, 1011)]:
        for k in [1, 2, 7]:
            segs = segment_bounds(chunk, k)
            assert len(segs) == k
            assert segs[0][0] == chunk[0] and segs[-1][1] == chunk[1]
            assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    assert segment_count(0, 4, 100) == 1
    assert segment_count(1000, 4, 0) == 1
    assert segment_count(1000, 4, 400) == 10
    assert segment_count(1001, 4, 400) == 11
    assert bounds_from_counts([2, 0, 3]) == [(0, 2), (2, 2), (2, 5)]


def test_segment_sizes_at_their_edges() -> None:
    """Segments smaller than an element hold one element; a chunk that is an exact
    multiple of the segment has no short last segment; and however small the segments
    asked for, a chunk has at most MAX_SEGMENTS of them (each a message in flight)."""
    assert segment_count(10, 16, 1) == 10  # complex128 in 1-byte segments: one each
    assert segment_count(10, 16, 15) == 10
    assert segment_count(10, 16, 16) == 10
    assert segment_count(10, 16, 17) == 10
    assert segment_count(10, 16, 32) == 5
    assert segment_count(10, 16, 33) == 5
    assert segment_count(MAX_SEGMENTS * 4, 4, 16) == MAX_SEGMENTS  # exact multiple
    assert segment_count(MAX_SEGMENTS * 4 + 1, 4, 16) == MAX_SEGMENTS
    assert segment_count(1_000_000, 4, 64) == MAX_SEGMENTS  # not 62,500
    for count in (MAX_SEGMENTS - 1, MAX_SEGMENTS, MAX_SEGMENTS + 1, 100_003):
        k = segment_count(count, 8, 1)
        segs = segment_bounds((7, 7 + count), k)
        assert len(segs) == min(count, MAX_SEGMENTS)
        assert segs[0][0] == 7 and segs[-1][1] == 7 + count
        assert all(hi - lo >= count // k for lo, hi in segs)


def test_default_segment_bytes() -> None:
    assert default_segment_bytes(1024, 4) == 0
    assert default_segment_bytes(64 << 20, 2) == 1 << 20
    assert 128 << 10 <= default_segment_bytes(4 << 20, 4) <= 1 << 20


def test_parse_op() -> None:
    assert parse_op("SUM") is mt.Sum and parse_op("average") is mt.Average
    assert parse_op("prod") is mt.Product and parse_op(mt.Max) is mt.Max
    assert mt.Average.reduction is ReduceOp.SUM and mt.Min.reduction is ReduceOp.MIN
    with pytest.raises(ValueError, match="unknown reduction op"):
        parse_op("median")
    with pytest.raises(ValueError):
        parse_op(3)  # type: ignore[arg-type]


def test_dtypes_table() -> None:
    names = {str(d) for d in SUPPORTED_DTYPES}
    assert {"float16", "bfloat16", "float32", "int8", "uint64", "complex128"} <= names
    assert len({dtype_code(d) for d in SUPPORTED_DTYPES}) == len(SUPPORTED_DTYPES)
    with pytest.raises(TypeError, match="rank 3: dtype bool"):
        check_dtype(bool, rank=3)
    with pytest.raises(TypeError):
        check_dtype("U3")
    with pytest.raises(TypeError, match="undefined for complex"):
        check_op_for_dtype(mt.Min, np.dtype("complex64"))


def test_config_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPITRAIN_SEGMENT_BYTES", raising=False)
    assert config.SEGMENT_BYTES.get() == 0
    monkeypatch.setenv("MPITRAIN_SEGMENT_BYTES", "64K")
    assert config.SEGMENT_BYTES.get() == 65536
    assert config.SEGMENT_BYTES.get(override=5) == 5
    monkeypatch.setenv("MPITRAIN_SEGMENT_BYTES", "lots")
    with pytest.raises(ValueError, match="MPITRAIN_SEGMENT_BYTES='lots'"):
        config.SEGMENT_BYTES.get()
    assert config.parse_size("1MiB") == 1 << 20 and config.parse_size("2g") == 2 << 30
    assert config.parse_bool("on") and not config.parse_bool("0")
    monkeypatch.delenv("MPITRAIN_SEGMENT_BYTES")
    assert "MPITRAIN_ALGORITHM" in config.describe()


def test_selection_table(tmp_path: pytest.TempPathFactory) -> None:
    avail = ("ring", "mpi")
    built_in = selection.Table.load("")
    assert built_in.rules == selection.DEFAULT_RULES
    assert built_in.select("allreduce", 4, 2, "numpy", avail) == "mpi"
    assert built_in.select("allreduce", 64 << 20, 2, "numpy", avail) == "ring"
    assert built_in.select("allreduce", 4, 2, "numpy", ("ring",)) == "ring"
    path = tmp_path / "tune.json"  # type: ignore[operator]
    selection.dump_rules([selection.Rule("allreduce", "ring", max_bytes=1 << 10)], str(path))
    tuned = selection.Table.load(str(path))
    assert tuned.select("allreduce", 4, 2, "numpy", avail) == "ring"
    assert tuned.select("allreduce", 4096, 2, "numpy", avail) == "mpi"
    bad = tmp_path / "bad.json"  # type: ignore[operator]
    bad.write_text(json.dumps({"rules": [{"nope": 1}]}))
    with pytest.raises(ValueError, match="regenerate it with mpitrain-tune"):
        selection.Table.load(str(bad))


def test_one_node_table() -> None:
    """On one node: shm, except native Allgather from 16 MiB gathered; and which
    algorithms the table may ever pick (the allgather fast path asks)."""
    table = selection.BUILT_IN
    every = ("ring", "mpi", "shm", "single_copy")
    mib = 1 << 20
    assert table.select("allreduce", 256 * mib, 2, "numpy", every) == "shm"
    assert table.select("reduce_scatter", 256 * mib, 2, "numpy", every) == "shm"
    assert table.select("allgather", 16 * mib - 4, 2, "numpy", every) == "shm"
    assert table.select("allgather", 16 * mib, 2, "numpy", every) == "mpi"
    assert table.may_select("allgather", "shm")
    assert not table.may_select("allgather", "single_copy")
    assert not table.may_select("allgather", "bruck")


def test_error_hierarchy() -> None:
    for cls in (mt.ArgumentError, mt.DtypeError, mt.MismatchError, mt.StallError,
                mt.NotInitializedError):
        assert issubclass(cls, mt.MpitrainError)
    assert issubclass(mt.ArgumentError, ValueError) and issubclass(mt.DtypeError, TypeError)
    assert issubclass(mt.MismatchError, RuntimeError)


def test_not_initialized_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpitrain import session

    monkeypatch.setattr(session, "_default", None)
    # a program without the Horovod adapter (other tests here import it: then the
    # message names hvd.init(), tests/unit/test_not_initialized.py)
    monkeypatch.delitem(sys.modules, "mpitrain.torch", raising=False)
    with pytest.raises(mt.NotInitializedError, match=r"call mpitrain\.init"):
        mt.rank()
    assert not mt.is_initialized()


def test_selection_by_node_count() -> None:
    table = selection.BUILT_IN
    avail = ("ring", "mpi", "hierarchical")
    for nbytes in (4, 1 << 20, 64 << 20):  # one node: the single-node table, unchanged
        assert table.select("allreduce", nbytes, 4, "numpy", avail, nodes=1) == \
            table.select("allreduce", nbytes, 4, "numpy", ("ring", "mpi"))
    assert table.select("allreduce", 64 << 20, 4, "numpy", avail, nodes=2) == "hierarchical"
    assert table.select("allreduce", 4, 4, "numpy", avail, nodes=2) == "mpi"
    rule = selection.Rule("allreduce", "hierarchical", min_nodes=3)
    assert not rule.matches("allreduce", 1, 6, "numpy", nodes=2)
    assert rule.matches("allreduce", 1, 6, "numpy", nodes=3)


def test_inter_node_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpitrain.algorithms.hierarchical import inter_segment_bytes

    monkeypatch.delenv("MPITRAIN_INTER_SEGMENT_BYTES", raising=False)
    limit = config.Settings.from_environment().inter_segment_bytes
    assert limit == 60 << 10
    assert inter_segment_bytes(0, limit) == 60 << 10     # whole chunks: capped for TCP eager
    assert inter_segment_bytes(1 << 20, limit) == 60 << 10
    assert inter_segment_bytes(24, limit) == 24         # a smaller general setting wins
    monkeypatch.setenv("MPITRAIN_INTER_SEGMENT_BYTES", "0")
    limit = config.Settings.from_environment().inter_segment_bytes
    assert inter_segment_bytes(1 << 20, limit) == 1 << 20
    monkeypatch.setenv("MPITRAIN_INTER_SEGMENT_BYTES", "1M")
    limit = config.Settings.from_environment().inter_segment_bytes
    assert inter_segment_bytes(0, limit) == 1 << 20


def test_allreduce_piece_count() -> None:
    from mpitrain.algorithms.hierarchical import MAX_PIECES, PIECE_BYTES, piece_count

    assert piece_count(0) == piece_count(PIECE_BYTES - 1) == 1
    assert piece_count(2 * PIECE_BYTES) == 2
    assert piece_count(1 << 40) == MAX_PIECES
