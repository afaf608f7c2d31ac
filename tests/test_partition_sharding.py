"""The pieces each device holds under a layout (the index convention of partition/layout.py),
written out by hand for a 2 x 2 mesh."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_ext.partition.layout import REP
from tvm_ext.partition.sharding import coordinates, level_stride, shard, shards, unshard

MESH = [2, 2]
X = np.arange(8)


def test_coordinates_level_one_most_significant():
    assert [coordinates(w, MESH) for w in range(4)] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert coordinates(5, [3, 2]) == [2, 1]
    assert [level_stride(MESH, lvl) for lvl in range(2)] == [2, 1]


@pytest.mark.parametrize("layout, pieces", [
    ([0, 0], [[0, 1], [2, 3], [4, 5], [6, 7]]),  # cut at both levels: contiguous blocks
    ([0, REP], [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2),
    ([REP, 0], [[0, 1, 4, 5], [2, 3, 6, 7]] * 2),  # cut at the inner level only: strided
    ([REP, REP], [list(range(8))] * 4),
])
def test_pieces(layout, pieces):
    assert [list(p) for p in shards(X, MESH, layout)] == pieces
    np.testing.assert_array_equal(unshard(shards(X, MESH, layout), MESH, layout, X.shape), X)


def test_two_axes_and_errors():
    y = np.arange(16).reshape(4, 4)
    # worker 1 = (0, 1): columns of block 0 (level 1); rows whose level-2 digit is 1: 1 and 3.
    np.testing.assert_array_equal(shard(y, MESH, [1, 0], 1), [[4, 5], [12, 13]])
    with pytest.raises(ValueError, match="levels"):
        shard(y, MESH, [0], 0)
    with pytest.raises(ValueError, match="does not divide"):
        shard(np.arange(6), MESH, [0, 0], 0)
