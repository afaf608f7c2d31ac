"""Default CPU schedules: every kind of kernel the zoo and the corpus produce gets parallel and
vectorised loops and computes what the unscheduled kernel computes (built and run on llvm);
row groups run under one parallel loop, contractions in register tiles with their epilogue;
library blocks and scheduled kernels are left alone; the vector math is within a few ulp."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
import tvm_ffi
from one_op import one_op_module
from tvm import relax, tirx
from tvm.script import tirx as T

from tvm_ext import pipeline
from tvm_ext.schedules import ApplyDefaultCPUSchedules
from tvm_ext.schedules.default_cpu import vector_lanes
from tvm_ext.schedules.default_cpu_math import vector_math

F32 = "float32"
TARGET = tvm.target.Target("llvm")
R = relax.op


def fused_kernels(build, *shapes) -> tvm.IRModule:
    return pipeline.fuse(one_op_module(build, *shapes), TARGET)


def prim_funcs(mod: tvm.IRModule) -> list[tirx.PrimFunc]:
    return [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]


def loops_of(node) -> list:
    found: list = []
    tvm_ffi.structural_walk(node, [(tirx.For, found.append)])
    return found


def loop_kinds(func) -> set:
    return {f.kind for f in loops_of(func.body)}


def scheduled(mod: tvm.IRModule) -> tvm.IRModule:
    with TARGET:
        return ApplyDefaultCPUSchedules()(mod)


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
    "elementwise": (lambda a, b: R.multiply(R.add(a, b), b), [(256, 512)] * 2),
    "broadcast": (lambda a, b: R.add(a, b), [(16, 64, 128), (128,)]),
    "transpose": (lambda a: R.permute_dims(a, [0, 2, 1]), [(8, 96, 128)]),
    "reshape_heads": (lambda a: R.permute_dims(R.reshape(a, (2, 64, 8, 32)), [0, 2, 1, 3]),
                      [(2, 64, 256)]),
    "sum_last": (lambda a: R.sum(a, axis=-1), [(256, 512)]),
    "max_last": (lambda a: R.max(a, axis=-1), [(256, 512)]),
    "sum_first": (lambda a: R.sum(a, axis=0), [(512, 256)]),
    "max_first": (lambda a: R.max(a, axis=0), [(512, 256)]),
    "mean_middle": (lambda a: R.mean(a, axis=1), [(8, 128, 64)]),
    "mean_last": (lambda a: R.mean(a, axis=-1), [(8, 128, 64)]),
    "sum_all": (lambda a: R.sum(a), [(256, 512)]),
    "softmax": (lambda a: R.nn.softmax(a), [(4, 8, 64, 64)]),
    "layer_norm": (lambda a, g, b: R.nn.layer_norm(a, g, b, axes=[-1]),
                   [(4, 64, 256), (256,), (256,)]),
    "matmul": (lambda a, b: R.matmul(a, b), [(64, 96), (96, 128)]),
    "batched_matmul": (lambda a, b: R.matmul(a, b), [(8, 32, 64), (8, 64, 48)]),
    "matmul_transposed": (lambda a, b: R.matmul(a, R.permute_dims(b)), [(64, 96), (128, 96)]),
    "matmul_odd": (lambda a, b: R.matmul(a, b), [(8, 65, 64), (8, 64, 65)]),  # padded to tiles
    "matmul_bias_gelu": (lambda a, b, c: R.nn.gelu(R.add(R.matmul(a, b), c)),
                         [(64, 96), (96, 128), (128,)]),
    "conv2d": (lambda x, w: R.nn.conv2d(x, w, strides=2, padding=1),
               [(2, 8, 32, 32), (16, 8, 3, 3)]),
    "grouped_conv2d": (lambda x, w: R.nn.conv2d(x, w, padding=1, groups=8),
                       [(2, 16, 16, 16), (16, 2, 3, 3)]),
    "patch_conv2d": (lambda x, w: R.nn.conv2d(x, w, strides=8), [(2, 3, 32, 32), (64, 3, 8, 8)]),
    "max_pool": (lambda x: R.nn.max_pool2d(x, 3, 2, 1), [(2, 8, 32, 32)]),
    "silu_tanh_sigmoid": (lambda a: R.multiply(R.nn.silu(a), R.tanh(R.sigmoid(a))),
                          [(64, 128)]),
    "argmax": (lambda a: R.argmax(a, axis=-1), [(64, 128)]),
    # exp / erf of a value the vector loop does not index, then scaled: TVM's vectoriser met
    # the polynomials' Let bindings twice and stopped (FocalNet's GELU gradient).
    "broadcast_exp_scaled": (lambda a: R.broadcast_to(R.multiply(R.exp(a), relax.const(2.0, F32)),
                                                      (2, 8, 4, 16)), [(2, 8, 1, 1)]),
    "broadcast_erf_scaled": (lambda a: R.broadcast_to(R.multiply(R.erf(a), relax.const(0.5, F32)),
                                                      (2, 8, 4, 16)), [(2, 8, 1, 1)]),
    "cumsum": (lambda a: R.cumsum(a, axis=1), [(16, 64)]),
    # tanh of a value cast to int32 where it is finite (the tiny autoencoder's quantised
    # latents): the vectoriser scalarised around `isnan` and met tanh's Let bindings twice.
    "finite_cast_tanh": (lambda a: R.multiply(R.tanh(R.divide(R.astype(R.astype(R.where(
        R.isfinite(R.round(a)), R.round(a), relax.const(0.0, F32)), "int32"), F32),
        relax.const(3.0, F32))), relax.const(3.0, F32)), [(4, 64)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_schedule_matches_unscheduled(case):
    build, shapes = CASES[case]
    plain, fast = run_both(fused_kernels(build, *shapes), shapes)
    np.testing.assert_allclose(fast, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["elementwise", "broadcast", "transpose", "sum_last",
                                  "max_first", "sum_first", "sum_all", "softmax", "layer_norm",
                                  "matmul", "matmul_odd", "matmul_bias_gelu", "conv2d",
                                  "patch_conv2d"])
def test_kernels_get_parallel_and_vector_loops(case):
    build, shapes = CASES[case]
    funcs = prim_funcs(scheduled(fused_kernels(build, *shapes)))
    assert funcs and all(f.attrs["tirx.is_scheduled"] for f in funcs)
    kinds = set().union(*(loop_kinds(f) for f in funcs))
    assert tirx.ForKind.VECTORIZED in kinds
    if case != "sum_all":  # a full reduction has no rows to share out
        assert tirx.ForKind.PARALLEL in kinds


@pytest.mark.parametrize("case", ["softmax", "layer_norm"])
def test_row_groups_run_under_one_parallel_loop(case):
    build, shapes = CASES[case]
    (func,) = prim_funcs(scheduled(fused_kernels(build, *shapes)))
    body = func.body.block.body
    assert isinstance(body, tirx.For) and body.kind == tirx.ForKind.PARALLEL
    # every stage of a row reads the row's scratch, not a whole buffer's: all under it
    assert len(loops_of(func.body)) == len(loops_of(body.body)) + 1


def test_contraction_is_register_tiled_with_its_epilogue():
    build, shapes = CASES["matmul_bias_gelu"]
    (func,) = prim_funcs(scheduled(fused_kernels(build, *shapes)))
    text = func.script()
    assert 'scope="local"' in text and "T.unroll" in text
    blocks: list = []
    tvm_ffi.structural_walk(func.body, [(tvm.s_tir.SBlock, blocks.append)])
    names = {b.name_hint for b in blocks}
    assert {"matmul_init", "matmul_update"} <= names
    assert not any(n.startswith(("T_add", "T_multiply", "compute")) for n in names), names


def test_dynamic_shapes_compile_and_match():
    """A symbolic number of rows (matmul, layer norm, softmax over static rows) and a symbolic
    row length (softmax, sum over it)."""
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 64), F32))
    w = relax.Var("w", relax.TensorType((64, 128), F32))
    g = relax.Var("g", relax.TensorType((64,), F32))
    row = relax.Var("row", relax.TensorType((128, n), F32))
    with bb.function("main", [x, w, g, row]):
        with bb.dataflow():
            normed = R.nn.layer_norm(R.multiply(x, x), g, g, axes=[-1])
            soft = R.nn.softmax(R.nn.gelu(R.matmul(normed, w)))
            per_row = R.sum(R.nn.softmax(row), axis=1)
            out = bb.emit_output(R.add(R.sum(soft, axis=0), per_row))
        bb.emit_func_output(out)
    mod = pipeline.fuse(bb.get(), TARGET)
    assert all(f.attrs["tirx.is_scheduled"] for f in prim_funcs(scheduled(mod)))
    for size in (37, 64):
        plain, fast = run_both(mod, [(size, 64), (64, 128), (64,), (128, size)])
        np.testing.assert_allclose(fast, plain, rtol=1e-5, atol=1e-5)


def test_scheduled_kernels_are_left_alone():
    build, shapes = CASES["softmax"]
    mod = fused_kernels(build, *shapes)
    marked = tvm.IRModule({gv: f.with_attr("tirx.is_scheduled", True)
                           if isinstance(f, tirx.PrimFunc) else f
                           for gv, f in mod.functions.items()})
    tvm.ir.assert_structural_equal(scheduled(marked), marked)


@T.prim_func(private=True, s_tir=True)
def _library_between_elementwise(a: T.Buffer((256, 256), F32), w: T.Buffer((256, 256), F32),
                                 out: T.Buffer((256, 256), F32)):
    scaled = T.sblock_alloc_buffer((256, 256))
    mm = T.sblock_alloc_buffer((256, 256))
    for i, j in T.grid(256, 256):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            scaled[vi, vj] = a[vi, vj] * T.float32(2.0)
    with T.sblock("tvm_ext_library_call"):
        T.reads(scaled[0:256, 0:256], w[0:256, 0:256])
        T.writes(mm[0:256, 0:256])
        T.evaluate(T.call_packed("tvm_ext.test.noop", scaled.data, w.data, mm.data))
    for i, j in T.grid(256, 256):
        with T.sblock("gelu"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = mm[vi, vj] * T.sigmoid(mm[vi, vj] * T.float32(1.702))


def _blocks(func) -> dict:
    found: list = []
    tvm_ffi.structural_walk(func.body, [(tvm.s_tir.SBlock, found.append)])
    return {b.name_hint: b for b in found}


def test_library_block_kept_and_the_other_blocks_scheduled():
    before = _blocks(_library_between_elementwise)
    mod = tvm.IRModule({"main": _library_between_elementwise.with_attr("global_symbol", "main")})
    func = scheduled(mod)["main"]
    after = _blocks(func)
    assert func.attrs["tirx.is_scheduled"]
    # the call, its reads and writes as written; its producer not inlined into it
    tvm.ir.assert_structural_equal(after["tvm_ext_library_call"],
                                   before["tvm_ext_library_call"])
    assert {"scale", "gelu"} <= set(after)
    text = func.script()
    assert text.count("T.parallel") == 2 and text.count("T.vectorized") == 2
    tvm.compile(tvm.IRModule({"main": func}), TARGET)  # lowers with the library call in place


def test_vector_lanes_follow_the_target():
    target = tvm.target.Target("llvm")
    bits = max(128, int(tvm.target.codegen.llvm_get_vector_width(target)))
    assert vector_lanes(target, 32) == bits // 32 >= 4
    assert vector_lanes(target, 8) == 4 * vector_lanes(target, 32)


def _math_error_ulp(op, reference, values: np.ndarray) -> float:
    """Largest error of `vector_math(op)` on `values`, in float32 ulp of the float64 truth;
    non-finite results must match exactly."""
    x = tvm.te.placeholder(values.shape, F32, name="x")
    y = tvm.te.compute(values.shape, lambda i: op(x[i]), name="y")
    func = vector_math(tvm.te.create_prim_func([x, y]))
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), TARGET)
    out = tvm.runtime.tensor(np.zeros_like(values))
    lib.jit()["main"](tvm.runtime.tensor(values), out)
    got, truth = out.numpy().astype("float64"), reference(values.astype("float64"))
    exact = truth.astype(F32)
    finite = np.isfinite(exact)
    np.testing.assert_array_equal(got[~finite], exact[~finite])
    ulp = np.spacing(np.abs(exact[finite])).astype("float64")
    return float(np.max(np.abs(got[finite] - truth[finite]) / ulp))


@pytest.mark.parametrize("name, op, reference, low, high, max_ulp", [
    ("exp", tirx.exp, np.exp, -110.0, 90.0, 2),
    ("tanh", tirx.tanh, np.tanh, -10.0, 10.0, 8),
    ("erf", tirx.erf, np.vectorize(math.erf), -5.0, 5.0, 8),
    ("sigmoid", tirx.sigmoid, lambda v: 1 / (1 + np.exp(-v)), -80.0, 80.0, 4),
    ("cube", lambda v: tirx.power(v, tirx.const(3.0, F32)), lambda v: v ** 3, -50.0, 50.0, 2),
])
def test_vector_math_is_within_a_few_ulp(name, op, reference, low, high, max_ulp):
    rng = np.random.default_rng(0)
    special = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-30, -1e-30, 1e-4, -1e-4]
    values = np.concatenate([rng.uniform(low, high, 1 << 14), rng.uniform(-1e-2, 1e-2, 1024),
                             special]).astype(F32)
    with np.errstate(over="ignore"):
        assert _math_error_ulp(op, reference, values) <= max_ulp, name


@pytest.mark.parametrize("dtype", ["float16", F32, "float64"])
def test_vector_math_isnan_reads_the_bits_exactly(dtype):
    """isnan as a test of the bits (which vectorises) says what numpy's does on NaNs of either
    sign and any payload, infinities, the largest finite values, zeros and subnormals."""
    info = np.finfo(dtype)
    itype = {"float16": "int16", F32: "int32", "float64": "int64"}[dtype]
    quiet_neg = np.array(-np.nan, dtype)
    payload = (np.array(np.inf, dtype).view(itype) + 1).view(dtype)  # signalling, payload 1
    values = np.concatenate([np.array([np.nan, np.inf, -np.inf, info.max, -info.max, 0.0,
                                       -0.0, info.smallest_subnormal, 1.0], dtype),
                             quiet_neg[None], payload[None]])
    x = tvm.te.placeholder(values.shape, dtype, name="x")
    y = tvm.te.compute(values.shape, lambda i: tirx.isnan(x[i]), name="y")
    func = vector_math(tvm.te.create_prim_func([x, y]))
    calls: list = []
    tvm_ffi.structural_walk(func.body, [(tvm.ir.Call, calls.append)])
    assert "tirx.isnan" not in {getattr(c.op, "name", "") for c in calls}
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), TARGET)
    out = tvm.runtime.tensor(np.zeros(values.shape, "bool"))
    lib["main"](tvm.runtime.tensor(values), out)
    np.testing.assert_array_equal(out.numpy(), np.isnan(values))


def test_vector_math_leaves_bfloat16_kernels_alone():
    """TVM's bfloat16 legalisation miscompiles the Let bindings of the polynomials: a kernel
    holding bfloat16 values keeps pow as written and computes what torch's gelu_new does."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = tvm.te.placeholder((64,), "bfloat16", name="x")
    y = tvm.te.compute((64,), lambda i: tirx.Cast(F32, x[i] + tirx.Cast(
        "bfloat16", tirx.power(tirx.Cast(F32, x[i]), tirx.const(3.0, F32)))), name="y")
    func = tvm.te.create_prim_func([x, y])
    assert vector_math(func).same_as(func)
    values = np.random.default_rng(0).standard_normal(64).astype(ml_dtypes.bfloat16)
    lib = tvm.compile(tvm.IRModule({"main": vector_math(func).with_attr("global_symbol",
                                                                        "main")}), TARGET)
    out = tvm.runtime.tensor(np.zeros(64, F32))
    lib["main"](tvm.runtime.tensor(values), out)
    wide = values.astype(F32)
    expected = wide + (wide ** 3).astype(ml_dtypes.bfloat16).astype(F32)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("build, shapes", [
    (lambda a: R.mean(R.multiply(a, a)), [(2, 64, 8192)]),  # an mse loss: a scalar epilogue
    (lambda a: R.sum(a, axis=[1, 2]), [(4, 64, 1024)]),
])
def test_long_reductions_sum_in_parallel_partials_to_float64_accuracy(build, shapes):
    """A million float32 terms in one accumulator are off by about 1e-3 (TVM's own code);
    partial sums keep the error near float32's resolution, and run in parallel."""
    mod = fused_kernels(build, *shapes)
    kernel = next(f for f in prim_funcs(scheduled(mod)) if loop_kinds(f) & {
        tirx.ForKind.PARALLEL})
    assert tirx.ForKind.VECTORIZED in loop_kinds(kernel)
    plain, ours = run_both(mod, shapes)
    x = np.random.default_rng(0).standard_normal(shapes[0]).astype("float64")
    truth = np.mean(x * x) if plain.ndim == 0 else x.sum(axis=(1, 2))
    assert np.max(np.abs(ours - truth) / np.abs(truth)) < 1e-6
