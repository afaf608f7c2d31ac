"""DropUnreadKernelInputs: a kernel argument the kernel never reads leaves the call and the
kernel's signature; the module computes the same bits; kernels it cannot rewrite stay whole."""

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_ext import pipeline
from tvm_ext.ir.graph_builder import build_graph
from tvm_ext.ir.unread_params import unread_params
from tvm_ext.passes import DropUnreadKernelInputs

LLVM = tvm.target.Target("llvm")


def _embedding_gradient() -> tvm.IRModule:
    """The gradient of an embedding lookup: `take_backward` is passed the table for its shape."""
    bb = relax.BlockBuilder()
    grad = relax.Var("grad", relax.TensorType((6, 4), "float32"))
    table = relax.Var("table", relax.TensorType((10, 4), "float32"))
    ids = relax.Var("ids", relax.TensorType((6,), "int32"))
    with bb.function("main", [grad, table, ids]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.take_backward(grad, table, ids, axis=0))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod: tvm.IRModule, args, drop: bool = True) -> np.ndarray:
    passes = [p for _, phase in pipeline.phases(LLVM) for p in phase
              if drop or not isinstance(p, DropUnreadKernelInputs)]
    with LLVM:
        ex = tvm.compile(mod, LLVM, relax_pipeline=tvm.transform.Sequential(passes))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _kernels(mod: tvm.IRModule) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def test_the_embedding_table_leaves_its_gradients_kernel_and_the_bits_stay():
    mod = _embedding_gradient()
    without = tvm.transform.Sequential([p for p in pipeline.legalize_passes(LLVM)
                                        if not isinstance(p, DropUnreadKernelInputs)])
    with LLVM:
        before = without(mod)
    (name, kernel), = _kernels(before).items()
    assert unread_params(kernel) == [1]  # (grad, table, ids, out): the table is never read
    fused = pipeline.fuse(mod, LLVM)
    assert len(_kernels(fused)[name].params) == 3  # kept its name, lost the table
    assert all(not unread_params(f) for f in _kernels(fused).values())
    # The planners' graph: the gradient op no longer needs the table.
    (op,) = [o for o in build_graph(fused).ops if o.kind == "kernel"]
    (op_before,) = [o for o in build_graph(before).ops if o.kind == "kernel"]
    assert len(op.inputs) == len(op_before.inputs) - 1
    rng = np.random.default_rng(0)
    grad = rng.standard_normal((6, 4)).astype("float32")
    table = rng.standard_normal((10, 4)).astype("float32")
    ids = np.array([1, 3, 1, 9, 0, 3], "int32")
    got = _run(mod, [grad, table, ids])
    expected = np.zeros((10, 4), "float32")
    np.add.at(expected, ids, grad)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert np.array_equal(got, _run(mod, [grad, table, ids], drop=False))


def test_running_it_again_changes_nothing():
    once = pipeline.fuse(_embedding_gradient(), LLVM)
    tvm.ir.assert_structural_equal(DropUnreadKernelInputs()(once), once)


@T.prim_func(private=True, s_tir=True)
def _reads_a(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"),
             out: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("copy"):
            vi = T.axis.spatial(4, i)
            out[vi] = a[vi]


@T.prim_func(private=True, s_tir=True)
def _names_b_in_a_region(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"),
                         out: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("copy"):
            vi = T.axis.spatial(4, i)
            T.reads(a[vi], b[vi])
            T.writes(out[vi])
            out[vi] = a[vi]


@T.prim_func(private=True, s_tir=True)
def _writes_b(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"),
              out: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("copy"):
            vi = T.axis.spatial(4, i)
            b[vi] = a[vi]
            out[vi] = a[vi]


def test_only_parameters_the_body_never_names_are_unread():
    assert unread_params(_reads_a) == [1]
    assert unread_params(_names_b_in_a_region) == []  # a declared read keeps it
    assert unread_params(_writes_b) == []


@T.prim_func(private=True, s_tir=True)
def _doubles_a_in_place(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("double"):
            vi = T.axis.spatial(4, i)
            a[vi] = a[vi] * T.float32(2)


def _calling(kernel, inplace: bool) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((4,), "float32"))
    b = relax.Var("b", relax.TensorType((4,), "float32"))
    with bb.function("main", [a, b]):
        gv = bb.add_func(kernel, "copy")
        with bb.dataflow():
            if inplace:  # the output is `a`'s buffer: positions count in the call
                call = relax.call_tir_inplace(gv, (a, b), inplace_indices=[0],
                                              out_ty=relax.TensorType((4,), "float32"))
            else:
                call = relax.call_tir(gv, (a, b), relax.TensorType((4,), "float32"))
            out = bb.emit_output(bb.emit(call))
        bb.emit_func_output(out)
    return bb.get()


def test_a_kernel_called_in_place_keeps_its_signature():
    dropped = DropUnreadKernelInputs()(_calling(_reads_a, inplace=False))
    assert len(dropped["copy"].params) == 2
    assert unread_params(_doubles_a_in_place) == [1]
    kept = _calling(_doubles_a_in_place, inplace=True)
    tvm.ir.assert_structural_equal(DropUnreadKernelInputs()(kept), kept)


@I.ir_module
class Before:
    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((8,), "float32"), shape_only: T.Buffer((8,), "float32"),
              y: T.Buffer((8,), "float32")):
        for i in range(8):
            with T.sblock("y"):
                vi = T.axis.spatial(8, i)
                y[vi] = x[vi] * T.float32(2)

    @R.function
    def main(x: R.Tensor((8,), "float32"), w: R.Tensor((8,), "float32")):
        cls = Before
        with R.dataflow():
            y = R.call_tir(cls.scale, (x, w), out_ty=R.Tensor((8,), "float32"))
            R.output(y)
        return y


@I.ir_module
class Expected:
    # The parameter the body never names leaves the kernel (which keeps its name) and the call;
    # `main` keeps its own parameter.
    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
        for i in range(8):
            with T.sblock("y"):
                vi = T.axis.spatial(8, i)
                y[vi] = x[vi] * T.float32(2)

    @R.function
    def main(x: R.Tensor((8,), "float32"), w: R.Tensor((8,), "float32")):
        cls = Expected
        with R.dataflow():
            y = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((8,), "float32"))
            R.output(y)
        return y


def test_golden_an_unread_input_leaves_the_kernel_and_its_call():
    after = DropUnreadKernelInputs()(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    tvm.ir.assert_structural_equal(DropUnreadKernelInputs()(after), after)  # idempotent
