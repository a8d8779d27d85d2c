"""Chunk and segment planning shared by the ring algorithms.

A buffer of ``count`` elements is cut into ``n`` *chunks* (one per rank, as
``np.array_split`` cuts rows), and each chunk into ``segments`` *segments* that are
the unit of pipelining: the ring forwards segment ``k`` of a chunk as soon as it is
reduced, while segment ``k + 1`` is still on the wire.
"""

from __future__ import annotations

Bounds = tuple[int, int]


def split_bounds(total: int, parts: int, unit: int = 1) -> list[Bounds]:
    """Cut ``total`` elements into ``parts`` ranges the way ``np.array_split`` cuts rows.

    ``unit`` is the number of elements in one row: ranges never split a row. The first
    ``rows % parts`` ranges get one row more.

    >>> split_bounds(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    if parts <= 0:
        raise ValueError(f"parts must be >= 1, got {parts}")
    rows = total // unit if unit else 0
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + (base + (1 if i < extra else 0)) * unit
        bounds.append((start, stop))
        start = stop
    return bounds


def bounds_from_counts(counts: list[int]) -> list[Bounds]:
    """Consecutive ranges of the given lengths."""
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


MAX_SEGMENTS = 256
"""The most segments a chunk is cut into, whatever the segment size asked for: every
segment is a message, and the ring has about a chunk's worth of them in flight between
neighbours. Thousands of small messages in flight between ranks of one node stall
Open MPI 5 now and then: a rank waits past its stall timeout (30 and 60 s in the runs)
for a segment its neighbour has sent (docs/reliability.md, "Tiny segments on large
buffers"). Larger chunks get larger
segments instead; 256 keeps the 60 KiB inter-node segments of :mod:`.hierarchical` for
shards up to 15 MiB."""


def segment_count(max_chunk_elems: int, itemsize: int, segment_bytes: int) -> int:
    """How many segments a chunk of ``max_chunk_elems`` elements is cut into: segments
    of ``segment_bytes`` (at least one element), but at most :data:`MAX_SEGMENTS`."""
    if max_chunk_elems == 0 or segment_bytes <= 0:
        return 1
    seg_elems = max(1, segment_bytes // itemsize)
    return max(1, min(MAX_SEGMENTS, -(-max_chunk_elems // seg_elems)))


def segment_bounds(chunk: Bounds, segments: int) -> list[Bounds]:
    """Absolute element ranges of the ``segments`` segments of ``chunk``."""
    start, stop = chunk
    return [(start + lo, start + hi) for lo, hi in split_bounds(stop - start, segments)]


def default_segment_bytes(nbytes: int, size: int) -> int:
    """Pipeline segment size for a message of ``nbytes`` on ``size`` ranks.

    Small chunks are sent whole (a segment costs a few microseconds of Python and MPI
    overhead); large ones are cut into segments of at most 1 MiB so that the
    reduction of one segment overlaps the transfer of the next.
    """
    chunk = nbytes // max(size, 1)
    if chunk <= 256 << 10:
        return 0
    return min(1 << 20, max(128 << 10, chunk // 8))
