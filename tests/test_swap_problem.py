"""SwapProblem from a real DataflowGraph: views, alignment, residency flags, scratch, JSON."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_ext.cost import op_times
from tvm_ext.driver import fused_graph, resolve_target
from tvm_ext.models import get_model
from tvm_ext.swap import ALIGNMENT, InfeasibleBudgetError, SwapProblem, plan_swaps, validate


@pytest.fixture(scope="module")
def graph():
    return fused_graph(get_model("gpt", "tiny", training=True), resolve_target("llvm"))


def test_from_graph(graph):
    problem = SwapProblem.from_graph(graph, 1 << 30, "h100")
    assert problem.num_ops == graph.num_ops and problem.order == graph.order
    assert np.allclose(problem.durations, op_times(graph, "h100"))
    for t in graph.tensors:
        if t.alias_of is not None:
            assert problem.sizes[t.id] == 0  # views take no bytes
        else:
            assert problem.sizes[t.id] % ALIGNMENT == 0 and problem.sizes[t.id] >= t.nbytes
        assert problem.host_start[t.id] == (t.kind in ("parameter", "input"))
        assert problem.pinned[t.id] == (t.kind == "constant")
    for op in graph.ops:  # ops touch bases only; a view needs nothing where it is made
        for tid in problem.needs(op.id):
            assert graph.tensors[tid].alias_of is None
        if op.kind == "view":
            assert problem.needs(op.id) == []
    assert any(op.kind == "view" for op in graph.ops)
    exact = graph.peak_memory(kinds=("parameter", "input", "constant", "activation",
                                     "gradient"))
    assert exact <= problem.no_swap_peak() <= exact + ALIGNMENT * graph.summary()["tensors"]
    # Scratch counts only when asked.
    with_scratch = SwapProblem.from_graph(graph, 1 << 30, "h100", count_scratch=True)
    assert with_scratch.min_budget()[0] >= problem.min_budget()[0]
    assert any(graph.ops[op].workspace is not None for op in range(graph.num_ops))
    assert sum(len(with_scratch.needs(op)) for op in range(graph.num_ops)) > \
        sum(len(problem.needs(op)) for op in range(graph.num_ops))


def test_measured_op_times_are_used(graph):
    times = np.linspace(1e-3, 2e-3, graph.num_ops)
    problem = SwapProblem.from_graph(graph, 1 << 30, op_times=times)
    assert np.array_equal(problem.durations, times)
    with pytest.raises(ValueError, match="op times"):
        SwapProblem.from_graph(graph, 1 << 30, op_times=times[:-1])


def test_infeasible_budget_on_a_zoo_graph(graph):
    problem = SwapProblem.from_graph(graph, 1 << 30, "gtx1080ti")
    minimum, op = problem.min_budget()
    assert minimum == problem.pinned_bytes + max(problem.op_working_set(o)
                                                 for o in range(problem.num_ops))
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget") as err:
        plan_swaps(problem.with_budget(minimum - 1), "swapadvisor")
    assert err.value.minimum == minimum and graph.ops[op].name in str(err.value)
    # At exactly the minimum every planner finds a valid plan.
    tight = problem.with_budget(minimum)
    for planner in ("swapadvisor", "lru", "vdnn"):
        validate(tight, plan_swaps(tight, planner, time_budget_s=2))


def test_problem_json_round_trip(graph):
    problem = SwapProblem.from_graph(graph, 12345678, "a100")
    again = SwapProblem.from_json(problem.to_json())
    assert again.to_json() == problem.to_json()
    assert again.budget == 12345678 and np.array_equal(again.pinned, problem.pinned)


@pytest.fixture(scope="module")
def step_graph():
    from tvm_ext.models.optimizer import Optimizer, make_optimizer_step

    step = make_optimizer_step(get_model("mlp", "tiny", training=True), Optimizer("adam"))
    return fused_graph(step, resolve_target("llvm"))


def test_optimizer_step_problem_sees_state_and_update(step_graph):
    """Parameters and optimizer state are arguments (host copies at the start); each update
    overwrites its parameter and state in place and follows their other readers; the loss is
    returned from the host."""
    g = step_graph
    problem = SwapProblem.from_graph(g, 1 << 30, "h100")
    state = [t.id for t in g.tensors if t.kind == "state" and t.arg_index is not None]
    assert state and all(problem.host_start[t] for t in state)
    written = [t for ts in problem.op_writes for t in ts]
    assert sorted(written) == sorted(t.id for t in g.tensors if t.arg_index is not None
                                     and t.kind in ("parameter", "state"))
    for op in g.ops:
        for t in problem.op_writes[op.id]:
            readers = {c for c in g.tensors[t].consumers if c != op.id}
            assert readers <= set(problem.op_deps[op.id])
    assert problem.end_on_host == [g.base(g.outputs[0])]


@pytest.mark.parametrize("planner", ["swapadvisor", "lru", "vdnn"])
def test_plans_write_back_what_they_keep_on_the_host(step_graph, planner):
    problem = SwapProblem.from_graph(step_graph, 1, "h100")
    problem = problem.with_budget(problem.min_budget()[0])
    plan = plan_swaps(problem, planner, time_budget_s=1.0)
    validate(problem, plan)
    writer = problem.writer()
    kept = [t for t in plan.host_start if writer[t] >= 0]
    assert kept and set(kept) <= set(plan.outputs_on_host)
    # Without its write-back a plan breaks the steady state, and validation says so.
    last = len(plan.schedule) - 1
    broken = [k for k, s in enumerate(plan.swap_outs) if s.after == last and s.tensor in kept]
    assert broken
    import dataclasses

    from tvm_ext.swap import PlanError
    bad = dataclasses.replace(plan, swap_outs=[s for k, s in enumerate(plan.swap_outs)
                                               if k != broken[0]])
    with pytest.raises(PlanError, match="written back"):
        bad.check_structure(problem)
