"""Pieces: element ranges of separate arrays read and written as one flat buffer."""

from __future__ import annotations

import numpy as np
import pytest

from mpitrain.algorithms.pieces import Pieces, read_range, write_range
from mpitrain.backends import NUMPY

LAYOUTS = {
    "uneven": [3, 1, 4, 1, 5],
    "empty pieces": [0, 2, 0, 0, 3, 0],
    "one piece": [7],
    "none": [],
}


def _pieces(sizes: list[int], strided: bool) -> tuple[Pieces, list[np.ndarray], np.ndarray]:
    """Pieces over arrays holding 0, 1, 2, ... in buffer order (strided views if asked),
    the arrays' holders, and the flat reference."""
    flat = np.arange(sum(sizes), dtype=np.float64)
    holders, arrays, start = [], [], 0
    for n in sizes:
        holder = np.full(2 * n, -1.0)
        holder[::2] = flat[start:start + n]
        holders.append(holder)
        arrays.append(holder[::2] if strided else holder[::2].copy())
        start += n
    return Pieces(NUMPY, arrays), holders, flat


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_range_reads_and_writes_like_a_flat_array(layout: str, strided: bool) -> None:
    sizes = LAYOUTS[layout]
    for lo in range(sum(sizes) + 1):
        for hi in range(lo, sum(sizes) + 1):
            pieces, holders, flat = _pieces(sizes, strided)
            got = np.empty(hi - lo)
            pieces.read(lo, hi, got)
            np.testing.assert_array_equal(got, flat[lo:hi], err_msg=f"read {lo}:{hi}")
            pieces.write(lo, hi, -flat[lo:hi] - 100)
            expected = flat.copy()
            expected[lo:hi] = -flat[lo:hi] - 100
            back = np.concatenate([a for a in pieces.arrays]) if pieces.arrays else flat[:0]
            np.testing.assert_array_equal(back, expected, err_msg=f"write {lo}:{hi}")
            if strided:  # the gaps between a strided view's elements stay untouched
                assert all((h[1::2] == -1).all() for h in holders)


def test_parts_keep_whole_pieces_and_slice_only_the_ends() -> None:
    arrays = [np.zeros(4), np.zeros(3), np.zeros(5)]
    pieces = Pieces(NUMPY, arrays)
    assert pieces.size == 12 and pieces.parts(5, 5) == []
    inner = pieces.parts(0, 12)
    assert [p is a for p, a in zip(inner, arrays)] == [True, True, True]
    parts = pieces.parts(2, 9)
    assert [p.size for p in parts] == [2, 3, 2] and parts[1] is arrays[1]
    assert np.shares_memory(parts[0], arrays[0]) and np.shares_memory(parts[2], arrays[2])


def test_ranges_of_plain_arrays_and_pieces_alike() -> None:
    flat = np.arange(10.0)
    pieces = Pieces(NUMPY, [flat[:4].copy(), flat[4:].copy()])
    for src in (flat, pieces):
        dst = np.empty(5)
        read_range(NUMPY, src, 2, 7, dst)
        np.testing.assert_array_equal(dst, flat[2:7])
    out = np.zeros(10)
    write_range(NUMPY, out, 3, 6, np.ones(3))
    write_range(NUMPY, pieces, 3, 6, np.ones(3))
    np.testing.assert_array_equal(out[3:6], 1)
    np.testing.assert_array_equal(np.concatenate(pieces.arrays)[2:7], [2, 1, 1, 1, 6])


@pytest.mark.parametrize("count", [0, 1, 4])
def test_numpy_pack_and_unpack(count: int) -> None:
    parts = [np.arange(i, 2 * i + 1, dtype=np.int32) for i in range(count)]
    buf = np.full(sum(p.size for p in parts), -1, np.int32)
    NUMPY.pack_into(buf, parts)
    expected = np.concatenate(parts) if parts else buf[:0]
    np.testing.assert_array_equal(buf, expected)
    back = [np.zeros_like(p) for p in parts]
    NUMPY.unpack_from(buf, back)
    for p, b in zip(parts, back):
        np.testing.assert_array_equal(b, p)


def test_overlapping_pieces_are_told_apart() -> None:
    x = np.zeros(100)
    cases = {
        "disjoint slices": ([x[:10], x[10:20], np.zeros(3)], False),
        "overlapping slices": ([x[:10], x[5:20]], True),
        "one array twice": ([x, np.zeros(2), x], True),
        "interleaved strided views (conservatively)": ([x[::2], x[1::2]], True),
        "strided and reversed views apart": ([x[:50:2], x[60:70], x[::-3][:5]], False),
        "an empty piece inside another's range": ([x[:10], x[5:5]], False),
        "a view inside a strided one": ([x[::10], x[31:33]], True),
    }
    for what, (arrays, expected) in cases.items():
        assert Pieces(NUMPY, arrays).overlapping() is expected, what
