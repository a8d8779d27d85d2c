"""Planning of the butterfly, Bruck and shared-memory algorithms, and the validation
signatures, without launching MPI jobs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpitrain.algorithms.butterfly import Fold, halving_steps, virtual_blocks
from mpitrain.algorithms.chunks import split_bounds
from mpitrain.algorithms.shared_memory import Stripes
from mpitrain.comm.validation import mismatch_message, signature

RANKS = range(1, 10)


@pytest.mark.parametrize("n", RANKS)
def test_fold_pairs_and_virtual_ranks(n: int) -> None:
    folds = [Fold(r, n) for r in range(n)]
    p = folds[0].p
    assert p & (p - 1) == 0 and p <= n < 2 * p
    playing = [r for r, f in enumerate(folds) if not f.folded]
    assert [folds[r].vrank for r in playing] == list(range(p))
    for r, f in enumerate(folds):
        assert f.real(f.vrank) == r or f.folded
        if f.folded or f.keeps:
            assert folds[f.partner].partner == r and folds[f.partner].folded != f.folded
        else:
            assert f.partner == -1


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("count", [0, 1, 7, 1001])
def test_halving_ends_on_own_chunks(n: int, count: int) -> None:
    """Each step halves the run held, partners mirror each other, the last run is ours."""
    chunks = split_bounds(count, n)
    steps = {r: halving_steps(Fold(r, n), chunks) for r in range(n) if not Fold(r, n).folded}
    for r, mine in steps.items():
        fold = Fold(r, n)
        whole = (0, count)
        masks = []
        for i, (partner, keep, give) in enumerate(mine):
            assert sorted([keep, give]) == [(whole[0], min(keep[1], give[1])),
                                            (max(keep[0], give[0]), whole[1])]
            assert keep[1] == give[0] or give[1] == keep[0]
            masks.append(Fold(partner, n).vrank ^ fold.vrank)
            _, their_keep, their_give = steps[partner][i]
            assert (their_keep, their_give) == (give, keep)
            whole = keep
        assert masks == [fold.p >> k for k in range(1, len(masks) + 1)]
        own = (chunks[fold.partner][0], chunks[r][1]) if fold.keeps else chunks[r]
        assert whole == own


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("count", [0, 3, 1001])
def test_virtual_blocks_partition_the_buffer(n: int, count: int) -> None:
    fold = Fold(0, n)
    blocks = virtual_blocks(fold, count)
    assert len(blocks) == n
    assert blocks[0][0] == 0 and blocks[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    spans = [fold.span(blocks, v, v + 1) for v in range(fold.p)]
    assert spans == split_bounds(count, fold.p)


@pytest.mark.parametrize("width", [1, 3, 64])
def test_stripes_cover_every_chunk(width: int) -> None:
    chunks = (*split_bounds(1001, 3), (1001, 1001))
    stripes = Stripes(chunks, width)
    for c, (lo, hi) in enumerate(chunks):
        covered = [stripes.bounds(c, j) for j in range(stripes.rounds)]
        assert covered[0][0] == lo and covered[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert all(b - a <= width for a, b in covered)


def test_signature_fingerprint_is_stable_and_field_sensitive() -> None:
    base = dict(collective="allreduce", op="sum", dtype="float32", shape=(1024,), root=-1,
                prescale=1.0, postscale=1.0, name="w", algorithm="ring")
    fp = signature(**base).fingerprint  # type: ignore[arg-type]
    assert 0 < fp < 1 << 63
    for key, other in [("op", "max"), ("dtype", "float64"), ("shape", (1025,)), ("root", 0),
                       ("prescale", 2.0), ("postscale", 0.5), ("name", "b"),
                       ("algorithm", "mpi"), ("collective", "reduce_scatter")]:
        assert signature(**{**base, key: other}).fingerprint != fp, key  # type: ignore[arg-type]
    code = ("from mpitrain.comm.validation import signature; print(signature('allreduce', "
            "'sum', 'float32', (1024,), False, -1, 1.0, 1.0, 'w', 'ring').fingerprint)")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed,
                                  "PYTHONPATH": os.pathsep.join(sys.path)}, check=True)
        assert int(out.stdout) == signature("allreduce", "sum", "float32", (1024,), False, -1,
                                            1.0, 1.0, "w", "ring").fingerprint


def test_mismatch_message_names_ranks_and_values() -> None:
    a = signature("allreduce", "sum", "float32", (1024,), algorithm="shm").fields()
    b = signature("allreduce", "sum", "float64", (1024,), algorithm="shm").fields()
    text = mismatch_message(1, [a, a, b, b])
    assert text.startswith("rank 1: ranks disagree on allreduce's arguments: ")
    assert "ranks 2, 3 sent float64[1024], rank 0 sent float32[1024]" in text
    c = signature("barrier").fields()
    text = mismatch_message(0, [a, c])
    assert "rank 1 called barrier, rank 0 called allreduce" in text and "float" not in text


def test_selection_by_dtype_and_availability(tmp_path: pytest.TempPathFactory) -> None:
    from mpitrain.dispatch import selection

    both = ("ring", "mpi", "shm")
    assert selection.BUILT_IN.select("allreduce", 4, 2, "numpy", both) == "shm"
    assert selection.BUILT_IN.select("allreduce", 4, 2, "numpy", ("ring", "mpi")) == "mpi"
    path = tmp_path / "tune.json"  # type: ignore[operator]
    selection.dump_rules([selection.Rule("allreduce", "ring", dtypes="float16,bfloat16")],
                         str(path))
    tuned = selection.Table.load(str(path))
    assert tuned.select("allreduce", 4, 2, "numpy", both, "float16") == "ring"
    assert tuned.select("allreduce", 4, 2, "numpy", both, "bfloat16") == "ring"
    assert tuned.select("allreduce", 4, 2, "numpy", both, "float32") == "shm"


def test_default_rules_name_registered_algorithms_and_cover_every_size() -> None:
    from mpitrain.algorithms import ALGORITHMS
    from mpitrain.dispatch import selection

    for rule in selection.DEFAULT_RULES:
        assert rule.algorithm in ALGORITHMS[rule.collective], rule
    for collective, names in ALGORITHMS.items():
        without_shm = tuple(a for a in names if a != "shm")
        for nbytes in (0, 4, 1 << 16, 1 << 20, 1 << 30):
            for ranks in (2, 3, 64):
                for available in (names, without_shm):
                    chosen = selection.BUILT_IN.select(collective, nbytes, ranks, "numpy",
                                                       available)
                    assert chosen in available
