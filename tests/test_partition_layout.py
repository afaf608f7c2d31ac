"""Per-level conversions and their bytes on a device mesh (closed forms)."""

from __future__ import annotations

import pytest

from tvm_ext.cost import LINKS
from tvm_ext.partition.layout import (
    PARTIAL,
    REP,
    Req,
    conversion_kind,
    edge_steps,
    factorize,
    local_shape,
)

B = 64 * 1024  # bytes of a (64, 256) float32 tensor
SHAPE = (64, 256)


def sent(mesh, src, dst):
    steps = edge_steps(B, SHAPE, mesh, [LINKS["nvlink"]] * len(mesh), src, dst)
    return sum(s.bytes for s in steps), steps


def test_conversion_table():
    assert conversion_kind(REP, 0) == "slice"
    assert conversion_kind(0, REP) == "allgather"
    assert conversion_kind(0, 1) == "all_to_all"
    assert conversion_kind(0, 0) is None
    assert conversion_kind(0, 0, halo=2) == "halo"
    assert conversion_kind(PARTIAL, REP) == "allreduce"
    assert conversion_kind(PARTIAL, 1) == "reduce_scatter"


@pytest.mark.parametrize("mesh", [[2], [3], [2, 2], [2, 2, 2], [3, 2]])
def test_multi_level_collectives_equal_flat_rings(mesh):
    k = 1
    for p in mesh:
        k *= p
    rep = [Req(REP)] * len(mesh)
    assert sent(mesh, [0] * len(mesh), rep)[0] == pytest.approx((k - 1) / k * B)
    assert sent(mesh, [PARTIAL] * len(mesh), [0] * len(mesh))[0] == pytest.approx(
        (k - 1) / k * B)
    assert sent(mesh, [PARTIAL] * len(mesh), [REP] * len(mesh))[0] == pytest.approx(
        2 * (k - 1) / k * B)
    assert sent(mesh, [REP] * len(mesh), [Req(0)] * len(mesh))[0] == 0.0


def test_other_levels_shrink_the_group_data():
    # Allgather at level 1 of a tensor that stays cut on axis 1 at level 2: half the data.
    total, (step,) = sent([2, 2], [0, 1], [Req(REP), Req(1)])
    assert step.level == 0 and step.group_bytes == B / 2 and total == B / 4
    # Allgathers run deepest first, so the outer one moves the bigger piece.
    _, steps = sent([2, 2], [0, 0], [Req(REP), Req(REP)])
    assert [(s.level, s.bytes) for s in steps] == [(0, B / 2), (1, B / 4)]


def test_halo_bytes():
    # Rows of 256 floats; one halo row each side, 2 devices on one level.
    total, (step,) = sent([2], [0], [Req(0, 1, 1)])
    assert step.kind == "halo" and total == 2 * 256 * 4


def test_local_shape_and_factorize():
    assert local_shape((64, 256), [2, 2, 2], [0, 1, 0]) == (16, 128)
    assert factorize(8) == [2, 2, 2]
    assert factorize(12) == [3, 2, 2]
    assert factorize(5) == [5]
    assert factorize(1) == []
    with pytest.raises(ValueError, match="at least 1"):
        factorize(0)
