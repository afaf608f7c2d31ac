"""The mesh collectives of partitioned modules (src/ccl/ccl_mesh.cc, cpu backend) against the index
convention of tvm_ext.partition.sharding: on a 2 x 2 mesh, every layout of a 3-d tensor, every
level, every conversion."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tvm_ffi import Shape

from tvm_ext.partition.layout import REP, local_shape
from tvm_ext.partition.sharding import coordinates, level_stride, shards, unshard
from tvm_ext.runtime import distributed as dist

MESH = [2, 2]
X = np.random.default_rng(0).standard_normal((4, 8, 4)).astype("float32")
LAYOUTS = list(itertools.product([REP, 0, 1, 2], repeat=2))


def _outer(cur, level, axis) -> int:
    """A (ccl_mesh.h): the levels above `level` that do not cut `axis`."""
    return int(np.prod([MESH[m] for m in range(level) if cur[m] != axis]))


@pytest.fixture(scope="module")
def sess():
    with dist.Session(4) as s:
        yield s


def _run(sess, op, pieces, args, out_shape, dtype="float32"):
    d = sess.per_worker(pieces)
    out = sess.empty(out_shape, dtype)
    sess.call("tvm_ext.ccl." + op, d, Shape(args), out)
    sess.check(op)
    return sess.worker_values(out)


def _assert_pieces(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conversions_at_each_level(sess, layout):
    for lvl in range(2):
        group = [level_stride(MESH, lvl), MESH[lvl]]
        a = layout[lvl]
        pieces = shards(X, MESH, layout)
        if a >= 0:
            dst = list(layout)
            dst[lvl] = REP
            got = _run(sess, "mesh_allgather", pieces, [*group, a, _outer(layout, lvl, a)],
                       local_shape(X.shape, MESH, dst))
            _assert_pieces(got, shards(X, MESH, dst))
            for b in {0, 1, 2} - {a}:
                dst[lvl] = b
                args = [*group, a, _outer(layout, lvl, a), b, _outer(layout, lvl, b)]
                got = _run(sess, "mesh_all_to_all", pieces, args,
                           local_shape(X.shape, MESH, dst))
                _assert_pieces(got, shards(X, MESH, dst))
            continue
        # Replicated at this level: slices; partial sums (worker's part times c_l + 1).
        partial = [p * (coordinates(w, MESH)[lvl] + 1) for w, p in enumerate(pieces)]
        got = _run(sess, "mesh_allreduce", partial, [*group, 0], pieces[0].shape)
        _assert_pieces(got, shards(X * 3, MESH, layout))
        for b in range(3):
            dst = list(layout)
            dst[lvl] = b
            shape = local_shape(X.shape, MESH, dst)
            got = _run(sess, "mesh_slice", pieces, [*group, b, _outer(layout, lvl, b)], shape)
            _assert_pieces(got, shards(X, MESH, dst))
            got = _run(sess, "mesh_reduce_scatter", partial,
                       [*group, 0, b, _outer(layout, lvl, b)], shape)
            _assert_pieces(got, shards(X * 3, MESH, dst))
    np.testing.assert_array_equal(unshard(shards(X, MESH, layout), MESH, layout, X.shape), X)


def test_max_and_integer_reductions(sess):
    ints = [np.full((3, 2), w, "int32") for w in range(4)]
    got = _run(sess, "mesh_allreduce", ints, [1, 2, 3], (3, 2), "int32")  # max, inner level
    assert [int(g[0, 0]) for g in got] == [1, 1, 3, 3]
    got = _run(sess, "mesh_allreduce", ints, [2, 2, 0], (3, 2), "int32")  # sum, outer level
    assert [int(g[0, 0]) for g in got] == [2, 4, 2, 4]


def test_errors(sess):
    pieces = shards(X, MESH, [0, REP])
    with pytest.raises(dist.DistributedError, match="does not fit a session of 4"):
        _run(sess, "mesh_allgather", pieces, [1, 3, 0, 1], (6, 8, 4))
    with pytest.raises(dist.DistributedError, match="must have shape"):
        _run(sess, "mesh_allgather", pieces, [2, 2, 0, 1], (2, 8, 4))
    with pytest.raises(dist.DistributedError, match="takes 4 integer arguments"):
        _run(sess, "mesh_slice", pieces, [2, 2, 0], (1, 8, 4))
