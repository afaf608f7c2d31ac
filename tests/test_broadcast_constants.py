"""BroadcastConstants: constants passed at their distinct extent compute the same bits, in less
memory, and kernels that cannot read them so keep them whole."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from tvm_ext import pipeline
from tvm_ext.ir.broadcast_constants import BroadcastError, broadcast_param, distinct_extent
from tvm_ext.ir.graph_builder import build_graph
from tvm_ext.passes import BroadcastConstants

LLVM = tvm.target.Target("llvm")


def test_distinct_extent_cuts_only_axes_that_repeat_bit_for_bit():
    mask = np.zeros((4, 1, 8, 8), "float32")
    mask[..., np.triu_indices(8, 1)[0], np.triu_indices(8, 1)[1]] = -np.inf
    assert distinct_extent(mask).shape == (1, 1, 8, 8)
    assert distinct_extent(np.full((3, 5), 0.25, "float32")).shape == (1, 1)
    varied = np.arange(12, dtype="int32").reshape(3, 4)
    assert distinct_extent(varied).shape == (3, 4)
    # 0.0 and -0.0 compare equal but are different bits: x + 0.0 and x + -0.0 differ at -0.0.
    signed = np.array([[0.0, -0.0]], "float32")
    assert distinct_extent(signed).shape == (1, 2)
    assert distinct_extent(np.array([True, True])).shape == (1,)
    assert distinct_extent(np.array(2.0, "float32")).shape == ()  # a scalar stays 0-d


def _model(consts: list[np.ndarray]) -> tvm.IRModule:
    """x * c0 + c1 (+ c2 ...), fused into one kernel."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = relax.op.multiply(x, relax.const(consts[0]))
            for c in consts[1:]:
                y = relax.op.add(y, relax.const(c))
            out = bb.emit_output(bb.emit(y))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod: tvm.IRModule, x: np.ndarray, broadcast: bool = True) -> np.ndarray:
    """`mod` compiled by the tvm_ext pipeline (without BroadcastConstants: `broadcast=False`)
    and run on `x`."""
    passes = [p for _, phase in pipeline.phases(LLVM) for p in phase
              if broadcast or not isinstance(p, BroadcastConstants)]
    with LLVM:
        ex = tvm.compile(mod, LLVM, relax_pipeline=tvm.transform.Sequential(passes))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _constant_bytes(mod: tvm.IRModule) -> int:
    graph = build_graph(mod)
    return graph.bytes_of_kind("constant")


def test_repeated_and_uniform_constants_shrink_and_compute_the_same_bits():
    rng = np.random.default_rng(0)
    scale = np.full((4, 4, 8), 0.5, "float32")  # one value: a literal
    row = rng.standard_normal((1, 1, 8)).astype("float32")
    bias = np.broadcast_to(row, (4, 1, 8)).copy()  # repeated over the batch
    mod = _model([scale, bias])
    fused = pipeline.fuse(mod, LLVM)
    graph = build_graph(fused)
    consts = [t for t in graph.tensors if t.kind == "constant"]
    assert [t.shape for t in consts] == [(1, 1, 8)]
    kernel = next(f for gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc))
    assert "T.float32(0.5)" in kernel.script()
    x = rng.standard_normal((4, 4, 8)).astype("float32")
    got = _run(mod, x)
    # The pipeline without the pass: same bits.
    without = tvm.transform.Sequential([p for p in pipeline.legalize_passes(LLVM)
                                        if not isinstance(p, BroadcastConstants)])
    with LLVM:
        plain = without(mod)
    assert _constant_bytes(plain) == scale.nbytes + bias.nbytes
    assert np.array_equal(got, x * scale + bias)
    assert np.array_equal(got, _run(mod, x, broadcast=False))


def test_a_kernel_reading_a_constant_twice_keeps_one_copy_per_rewrite():
    """Two calls of one kernel with the same repeated constant share one rewritten kernel."""
    c = np.full((4, 4, 8), 2.0, "float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.multiply(x, relax.const(c)))
            b = bb.emit(relax.op.multiply(relax.op.tanh(a), relax.const(c)))
            out = bb.emit_output(b)
        bb.emit_func_output(out)
    mod = bb.get()
    fused = pipeline.fuse(mod, LLVM)
    assert _constant_bytes(fused) == 0
    x_np = np.random.default_rng(1).standard_normal((4, 4, 8)).astype("float32")
    np.testing.assert_array_equal(_run(mod, x_np), _run(mod, x_np, broadcast=False))


@T.prim_func(private=True, s_tir=True)
def _writes_param(a: T.Buffer((4,), "float32"), out: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("w"):
            vi = T.axis.spatial(4, i)
            a[vi] = T.float32(1)
            out[vi] = a[vi]


def test_a_parameter_the_kernel_writes_is_refused():
    with pytest.raises(BroadcastError, match="writes it"):
        broadcast_param(_writes_param, 0, np.ones((1,), "float32"))


def test_a_shape_that_is_not_a_cut_of_the_parameter_is_refused():
    with pytest.raises(BroadcastError, match="cannot read"):
        broadcast_param(_writes_param, 0, np.ones((2,), "float32"))


def test_an_integer_constant_keeps_its_dtype():
    """int64 indices repeated over the batch (a gather's): passed at (1, 8), still int64."""
    idx = np.broadcast_to(np.array([[3, 1, 4, 1, 5, 9, 2, 6]], "int64"), (4, 8)).copy()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "int64"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.add(x, relax.const(idx, "int64"))))
        bb.emit_func_output(out)
    mod = bb.get()
    graph = build_graph(pipeline.fuse(mod, LLVM))
    consts = [t for t in graph.tensors if t.kind == "constant"]
    assert [(t.shape, t.dtype) for t in consts] == [((1, 8), "int64")]
    x_np = np.arange(32, dtype="int64").reshape(4, 8)
    np.testing.assert_array_equal(_run(mod, x_np), x_np + idx)
