"""Local kernels: a fused PrimFunc shrunk to one device's chunk of its dims, cut after the
blocks whose reductions need an allreduce, and the splits that cannot be lowered this way."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from kernel_chunks import fused_kernel
from tvm import relax

from tvm_ext.ir.kernel_dims import kernel_dims
from tvm_ext.ir.local_kernels import (
    LoweringError,
    chunk_params,
    inner_blocks,
    local_kernel,
    lowering_obstacle,
    reshape_obstacle,
    split_kernel,
)

LLVM = tvm.target.Target("llvm")


_kernel = fused_kernel  # the one fused PrimFunc of build(*params), analysed


def _dim(kd, name: str) -> int:
    return [d.name for d in kd.spec.dims].index(name)


def _call(func, *arrays, out_shape):
    f = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), LLVM)
    out = tvm.runtime.empty(out_shape, "float32")
    f["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays], out)
    return out.numpy()


RNG = np.random.default_rng(0)
A = RNG.standard_normal((4, 16)).astype("float32")
W = RNG.standard_normal((16, 8)).astype("float32")
B = RNG.standard_normal((8,)).astype("float32")


def test_shrink_columns_of_a_fused_matmul():
    kd = _kernel(lambda a, w, b: relax.op.nn.relu(relax.op.matmul(a, w) + b),
                 (4, 16), (16, 8), (8,))
    d = _dim(kd, "matmul.v_i1")
    local = local_kernel(kd, {d: 2})
    got = _call(local, A, W[:, 4:], B[4:], out_shape=(4, 4))
    np.testing.assert_allclose(got, np.maximum(A @ W + B, 0)[:, 4:], rtol=1e-5)
    assert [int(s) for s in local.params[1].shape] == [16, 4]  # the buffer shrank, typed so
    assert "R.Tensor((16, 4)" in str(local.ty)


def test_split_after_the_reduction_then_allreduce():
    """Contraction split with the bias fused after it: cut after the matmul block, allreduce
    the partial products (numpy here), finish with the bias."""
    kd = _kernel(lambda a, w, b: relax.op.matmul(a, w) + b, (4, 16), (16, 8), (8,))
    d = _dim(kd, "matmul.v_k")
    assert lowering_obstacle(kd, d, allow_inner=False).startswith("an allreduce inside")
    assert lowering_obstacle(kd, d) is None
    parts = split_kernel(kd.func, 1, inner_blocks(kd, [d]))
    assert [p.inputs for p in parts] == [[("in", 0), ("in", 1)], [("in", 2), ("tmp", 0)]]
    assert parts[0].outputs == [("tmp", 0)] and parts[1].outputs == [("out", 0)]
    first = local_kernel(kd, {d: 2}, func=parts[0].func)
    second = local_kernel(kd, {d: 2}, func=parts[1].func)
    partial = [_call(first, A[:, h * 8:(h + 1) * 8], W[h * 8:(h + 1) * 8], out_shape=(4, 8))
               for h in range(2)]
    got = _call(second, B, partial[0] + partial[1], out_shape=(4, 8))
    np.testing.assert_allclose(got, A @ W + B, rtol=1e-5, atol=1e-5)


def test_softmax_over_the_split_axis():
    kd = _kernel(lambda a: relax.op.nn.softmax(a, axis=1), (4, 16))
    (d,) = [i for i, dim in enumerate(kd.spec.dims) if dim.inner]
    parts = split_kernel(kd.func, 1, inner_blocks(kd, [d]))
    assert len(parts) == 3  # max | exp, sum | divide
    halves = [A[:, :8], A[:, 8:]]
    local = [local_kernel(kd, {d: 2}, func=p.func) for p in parts]
    m = np.maximum(*[_call(local[0], h, out_shape=(4,)) for h in halves])  # allreduce max
    outs = []
    for h in halves:
        f = tvm.compile(tvm.IRModule({"main": local[1].with_attr("global_symbol", "main")}), LLVM)
        e, s = tvm.runtime.empty((4, 8), "float32"), tvm.runtime.empty((4,), "float32")
        f["main"](tvm.runtime.tensor(h), tvm.runtime.tensor(m), e, s)
        outs.append((e.numpy(), s.numpy()))
    total = outs[0][1] + outs[1][1]  # allreduce sum
    got = np.concatenate([_call(local[2], e, total, out_shape=(4, 8)) for e, _ in outs], 1)
    want = np.exp(A - A.max(1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(1, keepdims=True), rtol=1e-5)


def test_obstacles():
    kd = _kernel(lambda x, w: relax.op.nn.conv2d(x, w, padding=1), (2, 4, 8, 8), (4, 4, 3, 3))
    reasons = {d.name: lowering_obstacle(kd, i) for i, d in enumerate(kd.spec.dims)}
    assert reasons["pad_temp.v_i0"] is None  # batch
    assert reasons["conv2d_nchw.v_ff"] is None  # output channels
    assert "global indices" in reasons["conv2d_nchw.v_yy"] or "halo" in reasons[
        "conv2d_nchw.v_yy"]
    with pytest.raises(LoweringError, match=r"conv2d_nchw\.v_yy"):
        local_kernel(kd, {_dim(kd, "conv2d_nchw.v_yy"): 2})


def test_reshape_obstacle():
    assert reshape_obstacle((4, 8, 16), (32, 16), 0, 0) is None  # merge behind the cut
    assert reshape_obstacle((4, 8, 16), (4, 8, 2, 8), 2, 2) is None  # split heads
    assert reshape_obstacle((4, 8), (32,), 1, 0) is not None  # pieces interleave
    assert reshape_obstacle((4, 8), (32,), None, 0) is not None  # a slice, not a view


def test_global_indices_through_a_chunk_argument():
    """out[i, j] = x[i, j] + j: split on j, each chunk takes its index and sees global j."""
    from tvm import te

    x = te.placeholder((4, 8), "float32", name="x")
    out = te.compute((4, 8), lambda i, j: x[i, j] + j.astype("float32"), name="out")
    kd = kernel_dims(te.create_prim_func([x, out]), 1, "add_index")
    d = _dim(kd, "out.v_j")
    assert kd.spec.dims[d].global_index and d in kd.value_dims
    assert lowering_obstacle(kd, d) is None
    local = local_kernel(kd, {d: 2})
    assert chunk_params(local) == [d]
    f = tvm.compile(tvm.IRModule({"main": local.with_attr("global_symbol", "main")}), LLVM)
    full = A[:, :8]
    for chunk in range(2):
        res = tvm.runtime.empty((4, 4), "float32")
        f["main"](tvm.runtime.tensor(np.ascontiguousarray(full[:, chunk * 4:(chunk + 1) * 4])),
                  chunk, res)
        np.testing.assert_allclose(res.numpy(), (full + np.arange(8))[:, chunk * 4:
                                                                    (chunk + 1) * 4])


def test_a_resize_splits_its_rows_and_every_chunk_computes_its_whole_source():
    """A resize reads its fused source at computed rows, so no chunk of the output rows reads
    a chunk of the source: every chunk computes all of it (x read whole), then its rows. (A
    source made in chunks and read across them stays invalid:
    test_kernel_dims.test_fused_head_merge_keeps_the_head_split.)"""
    from kernel_chunks import check_split

    kd = _kernel(lambda x: relax.op.image.resize2d(relax.op.multiply(x, x), size=(16, 16)),
                 (1, 4, 8, 8))
    (rows,) = [d for d, dim in enumerate(kd.spec.dims) if dim.outputs == [2]]
    dim = kd.spec.dims[rows]
    assert dim.valid and dim.inputs == [None] and rows in kd.value_dims
    assert lowering_obstacle(kd, rows) is None
    for parts in (2, 4):
        assert check_split(kd, {rows: parts}).error is None
