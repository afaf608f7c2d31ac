"""DataflowGraph: structure, FLOPs and bytes from TIR, peaks by hand arithmetic and against the
measured peak of real builds."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from tvm_ext import driver, runtime
from tvm_ext.graph import DataflowGraph, GraphBuildError
from tvm_ext.ir.graph_builder import build_graph
from tvm_ext.ir.time_splits import annotate_time_splits
from tvm_ext.models import Model, TensorSpec


@tvm.script.ir_module
class TwoLayer:
    @R.function
    def main(
        x: R.Tensor((4, 8), "float32"),
        w1: R.Tensor((8, 16), "float32"),
        w2: R.Tensor((16, 4), "float32"),
    ):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.nn.relu(R.matmul(x, w1))
            y = R.matmul(h, w2)
            R.output(y)
        return y


def _two_layer_model() -> Model:
    specs = [TensorSpec("x", (4, 8)), TensorSpec("w1", (8, 16)), TensorSpec("w2", (16, 4))]
    return Model("two_layer", TwoLayer, specs[:1], specs[1:])


def test_two_layer_graph_by_hand(llvm):
    """FuseOps makes two kernels: fused matmul+relu (a (4,16) scratch for the matmul result
    before relu) and matmul.

    bytes: x 4*8*4 = 128, w1 8*16*4 = 512, w2 16*4*4 = 256 (arguments, 896 resident);
           h 4*16*4 = 256, y 4*4*4 = 64, scratch 256.
    flops: matmul 2*4*16*8 = 1024, relu 4*16 = 64 (the max in the fused kernel) -> 1088;
           matmul 2*4*4*16 = 512.
    peak:  step 0: 896 + h 256 + scratch 256 = 1408; step 1: 896 + h 256 + y 64 = 1216.
    """
    g = driver.fused_graph(_two_layer_model(), llvm)
    assert [op.kind for op in g.ops] == ["kernel", "kernel"]
    assert [op.flops for op in g.ops] == [1088.0, 512.0]
    assert g.ops[0].bytes_moved == 128 + 512 + 256
    assert g.ops[1].bytes_moved == 256 + 256 + 64
    kinds = {t.name: t.kind for t in g.tensors}
    assert kinds["x"] == "input" and kinds["w1"] == "parameter" and kinds["w2"] == "parameter"
    assert g.bytes_of_kind("input", "parameter") == 896
    assert g.bytes_of_kind("workspace") == 256
    assert g.memory_timeline().tolist() == [1408, 1216]
    assert g.peak_memory() == 1408
    assert g.peak_memory(kinds=("activation",)) == 256 + 64
    assert g.op_working_set(0) == 128 + 512 + 256 + 256
    h = g.ops[0].outputs[0]
    assert g.tensors[h].consumers == [1] and g.tensors[h].producer == 0
    assert g.outputs == g.ops[1].outputs and g.tensors[g.outputs[0]].is_output


def test_order_must_be_topological(llvm):
    g = driver.fused_graph(_two_layer_model(), llvm)
    assert g.is_topological([0, 1]) and not g.is_topological([1, 0])
    with pytest.raises(ValueError, match="topological"):
        g.peak_memory([1, 0])


def test_json_round_trip(zoo_cache, llvm):
    g = driver.fused_graph(zoo_cache("gpt", training=True), llvm)
    again = DataflowGraph.from_json(g.to_json())
    assert again.to_dict() == g.to_dict()
    assert again.peak_memory() == g.peak_memory()


def test_training_graph_phases_and_kinds(zoo_cache, llvm):
    g = driver.fused_graph(zoo_cache("mlp", training=True), llvm)
    phases = [op.phase for op in g.ops]
    assert "forward" in phases and "backward" in phases
    loss = g.tensors[g.outputs[0]]
    assert loss.shape == () and g.ops[loss.producer].phase == "forward"
    # every parameter gradient returned is made in the backward pass
    for tid in g.outputs[1:]:
        assert g.tensors[g.base(tid)].kind == "gradient"
    assert g.tensors_of_kind("activation") and g.tensors_of_kind("gradient")


def test_views_alias_their_base(zoo_cache, llvm):
    g = driver.fused_graph(zoo_cache("gpt"), llvm)
    views = [t for t in g.tensors if t.alias_of is not None]
    assert views, "gpt reshapes its token ids: a view"
    for v in views:
        assert v.nbytes == 0 and g.tensors[g.base(v.id)].alias_of is None


def test_unlegalized_module_is_rejected():
    with pytest.raises(GraphBuildError, match="LegalizeOps"):
        build_graph(TwoLayer)


# ResNet's training step in the sweep (its inference and the others' steps stay).
@pytest.mark.parametrize("name, training", [
    pytest.param(name, training, marks=[pytest.mark.sweep] if (name, training) == ("resnet", True)
                 else []) for training in (False, True) for name in ("mlp", "gpt", "resnet")])
def test_peak_equals_measured_unplanned_peak(name, training, zoo_cache, llvm):
    """Without TVM's static memory planning every tensor is allocated before its kernel and
    freed after its last use, which is exactly the graph's liveness model: the peak the VM
    measures (arguments are not VM allocations, nor is kernel scratch on CPU) equals
    peak_memory over activations and gradients, to the byte."""
    model = zoo_cache(name, training)
    g = driver.fused_graph(model, llvm)
    ex = driver.build(model, llvm, memory_planning=False)
    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(ex, dev, memory_cfg="naive")
    args = [tvm.runtime.tensor(a, dev) for a in model.random_arguments(0)]
    with runtime.measure_peak(dev) as m:
        out = vm["main"](*args)
    del out
    assert m.peak_above_baseline == g.peak_memory(kinds=("activation", "gradient"))


def test_build_graph_reads_a_module_fused_by_hand(llvm):
    """`build_graph` and the split analysis on a hand-fused module give `driver.fused_graph`."""
    fused = tvm.transform.Sequential(
        [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
         relax.transform.FuseOps(), relax.transform.FuseTIR()])(TwoLayer)
    g = annotate_time_splits(fused, build_graph(fused))
    assert g.to_dict() == driver.fused_graph(_two_layer_model(), llvm).to_dict()


def test_in_place_updates_of_an_optimizer_step(zoo_cache, llvm):
    """The new parameters and state of an optimizer step are versions of their arguments: no
    bytes of their own, made by ops of phase "update" that must follow the other readers of
    what they overwrite (an order that updates a weight before its backward use is not
    topological)."""
    from tvm_ext.models.optimizer import Optimizer, make_optimizer_step

    step = make_optimizer_step(zoo_cache("mlp", True), Optimizer("momentum"))
    g = driver.fused_graph(step, llvm)
    updates = [t for t in g.tensors if t.overwrites is not None]
    assert len(updates) == len(g.outputs) - 1
    for t in updates:
        base = g.tensors[g.base(t.id)]
        assert t.nbytes == 0 and base.arg_index is not None and t.is_output
        assert base.kind == ("state" if base.name.endswith(("momentum_buffer", "step"))
                             else "parameter")
        assert g.ops[t.producer].phase == "update"
    weight = next(t for t in g.tensors if t.name == "layers.1.weight")
    writer = next(t.producer for t in updates if g.base(t.id) == weight.id)
    readers = g.must_follow(writer)
    assert readers and all(g.ops[r].phase != "update" for r in readers)
    order = g.order
    order.remove(writer)
    order.insert(order.index(readers[-1]), writer)  # before its last other reader
    assert g.is_topological(g.order) and not g.is_topological(order)
    # State is an argument: resident throughout, counted once.
    assert g.bytes_of_kind("state") == sum(s.nbytes for s in step.params[len(
        zoo_cache("mlp", True).params):])


def test_a_reader_fused_past_an_update_is_refused_by_name(zoo_cache, llvm):
    """TVM's FuseOps places a fused kernel at its group's last op, and knows nothing of in
    place: a kernel that reads a weight can land after the weight's update (LR-ASPP's AdamW
    step). The graph builder refuses that order, naming the kernel and the update."""
    from tvm_ext.ir.graph_builder import _check_update_order
    from tvm_ext.models.optimizer import Optimizer, make_optimizer_step

    step = make_optimizer_step(zoo_cache("mlp", True), Optimizer("momentum"))
    g = driver.fused_graph(step, llvm)
    _check_update_order(g)
    weight = next(t for t in g.tensors if t.name == "layers.1.weight")
    writer = next(t.producer for t in g.tensors
                  if t.overwrites is not None and g.base(t.id) == weight.id)
    reader = g.must_follow(writer)[-1]
    order = g.order
    order.remove(writer)
    order.insert(order.index(reader), writer)
    with pytest.raises(GraphBuildError, match=rf"kernel {g.ops[reader].name} reads "
                                              rf"layers\.1\.weight after its in-place update"):
        _check_update_order(g, order)
