"""The host gather/scatter extension and the numpy backend's copies that use it."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np
import pytest

from mpitrain.backends import NUMPY, hostcopy
from mpitrain.dtypes import SUPPORTED_DTYPES

built = pytest.mark.skipif(not hostcopy.compiled(), reason="the _hostcopy extension is not "
                                                           "built (setup.py)")


def _values(lo: int, hi: int, dtype: Any) -> np.ndarray:
    """lo, lo + 1, ... hi - 1 modulo a prime (exact in float16; integers wrap alike)."""
    return (np.arange(lo, hi) % 1021).astype(dtype)


def _parts(sizes: list[int], dtype: Any, start: int = 0) -> list[np.ndarray]:
    """Arrays holding :func:`_values` from ``start`` on, one after the other."""
    parts, at = [], start
    for n in sizes:
        parts.append(_values(at, at + n, dtype))
        at += n
    return parts


@pytest.fixture(params=["extension", "numpy"])
def copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the extension's copies, then with numpy's (extension disabled)."""
    if request.param == "extension":
        if not hostcopy.compiled():
            pytest.skip("the _hostcopy extension is not built")
    else:
        monkeypatch.setattr(hostcopy, "gather", hostcopy._unavailable)
        monkeypatch.setattr(hostcopy, "scatter", hostcopy._unavailable)
    return str(request.param)


SIZES = {"uneven": [3, 1, 4, 1, 5], "empty parts": [0, 2, 0, 3, 0], "many": [2] * 300,
         "large": [40_000, 30_000]}  # many: past the extension's stack of views


@built
@pytest.mark.parametrize("dtype", [str(d) for d in SUPPORTED_DTYPES if str(d) != "bfloat16"])
@pytest.mark.parametrize("layout", list(SIZES))
def test_gather_and_scatter_copy_every_part_in_order(layout: str, dtype: str) -> None:
    sizes = SIZES[layout]
    parts = _parts(sizes, dtype)
    flat = np.zeros(sum(sizes), dtype)
    assert hostcopy.gather(flat, parts) is True
    np.testing.assert_array_equal(flat, _values(0, sum(sizes), dtype))
    flat[...] = _values(7, sum(sizes) + 7, dtype)
    assert hostcopy.scatter(flat, parts) is True
    np.testing.assert_array_equal(np.concatenate(parts) if parts else flat, flat)


@built
def test_parts_of_several_dimensions_copy_in_c_order() -> None:
    parts = [np.arange(6.0).reshape(2, 3), np.arange(6.0, 10.0).reshape(2, 1, 2)]
    flat = np.zeros(10)
    assert hostcopy.gather(flat, parts)
    np.testing.assert_array_equal(flat, np.arange(10.0))
    rows = np.arange(8.0).reshape(2, 4)  # a 2-D source, as the engine's reshaped buffer
    dsts = [np.zeros(4), np.zeros(4)]
    assert hostcopy.scatter(rows, dsts)
    np.testing.assert_array_equal(np.concatenate(dsts), np.arange(8.0))


def _untouched(call: Callable[[], bool], *arrays: np.ndarray) -> None:
    """``call()`` returns False and leaves ``arrays`` as they were."""
    before = [a.copy() for a in arrays]
    assert call() is False
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a, b)


@built
def test_what_cannot_be_copied_byte_for_byte_is_refused_without_copying() -> None:
    parts = _parts([4, 4], np.float32, start=1)
    flat = np.zeros(8, np.float32)
    _untouched(lambda: hostcopy.gather(flat, [parts[0], parts[1][::2]]), flat)  # strided
    _untouched(lambda: hostcopy.gather(flat[::2], parts[:1]), flat)  # strided flat
    _untouched(lambda: hostcopy.gather(flat, [parts[0], parts[1].view(np.int32)]), flat)
    _untouched(lambda: hostcopy.gather(flat, [parts[0], parts[1].astype(np.float64)]), flat)
    _untouched(lambda: hostcopy.gather(flat, parts[:1]), flat)  # too few bytes
    _untouched(lambda: hostcopy.gather(flat[:6], parts), flat)  # too many
    frozen = flat.copy()
    frozen.flags.writeable = False
    _untouched(lambda: hostcopy.gather(frozen, parts), frozen)  # read-only destination
    parts[1].flags.writeable = False
    src = np.arange(8, dtype=np.float32)
    _untouched(lambda: hostcopy.scatter(src, parts), *parts)  # a read-only part
    if "bfloat16" in map(str, SUPPORTED_DTYPES):  # no buffer format: numpy copies it
        import ml_dtypes

        bf = [p.astype(ml_dtypes.bfloat16) for p in _parts([4, 4], np.float32)]
        target = np.zeros(8, ml_dtypes.bfloat16)
        _untouched(lambda: hostcopy.gather(target, bf), target)


