"""Kernel fission (`tvm_ext.ir.kernel_fission`; the budget search, `ir.swap_planning.
fission_to_fit`): a fused kernel that no split in time fits a budget runs as its unfused parts,
which split finely; bit for bit the fused kernel's results.

The model is SegFormer's decoder in small: a feature map transposed, reshaped and upsampled
(a bilinear resize reads its input at computed rows, so the fused kernel computes it whole)
and concatenated along the channels with a second map; fusion makes one kernel of it all."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from one_op import decoder_module, one_op_module
from tvm import relax

from tvm_ext import driver, pipeline
from tvm_ext.ir.kernel_fission import fission_kernels
from tvm_ext.ir.local_kernels import LoweringError
from tvm_ext.ir.swap_planning import fission_to_fit
from tvm_ext.ir.targets import vm_devices
from tvm_ext.models import Model, TensorSpec
from tvm_ext.passes import SwapOffload
from tvm_ext.swap import InfeasibleBudgetError, plan_swaps, validate
from tvm_ext.swap.problem import problem_for_budget

LLVM = tvm.target.Target("llvm")


def _model() -> Model:
    return Model("decoder", decoder_module(),
                 [TensorSpec("x0", (1, 64, 16), init="uniform", scale=1.0),
                  TensorSpec("x1", (1, 16, 16, 16), init="uniform", scale=1.0)], [])


def _fused():
    mod = pipeline.fuse(_model().mod, LLVM)
    (kernel,) = [gv.name_hint for gv, f in mod.functions_items()
                 if isinstance(f, tvm.tirx.PrimFunc)]
    return mod, kernel


def _run_module(mod: tvm.IRModule, args) -> list[np.ndarray]:
    seq = tvm.transform.Sequential(pipeline.dataflow_lower_passes(LLVM)
                                   + pipeline.finalize_passes(LLVM))
    with LLVM:
        ex = tvm.compile(mod, LLVM, relax_pipeline=seq)
    return driver.run(ex, args, tvm.cpu(0), repeat=0).outputs


def test_a_fused_kernel_runs_as_its_parts_bit_for_bit():
    """One kernel per loop nest (transpose, reshape, resize, multiply, concatenate); the
    intermediates the concatenation reads become tensors; the fused kernel is gone."""
    mod, kernel = _fused()
    parts = fission_kernels(mod, [kernel])
    kernels = sorted(gv.name_hint for gv, f in parts.functions_items()
                     if isinstance(f, tvm.tirx.PrimFunc))
    assert kernels == [f"{kernel}_part{k}" for k in range(5)]
    args = _model().random_arguments(0)
    (whole,), (split,) = _run_module(mod, args), _run_module(parts, args)
    np.testing.assert_array_equal(whole, split)


def test_a_budget_no_split_of_the_fused_kernel_fits_runs_its_parts_within_it():
    """Below what the fused kernel needs at its finest split (the resized map whole), its parts
    fit, each split along channels or rows: planned on the parts' graph, run within the
    budget, outputs bit for bit the unswapped build's."""
    model = _model()
    _, kernel = _fused()
    fused = problem_for_budget(driver.fused_graph(model, LLVM), "100%", "cpu")
    budget = fused.min_budget()[0] - 1
    with pytest.raises(InfeasibleBudgetError):
        fused.with_budget(budget).check_feasible()
    planning = driver.plan_swap(model, LLVM, budget, hardware="cpu", time_budget_s=1.0)
    graph, problem, plan = planning.graph, planning.problem, planning.plan
    assert planning.fissioned == [kernel] and problem.budget == budget
    # The graph of a plan's fissioned kernels, as the driver reads it, is the problem's.
    again = driver.fused_graph(model, LLVM, planning.fissioned)
    assert [(op.name, op.kernel) for op in again.ops] == [(op.name, op.kernel)
                                                          for op in graph.ops]
    validate(problem, plan)
    assert plan.splits
    device, host = vm_devices(LLVM)
    args = model.random_arguments(0)
    out = driver.run(driver.build(model, LLVM, swap_plan=plan), args, device, repeat=0,
                     host=host, arg_devices=planning.argument_devices)
    reference = driver.run(driver.build(model, LLVM), args, tvm.cpu(0), repeat=0)
    driver.compare(out.outputs, reference.outputs, tolerances=[(0.0, 0.0)])
    assert out.peak_bytes + graph.bytes_of_kind("constant") <= budget
    # SwapOffload planning on its own does the same.
    mod = SwapOffload(budget, hardware="cpu", time_budget_s=0.5)(pipeline.fuse(model.mod, LLVM))
    assert f"{kernel}_part0" in [gv.name_hint for gv in mod.functions]


def test_the_smallest_budget_is_that_of_the_parts():
    """"min" fissions what sets the smallest budget while that lowers it; a budget the fused
    kernel fits fissions nothing."""
    model = _model()
    fused = problem_for_budget(driver.fused_graph(model, LLVM), "min", "cpu")
    mod = pipeline.fuse(model.mod, LLVM)
    _, _, problem, fissioned = fission_to_fit(mod, "min", "cpu")
    assert fissioned and problem.budget < fused.budget
    _, _, problem, fissioned = fission_to_fit(mod, fused.budget, "cpu")
    assert not fissioned and problem.budget == fused.budget


def _batch_norm_pad(x, gamma, beta, mean, var):
    """An inference batch norm: its legalized kernel also computes the updated running
    statistics, in loop nests whose results nothing reads."""
    y = relax.op.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=False)[0]
    return relax.op.nn.pad(relax.op.clip(y, 0.0, 6.0), [0, 0, 0, 0, 1, 1, 1, 1])


def test_a_kernel_with_loop_nests_nothing_reads_runs_as_its_parts():
    """Parts without outputs are not called; the others give the fused kernel's bits."""
    mod = one_op_module(_batch_norm_pad, (2, 8, 4, 4), (8,), (8,), (8,), (8,))
    fused = pipeline.fuse(mod, LLVM)
    (kernel,) = [gv.name_hint for gv, f in fused.functions_items()
                 if isinstance(f, tvm.tirx.PrimFunc)]
    parts = fission_kernels(fused, [kernel])
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((2, 8, 4, 4)).astype("float32"),
            *(rng.uniform(0.5, 1.5, 8).astype("float32") for _ in range(4))]
    (whole,), (split,) = _run_module(fused, args), _run_module(parts, args)
    np.testing.assert_array_equal(whole, split)


def test_what_does_not_cut_is_refused_clearly():
    mod, kernel = _fused()
    one = pipeline.fuse(one_op_module(lambda x: relax.op.multiply(x, relax.const(2.0)),
                                      (8, 8)), LLVM)
    (single,) = [gv.name_hint for gv, f in one.functions_items()
                 if isinstance(f, tvm.tirx.PrimFunc)]
    with pytest.raises(LoweringError, match=f"kernel {single} cannot run as its parts: the "
                                            "kernel is one loop nest"):
        fission_kernels(one, [single])
    # A budget below what even the parts need is refused with the parts' smallest budget.
    _, _, problem, names = fission_to_fit(mod, 64, "cpu")
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget"):
        problem.check_feasible()
    assert names == [kernel]
    # A plan that runs a kernel the module does not have as its parts.
    plan = plan_swaps(problem_for_budget(driver.fused_graph(_model(), LLVM), "100%", "cpu"))
    plan.fissioned = ["no_such_kernel"]
    with pytest.raises(Exception, match="the plan runs kernels as their parts, which this "
                                        "module cannot: the module has no kernel no_such"):
        SwapOffload(plan=plan)(mod)
