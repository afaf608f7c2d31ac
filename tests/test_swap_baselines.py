"""ideal, vDNN and LRU in the shared simulator, on random DAGs and a zoo training graph."""

from __future__ import annotations

import numpy as np
import pytest
from swap_dags import random_problem

from tvm_ext.driver import fused_graph, resolve_target
from tvm_ext.models import get_model
from tvm_ext.swap import SwapProblem, plan_swaps, simulate, validate


@pytest.fixture(scope="module")
def gpt_tiny_training():
    graph = fused_graph(get_model("gpt", "tiny", training=True), resolve_target("llvm"))
    return SwapProblem.from_graph(graph, 1 << 40, "gtx1080ti")


def test_lru_swaps_on_demand():
    problem = random_problem(4, num_ops=20, budget_frac=0.2)
    plan = plan_swaps(problem, "lru")
    validate(problem, plan)
    assert plan.swap_ins
    # No prefetch: each copy is issued right before the op that needs it.
    assert all(s.after == s.before - 1 for s in plan.swap_ins)
    # Evictions too: a swap-out is issued right before an op that takes its window.
    begins = {r.begin for r in plan.residencies}
    assert plan.swap_outs and all(s.after + 1 in begins for s in plan.swap_outs)


@pytest.mark.parametrize("ratio", [2, 4, 8])
def test_baselines_on_gpt_training(gpt_tiny_training, ratio):
    base = gpt_tiny_training
    problem = base.with_budget(max(base.no_swap_peak() // ratio, base.min_budget()[0]))
    ideal = plan_swaps(problem, "ideal")
    assert ideal.predicted_time == pytest.approx(problem.durations.sum())
    times = {}
    for planner in ("lru", "vdnn", "swapadvisor"):
        plan = plan_swaps(problem, planner, time_budget_s=3)
        validate(problem, plan)
        assert simulate(problem, plan).makespan == pytest.approx(plan.predicted_time)
        assert plan.predicted_time >= ideal.predicted_time - 1e-12
        assert plan.predicted_peak <= problem.budget
        times[planner] = plan.predicted_time
    assert times["swapadvisor"] <= min(times["lru"], times["vdnn"]) + 1e-12


def test_vdnn_offloads_forward_activations(gpt_tiny_training):
    from tvm_ext.swap.derive import Evaluator, Knobs

    base = gpt_tiny_training
    problem = base.with_budget(base.no_swap_peak() // 2)
    order = np.asarray(problem.order)
    plan = Evaluator(problem, "vdnn").plan(order, Knobs(keep=0.0), "vdnn")  # vDNN_all
    validate(problem, plan)
    offloaded = [s for s in plan.swap_outs if problem.tensor_kinds[s.tensor] == "activation"]
    assert offloaded
    # Offloaded activations come back one op ahead of a backward use, or on demand.
    prefetched = 0
    for s in plan.swap_ins:
        assert s.before - s.after in (1, 2)
        if s.before - s.after == 2:
            prefetched += 1
            assert problem.op_phases[plan.schedule[s.before]] == "backward"
    assert prefetched
    # vDNN_dyn keeps the faster of vDNN_all and on-demand swapping.
    chosen = plan_swaps(problem, "vdnn")
    assert chosen.predicted_time <= min(plan.predicted_time,
                                        plan_swaps(problem, "lru").predicted_time) + 1e-12
