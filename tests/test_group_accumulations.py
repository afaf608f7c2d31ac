"""GroupAccumulations: in a sum of three or more products each product is fused with the add
that takes it, so no kernel waits for all of them; the module computes the same bits; a sum of
two products, or a product read twice, is left to FuseOps."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvm_ext import driver, pipeline
from tvm_ext.ir.graph_builder import build_graph
from tvm_ext.models import chunked_loss, get_model, make_training_step
from tvm_ext.passes import group_accumulations

LLVM = tvm.target.Target("llvm")


def _sum_of_products(terms: int, reuse: bool = False) -> tvm.IRModule:
    """main(x, w0..w{terms-1}) = x @ w0 + x @ w1 + ...; `reuse`: the last product also leaves
    as a second output."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 16), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType((16, 32), "float32")) for i in range(terms)]
    with bb.function("main", [x, *ws]):
        with bb.dataflow():
            # in the order relax.transform.Gradient sums a weight's gradients: each product
            # added as soon as it is made
            total = product = bb.emit(relax.op.matmul(x, ws[0]))
            for w in ws[1:]:
                product = bb.emit(relax.op.matmul(x, w))
                total = bb.emit(relax.op.add(total, product))
            out = bb.emit_output(relax.Tuple([total, product]) if reuse else total)
        bb.emit_func_output(out)
    return bb.get()


def _fused(mod: tvm.IRModule, group: bool = True) -> tvm.IRModule:
    passes = [p for p in pipeline.legalize_passes(LLVM)
              if group or not isinstance(p, group_accumulations.GroupAccumulations)]
    with LLVM:
        return tvm.transform.Sequential(passes)(mod)


def _kernels(mod: tvm.IRModule) -> list[str]:
    return sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc))


def _run(mod: tvm.IRModule, args, group: bool = True):
    passes = [p for _, phase in pipeline.phases(LLVM) for p in phase
              if group or not isinstance(p, group_accumulations.GroupAccumulations)]
    with LLVM:
        ex = tvm.compile(mod, LLVM, relax_pipeline=tvm.transform.Sequential(passes))
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    return out.numpy()


def _grouped_calls(mod: tvm.IRModule) -> list[str]:
    """The names of the functions `main` calls after GroupAccumulations (before FuseOps)."""
    with LLVM:
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                        relax.transform.AnnotateTIROpPattern(),
                                        group_accumulations.GroupAccumulations()])(mod)
    names = []
    for binding in mod["main"].body.blocks[0].bindings:
        value = binding.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
            assert mod[value.op].attrs["Primitive"]
            names.append(value.op.name_hint)
    return names


def test_each_product_runs_with_its_add_and_the_bits_stay():
    mod = _sum_of_products(4)
    assert _grouped_calls(mod) == ["fused_matmul_add"] * 3  # the first product stays alone
    assert _kernels(_fused(mod)) == ["fused_matmul_add", "matmul"]
    graph = build_graph(_fused(mod))
    kernels = [op for op in graph.ops if op.kind == "kernel"]
    assert len(kernels) == 4 and max(len(op.inputs) for op in kernels) == 3  # x, w, the sum
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((8, 16), dtype=np.float32),
            *[rng.standard_normal((16, 32), dtype=np.float32) for _ in range(4)]]
    np.testing.assert_array_equal(_run(mod, args), _run(mod, args, group=False))


@pytest.mark.parametrize("terms, reuse", [(2, False), (3, True)])
def test_left_to_fuse_ops(terms, reuse):
    """Two products make no chain; a product read elsewhere cannot live inside a kernel."""
    mod = _sum_of_products(terms, reuse)
    assert _grouped_calls(mod) == []
    assert _kernels(_fused(mod)) == _kernels(_fused(mod, group=False))


def test_a_chunked_heads_gradients_are_never_all_live(monkeypatch):
    """The zoo gpt's step with its head in four chunks of tokens: the head's gradient is a
    sum of four products, of which no kernel reads more than the running sum and one."""
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 2 * 16 * 64 * 4 // 4)
    step = make_training_step(get_model("gpt", "tiny"))
    grouped = driver.fused_graph(step, LLVM)
    monkeypatch.setattr(group_accumulations, "_pairs", lambda *_: {})
    plain = driver.fused_graph(step, LLVM)

    shape = (32, 64)  # the head's weight transposed, as its gradient is summed

    def head_partials_read(graph) -> int:
        return max(sum(1 for t in op.inputs if tuple(graph.tensors[t].shape) == shape)
                   for op in graph.ops)

    def head_partials_live(graph) -> int:
        start, end = graph.lifetimes()
        spans = [(start[t.id], end[t.id]) for t in graph.tensors
                 if tuple(t.shape) == shape and t.kind == "gradient" and t.alias_of is None]
        return max(sum(1 for a, b in spans if a <= step <= b) for step in range(graph.num_ops))

    assert head_partials_read(plain) == 3 and head_partials_live(plain) == 4
    assert head_partials_read(grouped) == 1 and head_partials_live(grouped) == 2