@built
def test_misuse_raises() -> None:
    with pytest.raises(TypeError, match="sequence"):
        hostcopy.gather(np.zeros(2), 5)
    with pytest.raises(TypeError):
        hostcopy.scatter(np.zeros(2))


def test_an_extension_built_from_another_source_is_refused() -> None:
    hostcopy.check(hashlib.sha256(hostcopy.SOURCE.read_bytes()).hexdigest())  # this source
    with pytest.raises(ImportError, match=r"_hostcopy extension was built from another "
                                          r"version.*rebuild it \(make"):
        hostcopy.check("0" * 64)


@built
def test_the_built_extension_matches_its_source() -> None:
    assert hostcopy._EXTENSION is not None
    assert hashlib.sha256(hostcopy.SOURCE.read_bytes()).hexdigest() == \
        hostcopy._EXTENSION.SOURCE_SHA256


# -- the numpy backend, with and without the extension ------------------------------

@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("layout", list(SIZES))
def test_backend_pack_and_unpack(copies: str, layout: str, strided: bool) -> None:
    sizes = SIZES[layout]
    holders = [np.full(2 * n, -1.0) for n in sizes]
    parts = [h[::2] if strided else h[:n] for h, n in zip(holders, sizes)]
    for p, v in zip(parts, _parts(sizes, np.float64)):
        p[...] = v
    flat = np.zeros(sum(sizes))
    NUMPY.pack_into(flat, parts)
    np.testing.assert_array_equal(flat, _values(0, sum(sizes), np.float64))
    NUMPY.unpack_from(-flat, parts)
    np.testing.assert_array_equal(np.concatenate(parts) if parts else flat, -flat)
    if strided:  # the gaps between a strided view's elements stay untouched
        assert all((h[1::2] == -1).all() for h in holders)


def test_backend_pack_casts_where_dtypes_differ(copies: str) -> None:
    flat = np.zeros(5, np.float64)
    NUMPY.pack_into(flat, [np.arange(2, dtype=np.float32), np.arange(2, 5, dtype=np.int32)])
    np.testing.assert_array_equal(flat, np.arange(5.0))


@pytest.mark.parametrize("dtype", [str(d) for d in SUPPORTED_DTYPES])
def test_backend_scatter_rows(copies: str, dtype: str) -> None:
    rows = np.arange(12).astype(dtype).reshape(3, 4)
    dsts = [np.zeros(4, dtype) for _ in range(3)]
    NUMPY.scatter(dsts, rows)
    for dst, row in zip(dsts, rows):
        np.testing.assert_array_equal(dst, row)


@built
def test_the_backend_copies_contiguous_parts_through_the_extension(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy backend's copies reach the extension (and it copies) when they can."""
    calls: list[tuple[str, bool]] = []

    def spy(name: str) -> Callable[[Any, Any], bool]:
        real = getattr(hostcopy, name)

        def call(flat: Any, parts: Any) -> bool:
            done = real(flat, parts)
            calls.append((name, done))
            return bool(done)
        return call

    monkeypatch.setattr(hostcopy, "gather", spy("gather"))
    monkeypatch.setattr(hostcopy, "scatter", spy("scatter"))
    parts = _parts([3, 5, 2], np.float32)
    flat = np.zeros(10, np.float32)
    NUMPY.pack_into(flat, parts)
    NUMPY.unpack_from(flat, parts)
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    dsts = [np.zeros(4, np.float32), np.zeros(8, np.float32)[::2]]  # the second strided
    NUMPY.scatter([dsts[0], np.zeros(4, np.float32)], rows)
    NUMPY.scatter(dsts, rows)  # refused by the extension: numpy copies
    np.testing.assert_array_equal(np.concatenate(dsts), rows.ravel())
    assert calls == [("gather", True), ("scatter", True), ("scatter", True), ("scatter", False)]


# -- the shared-memory barrier's counters ----------------------------------------------

@built
def test_counters_publish_arrive_and_compare() -> None:
    """Two ranks' views of one buffer: a rank alone is told to wait (-1) with its
    counter and fingerprint stored where the window's layout has them; the second
    rank then finds both arrived, and a different fingerprint gives 0."""
    words = np.zeros(3 * 2, np.int64)
    first, second = hostcopy.counters(words, 0, 2), hostcopy.counters(words, 1, 2)
    assert first.agree(1, 7, 0) == -1
    # counters [0, n), then parity 0's fingerprints [n, 2n), parity 1's [2n, 3n)
    assert words.tolist() == [1, 0, 0, 0, 7, 0]
    assert second.agree(1, 7, 0) == 1
    assert first.agree(1, 7, 100) == 1  # the barrier passed: it agrees too
    assert second.agree(2, -5, 0) == -1
    assert words.tolist() == [1, 2, 0, -5, 7, 7]
    assert first.agree(2, 2**62, 0) == 0
    assert second.agree(2, -5, 0) == 0


@built
def test_counters_refuse_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="3 \\* size"):
        hostcopy.counters(np.zeros(5, np.int64), 0, 2)
    with pytest.raises(ValueError, match="rank 2, size 2"):
        hostcopy.counters(np.zeros(6, np.int64), 2, 2)
    readonly = np.zeros(6, np.int64)
    readonly.flags.writeable = False
    with pytest.raises((BufferError, TypeError, ValueError)):
        hostcopy.counters(readonly, 0, 2)
    counters = hostcopy.counters(np.zeros(6, np.int64), 0, 2)
    with pytest.raises(TypeError, match="3 arguments"):
        counters.agree(1, 2)
    with pytest.raises(TypeError):
        counters.agree(1, "fingerprint", 0)


