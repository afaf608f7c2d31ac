"""Kernels that add to their outputs (`tvm_ext.ir.accumulating_kernels`): what a reduction split
in time runs for every chunk after the first. Their init reads the output's previous value
through a parameter of its own (the caller passes the output twice), so they stay reductions
with an init and the default schedules (a local accumulator on CPU, dlight's rules on a GPU)
keep them adding."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from tvm_ext.ir.accumulating_kernels import (
    accumulating_kernel,
    adds_to_outputs,
    output_params,
)
from tvm_ext.schedules import ApplyDefaultCPUSchedules
from tvm_ext.schedules.default_gpu import ApplyDefaultGPUSchedules


def _matmul(m=32, k=64, n=48) -> tirx.PrimFunc:
    """A matmul as legalization writes it (int64 extents)."""
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    a = te.placeholder((i64(m), i64(k)), name="A")
    b = te.placeholder((i64(k), i64(n)), name="B")
    r = te.reduce_axis((i64(0), i64(k)), name="k")
    c = te.compute((i64(m), i64(n)), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c])


@T.prim_func(private=True, s_tir=True)
def _zeroed_apart(a: T.Buffer((8, 16), "float32"), out: T.Buffer((8,), "float32")):
    # The output zeroed by a block of its own, then summed into without an init: removing an
    # init cannot make this kernel add to what the output held.
    for i in range(8):
        with T.sblock("zero"):
            vi = T.axis.spatial(8, i)
            out[vi] = T.float32(0.0)
    for i, j in T.grid(8, 16):
        with T.sblock("sum"):
            vi, vj = T.axis.remap("SR", [i, j])
            out[vi] = out[vi] + a[vi, vj]


def _run(func, target, *arrays, prev: bool = False):
    """`func` on `arrays` (the last its output); with `prev`, the output passed twice, as the
    kernel's `_prev` input and its output, as SwapOffload calls it."""
    f = tvm.compile(func, target=target)
    tensors = [tvm.runtime.tensor(x) for x in arrays]
    f(*tensors[:-1], *tensors[-1:] * (2 if prev else 1))
    return tensors[-1].numpy()


def _operands(m=32, k=64, n=48):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((m, k)).astype("float32"),
            rng.standard_normal((k, n)).astype("float32"),
            rng.standard_normal((m, n)).astype("float32"))


def test_without_its_init_a_reduction_adds_to_its_output():
    func = _matmul()
    outs = output_params(func, 1)
    assert adds_to_outputs(func, outs)
    a, b, c = _operands()
    acc = accumulating_kernel(func, outs)
    assert [p.name for p in acc.params] == ["A", "B", "C_prev", "C"]
    np.testing.assert_allclose(_run(acc, "llvm", a, b, c, prev=True), c + a @ b,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_run(func, "llvm", a, b, c), a @ b, rtol=1e-5, atol=1e-5)


def test_an_output_zeroed_by_another_block_is_refused():
    outs = output_params(_zeroed_apart, 1)
    assert not adds_to_outputs(_zeroed_apart, outs)
    with pytest.raises(ValueError, match="one block with an init"):
        accumulating_kernel(_zeroed_apart, outs)


def test_the_default_cpu_schedule_keeps_adding():
    """The contraction rule caches the output in a local accumulator (registers) and writes it
    back: the accumulator starts from the previous output, so nothing is dropped."""
    func = _matmul()
    acc = accumulating_kernel(func, output_params(func, 1)).with_attr("global_symbol", "main")
    target = tvm.target.Target("llvm")
    with target:
        mod = ApplyDefaultCPUSchedules()(tvm.IRModule({"main": acc}))
    scheduled = mod["main"]
    assert int(scheduled.attrs["tirx.is_scheduled"]) == 1
    assert "local" in scheduled.script()  # the register tile: scheduled as any contraction
    a, b, c = _operands()
    np.testing.assert_allclose(_run(scheduled, target, a, b, c, prev=True), c + a @ b,
                               rtol=1e-5, atol=1e-5)


def test_the_default_gpu_schedule_keeps_adding(cuda_target):
    """On a GPU dlight's matmul rule schedules it (shared-memory tiles, local accumulators
    started from the previous output), and it compiles."""
    target = cuda_target
    func = _matmul()
    acc = accumulating_kernel(func, output_params(func, 1)).with_attr("global_symbol", "main")
    with target:
        mod = ApplyDefaultGPUSchedules()(tvm.IRModule({"main": acc}))
        scheduled = mod["main"]
        assert "threadIdx.x" in scheduled.script()
        assert "C_prev" in scheduled.script()
        tvm.compile(scheduled, target=target)  # nvcc takes the arch from the current target
