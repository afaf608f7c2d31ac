"""The corpus models that needed more than one dim split at once or a fused kernel run as its
parts fit 1/12 of their no-swap peak (`benchmarks/swap_offload.py` runs every model): ResNet
(its stem convolution by images and rows; as a training step also its weight gradient) and
SegFormer inference (its decoder's resize-and-concatenate kernel as its parts); MobileNetV2
inference at 4% (batch norm + ReLU6 + padding kernels as their parts, without the loop nests of
the batch norm's unread running statistics). Measured device
peak within the budget, outputs within float32 tolerance of the unswapped build (the plans
split convolutions, which sum in another order in chunks)."""

from __future__ import annotations

import corpus
import numpy as np
import pytest
import tvm

from tvm_ext import driver
from tvm_ext.ir.targets import vm_devices
from tvm_ext.models import load_model
from tvm_ext.models.reference import tolerance
from tvm_ext.swap import validate
from tvm_ext.swap.problem import problem_for_budget

LLVM = tvm.target.Target("llvm")


# ResNet's inference in CI; its training step and SegFormer in the sweep (the planner's and
# the passes' own tests cover their paths: test_swap_split, test_kernel_fission).
@pytest.mark.parametrize("name, training, needs, budget", [
    ("resnet", False, "outer", "8.33%"),
    pytest.param("resnet", True, "outer", "8.33%", marks=pytest.mark.sweep),
    pytest.param("segformer", False, "fission", "8.33%", marks=pytest.mark.sweep),
    # Fits 1/12 unfissioned at this size; at 4% its kernels run as their parts (the unit case:
    # test_kernel_fission's batch norm).
    pytest.param("mobilenet_v2", False, "fission", "4%", marks=pytest.mark.sweep)])
def test_corpus_model_runs_at_a_twelfth_of_its_peak(tmp_path, name, training, needs, budget):
    path, _ = corpus.export(corpus.BY_NAME[name], str(tmp_path))
    model = load_model(path, training=training)
    whole = problem_for_budget(driver.fused_graph(model, LLVM), budget, "cpu")
    assert whole.min_budget()[0] > whole.budget or needs == "outer"
    planning = driver.plan_swap(model, LLVM, budget, hardware="cpu", time_budget_s=2.0)
    graph, problem, plan = planning.graph, planning.problem, planning.plan
    assert problem.budget == whole.budget
    validate(problem, plan)
    if needs == "fission":
        assert planning.fissioned
    else:
        assert any(sp.outer_dim >= 0 for sp in plan.splits)
    args = model.random_arguments(0)
    device, host = vm_devices(LLVM)
    out = driver.run(driver.build(model, LLVM, swap_plan=plan), args, device, repeat=0,
                     host=host, arg_devices=planning.argument_devices)
    reference = driver.run(driver.build(model, LLVM), args, tvm.cpu(0), repeat=0)
    for a, b in zip(out.outputs, reference.outputs, strict=True):
        np.testing.assert_allclose(a, b, *tolerance(a.dtype))
    assert out.peak_bytes + graph.bytes_of_kind("constant") <= problem.budget
