"""gpu_split_reduction: a reduction too long for one thread block in two stages."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gpu_emulation import on_cpu, run_kernel
from one_op import one_op_module
from tvm import relax, tirx

from tvm_ext import pipeline as P
from tvm_ext.schedules.gpu_split_reduction import MIN_ITERATIONS, SplitReduction
from tvm_ext.schedules.thread_work import serial_iterations


def _kernel(build, shape, target) -> tirx.PrimFunc:
    mod = P.fuse(one_op_module(build, shape), target)
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


@pytest.mark.parametrize("build, exact, shape", [
    (lambda x: relax.op.mean(x), lambda x: x.mean(), (4, 64, 1000)),  # a loss: one output
    (lambda x: relax.op.sum(x, axis=[0, 1]), lambda x: x.sum((0, 1)), (256, 512, 3)),
])
def test_a_long_reduction_runs_in_two_stages(build, exact, shape, cuda_target):
    """Within float32 rounding of the exact sum (summed in another order than the serial
    kernel's, so compared with the float64 result)."""
    func = _kernel(build, shape, cuda_target)
    sch = SplitReduction().apply(func, cuda_target, False)
    scheduled = sch.mod["main"]
    work = serial_iterations(scheduled).iterations
    assert work <= 64, work  # 1000 x 256 / (the 256 threads of each of ~100 blocks) and back
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    out_shape = [int(s) for s in func.params[-1].ty.shape]
    args = [x, np.zeros(out_shape, "float32")]
    got = run_kernel(on_cpu(scheduled), args)[-1]
    want = exact(x.astype("float64"))
    scale = exact(np.abs(x).astype("float64")) * 1e-6
    assert np.all(np.abs(got - want) <= scale), (got, want)


def test_short_reductions_are_left_to_one_block(cuda_target):
    func = _kernel(lambda x: relax.op.sum(x, axis=1), (64, MIN_ITERATIONS // 2), cuda_target)
    assert SplitReduction().apply(func, cuda_target, False) is None


def test_not_for_the_cpu():
    func = _kernel(lambda x: relax.op.mean(x), (4, 64, 1000), tvm.target.Target("llvm"))
    assert SplitReduction().apply(func, tvm.target.Target("llvm"), False) is None
