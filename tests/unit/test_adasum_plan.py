"""Adasum's plan without MPI: the levels' slices, the coefficients, the fusion key."""

from __future__ import annotations

import pytest

import mpitrain as mt
from mpitrain.algorithms.adasum import NORM_FLOOR, coefficient, plan_levels
from mpitrain.engine.fusion import fusion_key


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 3, 1001])
def test_levels_pair_ranks_and_cut_slices(size: int, count: int) -> None:
    plans = [plan_levels(r, size, count) for r in range(size)]
    for r, levels in enumerate(plans):
        assert [lv.partner for lv in levels] == [r ^ (1 << k) for k in range(len(levels))]
        for k, lv in enumerate(levels):
            partner = plans[lv.partner][k]
            # partners split the same slice: each keeps what the other gives
            assert (partner.keep, partner.give) == (lv.give, lv.keep)
            assert lv.left != partner.left and lv.left == (r & (1 << k) == 0)
            assert lv.group_masks == tuple(1 << j for j in range(k + 1))
    # after the last level the slices of all ranks tile the buffer
    finals = sorted(levels[-1].keep for levels in plans) if size > 1 else [(0, count)]
    assert finals[0][0] == 0 and finals[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(finals, finals[1:]))


def test_coefficients() -> None:
    assert coefficient(0.0, 4.0) == 1.0  # orthogonal: a plain sum
    assert coefficient(4.0, 4.0) == 0.5  # equal vectors: their mean
    assert coefficient(1.0, NORM_FLOOR / 2) == 1.0  # (nearly) zero vector: Horovod's floor
    assert coefficient(1e-40, 1e-40) == 0.5  # equal vectors of tiny elements: still their mean


def test_adasum_is_never_fused_and_parses() -> None:
    assert fusion_key("numpy", "float32", mt.Adasum.value, 1.0, 1.0, None) == ""
    assert fusion_key("numpy", "float32", mt.Sum.value, 1.0, 1.0, None) != ""
    assert mt.ReduceOp("adasum") is mt.Adasum
