"""StaticKernelCalls: a generic kernel (symbolic buffer extents, as TVM's GPU scan) gets a copy
per call shape, a builtin reshape becomes a view, the bits stay; the planners then read a
model whose `cumsum` the CUDA target dispatches to the GPU scan (RoBERTa's position ids)."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_ext import driver, pipeline
from tvm_ext.graph import GraphBuildError
from tvm_ext.ir.graph_builder import build_graph
from tvm_ext.ir.kernel_cost import has_symbolic_buffers
from tvm_ext.ir.kernel_dims import kernel_spec
from tvm_ext.models.torch_import import import_exported_program
from tvm_ext.passes import StaticKernelCalls

LLVM = tvm.target.Target("llvm")
# Planning reads the CUDA target's kernels; only the compile needs nvcc (`cuda_target`).
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


@I.ir_module
class _TwoShapes:
    @T.prim_func(private=True, s_tir=True)
    def add_one(a: T.handle, b: T.handle):
        m = T.int64()
        n = T.int64()
        A = T.match_buffer(a, (m, n), "float32")
        B = T.match_buffer(b, (m, n), "float32")
        for i, j in T.grid(m, n):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, vj] + T.float32(1)

    @R.function
    def main(x: R.Tensor((2, 6), "float32"), y: R.Tensor((3, 4), "float32")):
        cls = _TwoShapes
        with R.dataflow():
            a = R.call_tir(cls.add_one, (x,), out_ty=R.Tensor((2, 6), "float32"))
            b = R.call_tir(cls.add_one, (y,), out_ty=R.Tensor((3, 4), "float32"))
            c = R.call_tir(cls.add_one, (a,), out_ty=R.Tensor((2, 6), "float32"))
            d = R.call_pure_packed("vm.builtin.reshape", b, R.shape([4, 3]),
                                   ty_args=(R.Tensor((4, 3), "float32"),))
            R.output(c, d)
        return (c, d)


def _kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _run(mod, args):
    with LLVM:
        ex = tvm.compile(mod, LLVM)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    return [o.numpy() for o in out]


def test_each_call_shape_gets_its_own_static_copy_and_the_bits_stay():
    mod = _TwoShapes
    assert has_symbolic_buffers(mod["add_one"])
    out = StaticKernelCalls()(mod)
    kernels = _kernels(out)
    # One copy per distinct shape (the two (2, 6) calls share one), the generic one gone.
    assert sorted(kernels) == ["add_one_2x6_2x6", "add_one_3x4_3x4"]
    assert not any(has_symbolic_buffers(f) for f in kernels.values())
    assert [tuple(int(d) for d in p.shape) for p in kernels["add_one_3x4_3x4"].params] == \
        [(3, 4), (3, 4)]
    script = out["main"].script()
    assert "vm.builtin.reshape" not in script and "R.reshape(" in script
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((2, 6), np.float32), rng.standard_normal((3, 4), np.float32)]
    for got, want in zip(_run(out, args), _run(mod, args), strict=True):
        np.testing.assert_array_equal(got, want)
    # The planners read it: three kernels and a view.
    graph = build_graph(out)
    assert [op.kind for op in graph.ops].count("kernel") == 3


def test_a_generic_kernel_left_is_refused_by_name_and_read_whole_by_the_partition_analysis():
    with pytest.raises(GraphBuildError, match=r"add_one has symbolic buffer extents.*"
                                               r"StaticKernelCalls"):
        build_graph(_TwoShapes)
    spec = kernel_spec(_TwoShapes["add_one"], 1, "add_one")
    assert spec.opaque and any("symbolic extent" in note for note in spec.notes)


def _cumsum_module() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 16), "int64"))
    y = relax.Var("y", relax.TensorType((3, 8), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(relax.op.cumsum(x, axis=1))
            b = bb.emit(relax.op.cumsum(y, axis=1))
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    return bb.get()


def test_the_gpu_scan_of_two_shapes_is_read_by_the_planners_and_compiles_for_cuda(cuda_target):
    mod = _cumsum_module()
    with CUDA:
        dispatched = tvm.transform.Sequential(pipeline.library_dispatch_passes(CUDA))(mod)
        legal = relax.transform.LegalizeOps()(dispatched)
    # TVM's GPU scan is one generic kernel for both calls; the planners need one per shape.
    assert any(has_symbolic_buffers(f) for f in _kernels(legal).values())
    fused = pipeline.fuse(mod, CUDA)
    assert not any(has_symbolic_buffers(f) for f in _kernels(fused).values())
    graph = build_graph(fused)
    scans = [op for op in graph.ops if op.kind == "kernel"]
    assert len(scans) == 2 and all(op.bytes_moved > 0 for op in scans)
    with cuda_target:
        tvm.compile(mod, cuda_target,
                    relax_pipeline=relax.get_pipeline("tvm_ext", target=cuda_target))


class _PositionIds(torch.nn.Module):
    """RoBERTa's position ids: the running count of non-padding tokens, then an embedding."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(18, 8)

    def forward(self, ids):
        mask = ids.ne(1).int()
        pos = torch.cumsum(mask, dim=1).type_as(mask) * mask + 1
        return self.emb(pos.long())


def test_a_model_with_position_ids_from_cumsum_plans_for_cuda():
    ids = torch.randint(0, 18, (2, 16))
    mod, _ = import_exported_program(torch.export.export(_PositionIds().eval(), (ids,)))
    graph = driver.fused_graph(mod, CUDA)
    kernels = [op for op in graph.ops if op.kind == "kernel"]
    assert any("cumsum" in op.kernel for op in kernels)
    # The reshapes around the scan are views: no copy, no kernel.
    assert all(op.kind in ("kernel", "view") for op in graph.ops)
