"""Default CPU schedules: every kind of kernel the zoo and the corpus produce gets parallel and
vectorised loops, computes what the unscheduled kernel computes, and library blocks and
scheduled kernels are left alone."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import tirx as T

from tvm_ext import pipeline
from tvm_ext.schedules import ApplyDefaultCPUSchedules
from tvm_ext.schedules.default_cpu import schedule_kernel, vector_lanes

F32 = "float32"
TARGET = tvm.target.Target("llvm")


def fused_kernels(build, *shapes) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(s, F32)) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build(*params))
        bb.emit_func_output(out)
    return pipeline.fuse(bb.get(), TARGET)


def loop_kinds(func) -> set:
    kinds: set = set()
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda f: kinds.add(f.kind))])
    return kinds


def run_both(mod: tvm.IRModule, shapes) -> tuple:
    """Outputs of the module built with and without default CPU schedules."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(F32) for s in shapes]
    outs = []
    for schedules in (False, True):
        passes = [*pipeline.dataflow_lower_passes(TARGET), *pipeline.finalize_passes(TARGET)]
        if schedules:
            passes = [ApplyDefaultCPUSchedules(), *passes]
        with TARGET:
            ex = tvm.compile(mod, TARGET, relax_pipeline=tvm.transform.Sequential(passes))
        out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
        outs.append(out.numpy())
    return outs


CASES = {
    "elementwise": (lambda a, b: relax.op.multiply(relax.op.add(a, b), b), [(64, 128)] * 2),
    "broadcast": (lambda a, b: relax.op.add(a, b), [(16, 64, 32), (32,)]),
    "transpose": (lambda a: relax.op.permute_dims(a, [0, 2, 1]), [(4, 96, 64)]),
    "sum_last": (lambda a: relax.op.sum(a, axis=-1), [(64, 256)]),
    "max_first": (lambda a: relax.op.max(a, axis=0), [(64, 256)]),
    "mean_middle": (lambda a: relax.op.mean(a, axis=1), [(8, 64, 32)]),
    "softmax": (lambda a: relax.op.nn.softmax(a), [(4, 8, 64, 64)]),
    "layer_norm": (lambda a, g, b: relax.op.nn.layer_norm(a, g, b, axes=[-1]),
                   [(4, 64, 128), (128,), (128,)]),
    "matmul": (lambda a, b: relax.op.matmul(a, b), [(64, 96), (96, 128)]),
    "batched_matmul": (lambda a, b: relax.op.matmul(a, b), [(8, 32, 64), (8, 64, 48)]),
    "matmul_transposed": (lambda a, b: relax.op.matmul(a, relax.op.permute_dims(b)),
                          [(64, 96), (128, 96)]),
    "matmul_bias_gelu": (lambda a, b, c: relax.op.nn.gelu(relax.op.add(relax.op.matmul(a, b),
                                                                         c)),
                         [(64, 96), (96, 128), (128,)]),
    "conv2d": (lambda x, w: relax.op.nn.conv2d(x, w, strides=2, padding=1),
               [(2, 8, 32, 32), (16, 8, 3, 3)]),
    "grouped_conv2d": (lambda x, w: relax.op.nn.conv2d(x, w, padding=1, groups=8),
                       [(2, 16, 16, 16), (16, 2, 3, 3)]),
    "max_pool": (lambda x: relax.op.nn.max_pool2d(x, 3, 2, 1), [(2, 8, 32, 32)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_schedule_matches_unscheduled(case):
    build, shapes = CASES[case]
    mod = fused_kernels(build, *shapes)
    plain, scheduled = run_both(mod, shapes)
    np.testing.assert_allclose(scheduled, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case, vectorised", [("elementwise", True), ("softmax", True),
                                              ("matmul", True), ("conv2d", True),
                                              ("sum_last", False)])
def test_kernels_get_parallel_and_vector_loops(case, vectorised):
    build, shapes = CASES[case]
    mod = fused_kernels(build, *shapes)
    with TARGET:
        out = ApplyDefaultCPUSchedules()(mod)
    funcs = [f for f in out.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert funcs and all(f.attrs["tirx.is_scheduled"] for f in funcs)
    kinds = set().union(*(loop_kinds(f) for f in funcs))
    assert tirx.ForKind.PARALLEL in kinds
    assert (tirx.ForKind.VECTORIZED in kinds) == vectorised


def test_dynamic_shapes_compile_and_match():
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 64), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(relax.op.multiply(x, x)))
        bb.emit_func_output(out)
    mod = pipeline.fuse(bb.get(), TARGET)
    plain, scheduled = run_both(mod, [(37, 64)])
    np.testing.assert_allclose(scheduled, plain, rtol=1e-5, atol=1e-6)


def test_scheduled_kernels_are_left_alone():
    build, shapes = CASES["softmax"]
    mod = fused_kernels(build, *shapes)
    marked = tvm.IRModule({gv: f.with_attr("tirx.is_scheduled", True)
                           if isinstance(f, tirx.PrimFunc) else f
                           for gv, f in mod.functions.items()})
    with TARGET:
        out = ApplyDefaultCPUSchedules()(marked)
    tvm.ir.assert_structural_equal(out, marked)


@T.prim_func(private=True, s_tir=True)
def _library_then_gelu(a: T.Buffer((64, 32), F32), w: T.Buffer((32, 64), F32),
                       out: T.Buffer((64, 64), F32)):
    mm = T.sblock_alloc_buffer((64, 64))
    with T.sblock("tvm_ext_library_matmul"):
        T.reads(a[0:64, 0:32], w[0:32, 0:64])
        T.writes(mm[0:64, 0:64])
        T.evaluate(T.call_packed("tvm_ext.test.noop", a.data, w.data, mm.data))
    for i, j in T.grid(64, 64):
        with T.sblock("gelu"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = mm[vi, vj] * T.sigmoid(mm[vi, vj] * T.float32(1.702))


def test_library_block_kept_and_epilogue_scheduled():
    scheduled = schedule_kernel(_library_then_gelu, TARGET)
    assert scheduled is not None
    text = scheduled.script()
    assert "tvm_ext_library_matmul" in text and "call_packed" in text
    assert tirx.ForKind.PARALLEL in loop_kinds(scheduled)
    mod = tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")})
    tvm.compile(mod, TARGET)  # lowers with the library call in place


def test_vector_lanes_follow_the_target():
    assert vector_lanes(tvm.target.Target("llvm"), 32) >= 4
    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    assert vector_lanes(avx512, 32) == 16
