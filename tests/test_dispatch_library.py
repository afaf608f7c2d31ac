"""DispatchLibraryKernels: built modules call the vendor library for their GEMMs and
convolutions (counted at run time), compute what TVM's generated code computes, compose with
partitioning, swapping and training steps, and leave everything to TVM with `library=False`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections import Counter

import numpy as np
import pytest
import tvm
import tvm_ffi
from one_op import one_op_module
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_ext import cli, driver, pipeline
from tvm_ext.ir.pass_records import LIBRARY_ATTR
from tvm_ext.passes import DispatchLibraryKernels
from tvm_ext.passes.dispatch_library import packed_function
from tvm_ext.runtime import library
from tvm_ext.runtime.distributed import Session

GEMM, CONV = "tvm_ext.blas.gemm", "tvm_ext.blas.conv2d"


@contextlib.contextmanager
def counted_library_calls():
    """Counts calls of the library functions by modules built (and first run) inside."""
    library.load_library()
    counts: Counter = Counter()
    originals = {name: tvm_ffi.get_global_func(name) for name in (GEMM, CONV)}

    def counting(name):
        def call(*args):
            counts[name] += 1
            return originals[name](*args)
        return call

    for name in originals:
        tvm_ffi.register_global_func(name, counting(name), override=True)
    try:
        yield counts
    finally:
        for name, func in originals.items():
            tvm_ffi.register_global_func(name, func, override=True)


def dispatched_kernels(mod: tvm.IRModule, target, **options) -> dict[str, list[str]]:
    staged = pipeline.run_phases(mod, target, through="library_kernels", inclusive=True,
                                 **options)
    return {gv.name_hint: list(f.attrs[LIBRARY_ATTR]) for gv, f in staged.functions.items()
            if isinstance(f, tirx.PrimFunc) and f.attrs is not None and LIBRARY_ATTR in f.attrs}


def run_model(model, target, **options):
    args = model.random_arguments(0)
    return driver.run(driver.build(model, target, **options), args, tvm.cpu(), repeat=0).outputs


@pytest.mark.parametrize("name, calls", [("gpt", {GEMM}), ("resnet", {GEMM, CONV})])
def test_models_call_the_library_and_match_generated_code(name, calls, zoo_cache, llvm):
    model = zoo_cache(name)
    with counted_library_calls() as counts:
        ours = run_model(model, llvm)
    assert set(counts) == calls
    assert set().union(*dispatched_kernels(model.mod, llvm).values()) == calls
    with counted_library_calls() as counts:
        generated = run_model(model, llvm, library=False)
    assert not counts
    assert dispatched_kernels(model.mod, llvm, library=False) == {}
    driver.compare(ours, generated, rtol=1e-4, atol=1e-5)


def test_training_step_dispatches_its_gradient_gemms(zoo_cache, llvm):
    inference, training = zoo_cache("mlp"), zoo_cache("mlp", training=True)
    with counted_library_calls() as forward:
        run_model(inference, llvm)
    with counted_library_calls() as step:
        ours = run_model(training, llvm)
    # Each layer's forward GEMM, plus the weight and input gradients.
    assert step[GEMM] >= 2 * forward[GEMM]
    driver.compare(ours, run_model(training, llvm, library=False), rtol=1e-4, atol=1e-5)


def test_partitioned_build_dispatches_each_chunk_and_matches(zoo_cache, llvm):
    model = zoo_cache("gpt")
    args = model.random_arguments(0)
    plain = run_model(model, llvm)
    with counted_library_calls() as counts:
        build = driver.build_partitioned(model, llvm, 2)
        with Session(2) as sess:
            result = driver.run_partitioned_build(sess, build, args)
    assert counts[GEMM] > 0
    driver.compare(result.outputs, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.sweep  # test_swap_offload's library cases run dispatched kernels in chunks
def test_swapped_build_with_dispatch_is_exact_and_within_budget(tmp_path):
    report = tmp_path / "report.json"
    with counted_library_calls() as counts:
        status = cli.main(["gpt", "--target", "llvm", "--device-memory", "50%", "--run",
                           "--check", "--report", str(report)])
    assert status == 0
    assert counts[GEMM] > 0
    data = json.loads(report.read_text())
    assert data["run"]["measured_peak_bytes"] <= data["run"]["budget_bytes"]


def _matmul_module(shape_a, shape_b, dtype="float32") -> tvm.IRModule:
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(shape_a, dtype))
    b = relax.Var("b", relax.TensorType(shape_b, dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.gelu(relax.op.matmul(a, b)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("shape_a, shape_b", [
    ((8, 16), (16, 4)),
    ((2, 3, 8, 16), (16, 4)),  # leading dims merged into M
    ((1, 8, 16), (3, 16, 4)),  # A broadcast over the batch
    ((2, 3, 8, 16), (2, 3, 16, 4)),
])
def test_gemm_layouts_match_numpy(shape_a, shape_b, llvm):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(shape_a).astype("float32")
    b = rng.standard_normal(shape_b).astype("float32")
    mod = _matmul_module(shape_a, shape_b)
    assert dispatched_kernels(mod, llvm)
    outputs = []
    for use_library in (True, False):
        with llvm:
            ex = tvm.compile(mod, llvm, relax_pipeline=relax.get_pipeline(
                "tvm_ext", target=llvm, library=use_library))
        vm = relax.VirtualMachine(ex, tvm.cpu())
        outputs.append(vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy())
    x = (a.astype("float64") @ b.astype("float64"))
    gelu = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    np.testing.assert_allclose(outputs[0], gelu, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padding, strides, groups", [(0, 5, 1), (4, 1, 4)])
def test_conv1d_calls_the_library_and_matches_generated_code(padding, strides, groups, llvm):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 50)).astype("float32")
    w = rng.standard_normal((16, 8 // groups, 10)).astype("float32")
    bb = relax.BlockBuilder()
    xv, wv = (relax.Var(n, relax.TensorType(a.shape, "float32")) for n, a in (("x", x), ("w", w)))
    with bb.function("main", [xv, wv]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.conv1d(xv, wv, strides=strides, padding=padding,
                                                    groups=groups))
        bb.emit_func_output(out)
    mod = bb.get()
    assert set().union(*dispatched_kernels(mod, llvm).values()) == {CONV}
    outputs = []
    for use_library in (True, False):
        with counted_library_calls() as counts, llvm:
            ex = tvm.compile(mod, llvm, relax_pipeline=relax.get_pipeline(
                "tvm_ext", target=llvm, library=use_library))
            vm = relax.VirtualMachine(ex, tvm.cpu())
            outputs.append(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy())
        assert counts[CONV] == (1 if use_library else 0)
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build, shapes", [
    (lambda x, w: relax.op.nn.conv1d_transpose(x, w, strides=2, groups=2),
     [(2, 8, 20), (8, 3, 4)]),
    (lambda x, w: relax.op.nn.conv2d_transpose(x, w, strides=2, padding=1),
     [(2, 4, 9, 9), (4, 6, 3, 3)]),
])
def test_transposed_convolutions_call_the_library_and_match(build, shapes, llvm):
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32") for s in shapes]
    mod = one_op_module(build, *shapes)
    assert CONV in set().union(*dispatched_kernels(mod, llvm).values())
    outputs = []
    for use_library in (True, False):
        with llvm:
            ex = tvm.compile(mod, llvm, relax_pipeline=relax.get_pipeline(
                "tvm_ext", target=llvm, library=use_library))
        vm = relax.VirtualMachine(ex, tvm.cpu())
        outputs.append(vm["main"](*(tvm.runtime.tensor(a) for a in args)).numpy())
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.sweep  # test_cuda_convolutions_are_gemms_over_their_column_matrix: the same step
def test_conv_training_step_dispatches_every_convolution(zoo_cache, llvm):
    """Forward, data-gradient and weight-gradient convolutions all call the library."""
    model = zoo_cache("resnet", training=True)
    staged = pipeline.run_phases(model.mod, llvm, through="library_kernels", inclusive=True)
    convs = {gv.name_hint: LIBRARY_ATTR in (f.attrs or {}) for gv, f in staged.functions.items()
             if isinstance(f, tirx.PrimFunc) and "conv" in gv.name_hint}
    assert convs and all(convs.values()), convs
    driver.compare(run_model(model, llvm), run_model(model, llvm, library=False), rtol=1e-4,
                   atol=1e-5)


def test_target_support():
    llvm = tvm.target.Target("llvm")
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    from tvm_ext.ir.library_kernels import LibraryCall

    def call(kind, *dtypes):
        return LibraryCall(kind, 0, "b", (None, None, None), dtypes)

    assert packed_function(call("gemm", *["float32"] * 3), llvm) == GEMM
    assert packed_function(call("conv2d", *["float64"] * 3), llvm) == CONV
    assert packed_function(call("gemm", "float16", "float16", "float16"), llvm) is None
    assert packed_function(call("gemm", "float16", "float16", "float32"), cuda) == \
        "tvm_ext.cublas.gemm"
    assert packed_function(call("conv2d", *["float32"] * 3), cuda) == "tvm_ext.cublas.gemm"
    assert packed_function(call("conv2d", "float32", "float16", "float32"), cuda) is None


def _cuda_conv_module(name: str, zoo_cache) -> tvm.IRModule:
    if name == "resnet_training":
        return zoo_cache("resnet", training=True).mod
    if name == "conv1d_grouped":
        return one_op_module(lambda x, w: relax.op.nn.conv1d(x, w, strides=2, padding=3,
                                                             groups=4), (2, 8, 40), (16, 2, 5))
    return one_op_module(lambda x, w: relax.op.nn.conv2d_transpose(x, w, strides=2, padding=1),
                         (2, 4, 9, 9), (4, 6, 3, 3))


@pytest.mark.parametrize("name", ["resnet_training", "conv1d_grouped", "conv2d_transpose"])
@pytest.mark.parametrize("cudnn", [False, True])
def test_cuda_convolutions_call_cudnn_or_are_gemms_over_their_column_matrix(name, cudnn,
                                                                            zoo_cache):
    """On CUDA a convolution is a cuDNN call, or (`cudnn=False`) a gathered column matrix and
    one cuBLAS GEMM: run on the CPU (each library call by the CPU library's function of the
    same arguments), every dispatched kernel leaves its buffers as the generated convolution
    does (forward, data and weight gradients, groups, 1-D, transposed)."""
    from gpu_emulation import differing

    cuda = driver.resolve_target("cuda")
    fused = pipeline.fuse(_cuda_conv_module(name, zoo_cache), cuda)
    with cuda:
        dispatched = DispatchLibraryKernels(cudnn=cudnn)(
            tvm.IRModule(dict(fused.functions_items())))
    marker = "tvm_ext.cudnn.conv2d" if cudnn else "_col"
    names = [gv.name_hint for gv, f in dispatched.functions_items()
             if isinstance(f, tirx.PrimFunc) and marker in f.script()]
    assert len(names) >= (10 if name == "resnet_training" else 1), names
    if cudnn:  # no convolution left to the column matrix: every window is within its data
        assert not any("_col" in f.script() for f in dispatched.functions.values()
                       if isinstance(f, tirx.PrimFunc))
    assert differing(fused, dispatched, names, rtol=1e-4, atol=1e-5) == []


def test_a_window_past_the_data_keeps_the_column_matrix():
    """cuDNN pads symmetrically: a convolution whose last windows read zeros past the data's
    far edge (here strided so that the padded input's last row is never read, and with one
    row short) is a GEMM over its column matrix."""
    from tvm_ext.ir.library_kernels import find_library_calls

    cuda = driver.resolve_target("cuda")
    mod = one_op_module(lambda x, w: relax.op.nn.conv2d(x, w, strides=2, padding=1),
                        (1, 4, 8, 8), (6, 4, 3, 3))
    fused = pipeline.fuse(mod, cuda)
    calls = [c for f in fused.functions.values() if isinstance(f, tirx.PrimFunc)
             for c in find_library_calls(f)]
    assert calls and all(packed_function(c, cuda) == "tvm_ext.cudnn.conv2d" for c in calls)
    short = dataclasses.replace(calls[0], operands=(
        tirx.decl_buffer((1, 4, 8, 8), "float32"), *calls[0].operands[1:]))
    assert packed_function(short, cuda) == "tvm_ext.cublas.gemm"


def test_cuda_build_calls_cublas_from_host_code(zoo_cache):
    cuda = driver.resolve_target("cuda")
    model = zoo_cache("gpt")
    assert set().union(*dispatched_kernels(model.mod, cuda).values()) == {"tvm_ext.cublas.gemm"}
    scheduled = pipeline.scheduled_module(model.mod, cuda, None)
    funcs = [f for f in scheduled.functions.values()
             if isinstance(f, tirx.PrimFunc) and LIBRARY_ATTR in (f.attrs or {})]
    assert funcs and all(f.attrs["tirx.is_scheduled"] for f in funcs)
    driver.build(model, cuda)  # host code with the cuBLAS calls, device code for the rest


def test_pass_leaves_scheduled_kernels_alone(llvm):
    mod = pipeline.fuse(_matmul_module((8, 16), (16, 4)), llvm)
    marked = tvm.IRModule({gv: (f.with_attr("tirx.is_scheduled", True)
                                if isinstance(f, tirx.PrimFunc) else f)
                           for gv, f in mod.functions.items()})
    with llvm:
        out = DispatchLibraryKernels()(marked)
    tvm.ir.assert_structural_equal(out, marked)


@I.ir_module
class GemmReluBefore:
    @T.prim_func(private=True, s_tir=True)
    def matmul_relu(a: T.Buffer((4, 8), "float32"), b: T.Buffer((8, 2), "float32"),
                    out: T.Buffer((4, 2), "float32")):
        c = T.sblock_alloc_buffer((4, 2), "float32")
        for i, j, k in T.grid(4, 2, 8):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]
        for i, j in T.grid(4, 2):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = T.max(c[vi, vj], T.float32(0))

    @R.function
    def main(a: R.Tensor((4, 8), "float32"), b: R.Tensor((8, 2), "float32")):
        cls = GemmReluBefore
        with R.dataflow():
            y = R.call_tir(cls.matmul_relu, (a, b), out_ty=R.Tensor((4, 2), "float32"))
            R.output(y)
        return y


@I.ir_module
class GemmReluExpected:
    @T.prim_func(private=True, s_tir=True)
    def matmul_relu(a: T.Buffer((4, 8), "float32"), b: T.Buffer((8, 2), "float32"),
                    out: T.Buffer((4, 2), "float32")):
        T.func_attr({"tvm_ext.library": ["tvm_ext.blas.gemm"]})
        c = T.sblock_alloc_buffer((4, 2), "float32")
        # The GEMM nest is one library call on the whole buffers; after the three arrays, each
        # operand's axes by role (count, then 0 = M, 1 = N, 2 = K): a (M, K), b (K, N), c (M, N).
        with T.sblock("tvm_ext_library_matmul"):
            T.reads(a[0:4, 0:8], b[0:8, 0:2])
            T.writes(c[0:4, 0:2])
            T.call_packed(
                "tvm_ext.blas.gemm",
                T.tvm_stack_make_array(a.data, T.tvm_stack_make_shape(4, 8), 0, 2,
                                       T.float32(0), 0),
                T.tvm_stack_make_array(b.data, T.tvm_stack_make_shape(8, 2), 0, 2,
                                       T.float32(0), 0),
                T.tvm_stack_make_array(c.data, T.tvm_stack_make_shape(4, 2), 0, 2,
                                       T.float32(0), 0),
                2, 0, 2, 2, 2, 1, 2, 0, 1)
        # The epilogue stays generated code, scheduled later as any other nest.
        for i, j in T.grid(4, 2):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = T.max(c[vi, vj], T.float32(0))

    @R.function
    def main(a: R.Tensor((4, 8), "float32"), b: R.Tensor((8, 2), "float32")):
        cls = GemmReluExpected
        with R.dataflow():
            y = R.call_tir(cls.matmul_relu, (a, b), out_ty=R.Tensor((4, 2), "float32"))
            R.output(y)
        return y


def test_golden_a_gemm_nest_becomes_a_library_call(llvm):
    after = DispatchLibraryKernels(llvm)(GemmReluBefore)
    tvm.ir.assert_structural_equal(after, GemmReluExpected)
    tvm.ir.assert_structural_equal(DispatchLibraryKernels(llvm)(after), after)  # idempotent


def test_golden_without_a_target_is_refused():
    with pytest.raises(ValueError, match="needs a target"):
        DispatchLibraryKernels()(GemmReluBefore)