def test_counters_absent_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcopy, "_EXTENSION", None)
    assert hostcopy.counters(np.zeros(6, np.int64), 0, 2) is None


class _Masks:
    """A communicator whose allgather returns given affinity masks."""

    def __init__(self, masks: list[list[int]]) -> None:
        self.masks = masks

    def allgather(self, mine: list[int]) -> list[list[int]]:
        return self.masks


@pytest.mark.parametrize("masks,cores", [
    ([[0], [1]], 2),              # mpirun -np 2: each rank bound to its own core
    ([[0, 1], [0, 1]], 2),        # --bind-to none on 2 cores
    ([[0], [0]], 1),              # two ranks bound to one core
    ([[0, 1], [0, 1], [0, 1], [0, 1]], 2),
    ([[0, 1], [2, 3], [1, 2]], 4),
])
def test_node_cores_is_the_union_of_the_ranks_masks(masks: list[list[int]], cores: int) -> None:
    from mpitrain.comm.shm import node_cores
    assert node_cores(_Masks(masks)) == cores  # type: ignore[arg-type]


# -- the async engine's doorbell --------------------------------------------------------

def _doorbells() -> list[Any]:
    kinds = [pytest.param(hostcopy._Doorbell, id="python")]
    if hostcopy.compiled():
        kinds.append(pytest.param(lambda: hostcopy.doorbell(), id="extension"))
    return kinds


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", _doorbells())
def test_doorbell_rings_times_out_and_remembers_an_early_ring(make: Callable[[], Any]) -> None:
    """A sleep without a ring times out (False, after the timeout); a ring before the
    sleep makes it return at once (no lost wake-up); a ring from another thread wakes a
    sleep without a limit."""
    import threading
    import time

    bell = make()
    began = time.monotonic()
    assert bell.sleep(0.05, 0.0) is False
    assert time.monotonic() - began >= 0.045
    bell.ring(False)
    began = time.monotonic()
    assert bell.sleep(5.0, 1.0) is True  # no settling: that ring did not ask for it
    assert time.monotonic() - began < 0.5
    timer = threading.Timer(0.05, bell.ring, (False,))
    timer.start()
    assert bell.sleep(-1.0, 0.0) is True
    timer.join()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", _doorbells())
def test_doorbell_settles_and_sleeps_on_when_the_work_was_taken(
        make: Callable[[], Any]) -> None:
    """Woken by rings that all asked to settle, the sleeper waits settle_s; if all the
    work rung for was taken by then, it sleeps on (here: until its timeout, False), also
    through more such rings whose work is taken too; work rung for and not taken sends it
    to look; a ring that did not ask to settle wakes it at once, after one that did."""
    import threading
    import time

    bell = make()
    bell.ring(True)
    began = time.monotonic()
    assert bell.sleep(5.0, 0.1) is True  # settled, nothing taken: go and look
    assert 0.09 <= time.monotonic() - began < 2.0

    bell.ring(True)
    taker = threading.Timer(0.02, bell.taken)
    taker.start()
    began = time.monotonic()
    assert bell.sleep(0.5, 0.1) is False  # taken while settling: slept on to the timeout
    assert time.monotonic() - began >= 0.45
    taker.join()

    def submit_and_take() -> None:  # a caller that runs each submission at once
        for _ in range(5):
            bell.ring(True)
            bell.taken()
            time.sleep(0.03)

    bell.ring(True)
    bell.taken()
    caller = threading.Thread(target=submit_and_take)
    caller.start()
    assert bell.sleep(0.6, 0.05) is False  # every submission taken: never came back
    caller.join()

    bell.ring(True)
    again = threading.Timer(0.02, lambda: (bell.taken(), bell.ring(True)))
    again.start()
    assert bell.sleep(5.0, 0.1) is True  # work came after the take and stayed: look
    again.join()

    bell.ring(True)
    bell.ring(False)
    began = time.monotonic()
    assert bell.sleep(5.0, 1.0) is True
    assert time.monotonic() - began < 0.5  # one ring did not ask to settle
    bell.ring(True)
    bell.taken()
    assert bell.sleep(0.3, 0.05) is False  # that urgency was used up by the last wake


def test_doorbell_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcopy, "_EXTENSION", None)
    assert isinstance(hostcopy.doorbell(), hostcopy._Doorbell)
