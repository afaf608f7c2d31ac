"""Kernels cut after their reduction (`tvm_ext.ir.epilogue_kernels`): which kernels a split
along the reduced dim can finish once, in place or with scratch, and that the parts compute the
whole kernel (on CPU; compiled for a GPU where nvcc is here)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from tvm_ext import pipeline
from tvm_ext.ir.accumulating_kernels import accumulating_kernel, output_params
from tvm_ext.ir.epilogue_kernels import reduction_epilogue
from tvm_ext.ir.kernel_dims import kernel_dims
from tvm_ext.ir.local_kernels import local_kernel
from tvm_ext.schedules.default_gpu import ApplyDefaultGPUSchedules

LLVM = tvm.target.Target("llvm")


def _kernel(build) -> tirx.PrimFunc:
    """The one fused kernel of main(x (64 x 32), w (32 x 16), b (16,)) = build(x, w, b)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 32), "float32"))
    w = relax.Var("w", relax.TensorType((32, 16), "float32"))
    b = relax.Var("b", relax.TensorType((16,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(build(x, w, b)))
        bb.emit_func_output(out)
    fused = pipeline.fuse(bb.get(), LLVM)
    kernels = [f for _, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert len(kernels) == 1
    return kernels[0]


def _reduced_dim(kd) -> int:
    return next(d for d, dim in enumerate(kd.spec.dims) if dim.inner)


def test_matmul_plus_bias_finishes_in_place():
    func = _kernel(lambda x, w, b: relax.op.add(relax.op.matmul(x, w), b))
    kd = kernel_dims(func, 1)
    cut = reduction_epilogue(kd, _reduced_dim(kd))
    assert cut is not None and cut.in_place
    assert cut.reduction.inputs == [("in", 0), ("in", 1)] and cut.reduction.outputs == [("tmp", 0)]
    assert ("in", 2) in cut.epilogue.inputs  # the bias, read whole by the epilogue
    assert cut.intermediate_sizes == [64 * 16 * 4]


def test_a_slice_after_the_reduction_needs_scratch():
    func = _kernel(lambda x, w, b: relax.op.strided_slice(relax.op.matmul(x, w), axes=[1],
                                                          begin=[0], end=[8]))
    kd = kernel_dims(func, 1)
    cut = reduction_epilogue(kd, _reduced_dim(kd))
    assert cut is not None and not cut.in_place  # 64 x 8 out of a 64 x 16 product


def test_an_epilogue_that_reads_the_cut_input_again_is_refused():
    """softmax: max over a row, then exp(x - max) reads the row again; chunks of the row cannot
    finish it once."""
    func = _kernel(lambda x, w, b: relax.op.nn.softmax(x, axis=1))
    kd = kernel_dims(func, 1)
    dims = [d for d, dim in enumerate(kd.spec.dims) if dim.inner]
    assert dims and all(reduction_epilogue(kd, d) is None for d in dims)


def _parts_in_chunks(func, chunks: int):
    """(chunk 0's kernel, later chunks' kernel, the epilogue) of `func` split in `chunks` along
    its reduced dim."""
    kd = kernel_dims(func, 1)
    d = _reduced_dim(kd)
    cut = reduction_epilogue(kd, d)
    assert cut.in_place
    first = local_kernel(kd, {d: chunks}, func=cut.reduction.func, num_outputs=1)
    rest = accumulating_kernel(first, output_params(first, 1))
    return [k.with_attr("global_symbol", "main") for k in (first, rest, cut.epilogue.func)]


def test_the_parts_compute_the_whole_kernel():
    func = _kernel(lambda x, w, b: relax.op.add(relax.op.matmul(x, w), b))
    first, rest, finish = _parts_in_chunks(func, 4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype("float32")
    w = rng.standard_normal((32, 16)).astype("float32")
    b = rng.standard_normal(16).astype("float32")
    out = tvm.runtime.tensor(np.zeros((64, 16), "float32"))
    f_first, f_rest, f_finish = (tvm.compile(k, target=LLVM) for k in (first, rest, finish))
    for j in range(4):
        xs = tvm.runtime.tensor(np.ascontiguousarray(x[:, 8 * j:8 * (j + 1)]))
        ws = tvm.runtime.tensor(w[8 * j:8 * (j + 1)])
        if j == 0:
            f_first(xs, ws, out)
        else:
            f_rest(xs, ws, out, out)
    f_finish(tvm.runtime.tensor(b), out, out)  # in place: the output passed twice
    np.testing.assert_allclose(out.numpy(), x @ w + b, rtol=1e-5, atol=1e-5)


def test_the_parts_compile_for_a_gpu(cuda_target):
    target = cuda_target
    func = _kernel(lambda x, w, b: relax.op.add(relax.op.matmul(x, w), b))
    parts = _parts_in_chunks(func, 4)
    mod = tvm.IRModule({f"part{i}": k.with_attr("global_symbol", f"part{i}")
                        for i, k in enumerate(parts)})
    with target:
        scheduled = ApplyDefaultGPUSchedules()(mod)
        assert all("threadIdx.x" in scheduled[f"part{i}"].script() for i in range(3))
        tvm.compile(scheduled, target=target)
