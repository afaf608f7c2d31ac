"""The three-stream simulator and plan invariants, on random DAGs (hypothesis)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from swap_dags import hand_problem_and_plan, random_problem

from tvm_ext.swap import SearchConfig, SwapProblem, plan_swaps, simulate, validate
from tvm_ext.swap.plan import PlanError

FAST = SearchConfig(population=6, generations=3, patience=3)


def _check(problem, plan):
    validate(problem, plan)  # topological, budget, residency, no shared bytes, swap order
    sim = simulate(problem, plan)
    assert sim.makespan == pytest.approx(plan.predicted_time)
    # Memory never exceeds the budget.
    assert sim.memory_bytes.max() <= problem.budget
    # The schedule is topological (recomputed ops run again later) and ops run one at a time
    # in its order.
    assert problem.is_run_sequence(plan.schedule)
    assert np.all(sim.op_start[1:] >= sim.op_end[:-1] - 1e-12)
    assert sim.makespan >= problem.durations[plan.schedule].sum() - 1e-9
    # Every use finds its tensor resident: each op starts after the swap-ins it needs.
    for k, s in enumerate(plan.swap_ins):
        assert sim.op_start[s.before] >= sim.h2d_end[k] - 1e-12
        # A swap-in never starts before its tensor's swap-out has finished.
        outs = [j for j, o in enumerate(plan.swap_outs) if o.tensor == s.tensor]
        for j in outs:
            assert sim.h2d_start[k] >= sim.d2h_end[j] - 1e-12
        assert sim.h2d_start[k] >= sim.op_end[s.after] - 1e-12 if s.after >= 0 else True
    for j, o in enumerate(plan.swap_outs):
        assert sim.d2h_start[j] >= sim.op_end[o.after] - 1e-12
    # Streams run one copy at a time.
    for s, e in ((sim.d2h_start, sim.d2h_end), (sim.h2d_start, sim.h2d_end)):
        assert np.all(s[1:] >= e[:-1] - 1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_ops=st.integers(2, 14),
       frac=st.floats(0.0, 1.0), planner=st.sampled_from(["swapadvisor", "lru", "vdnn"]),
       training=st.booleans())
def test_random_dag_plans_hold_invariants(seed, num_ops, frac, planner, training):
    problem = random_problem(seed, num_ops=num_ops, budget_frac=frac, training=training)
    plan = plan_swaps(problem, planner, time_budget_s=5, config=FAST)
    _check(problem, plan)


def test_ideal_is_sum_of_durations():
    problem = random_problem(1, num_ops=10)
    plan = plan_swaps(problem, "ideal")
    sim = simulate(problem, plan)
    assert sim.makespan == pytest.approx(problem.durations.sum())
    assert not plan.swap_ins and not plan.swap_outs
    assert sim.peak_memory == problem.no_swap_peak()


def test_validate_catches_broken_plans():
    problem = random_problem(3, num_ops=10, budget_frac=0.2)
    plan = plan_swaps(problem, "lru")
    assert plan.swap_ins, "the case must swap"
    bad = type(plan).from_json(plan.to_json())
    bad.schedule = bad.schedule[::-1]
    with pytest.raises(PlanError, match="topological"):
        validate(problem, bad)
    bad = type(plan).from_json(plan.to_json())
    bad.pools = [problem.budget * 2]
    bad.predicted_peak = sum(bad.pools)
    with pytest.raises(PlanError, match="budget"):
        validate(problem, bad)
    bad = type(plan).from_json(plan.to_json())
    s = bad.swap_ins[0]
    bad.residencies = [r for i, r in enumerate(bad.residencies) if i != s.residency]
    with pytest.raises(PlanError):
        validate(problem, bad)


def test_runtime_costs_known_answer():
    """Without runtime costs: op 0 [0, 1], y out [1, 2], y in [2, 3] (after its swap-out),
    op 1 [2, 3] (waits for y's swap-out), op 2 [3, 4]: 4 s.
    Issue 0.1 s, sync 0.01 s: after op 0 the compute issues the swap-out (1.1) and the swap-in
    (1.2), each to an idle stream; the swap-out runs [1.11, 2.11] (woken 0.01 after its
    issue), the swap-in waits for it: [2.12, 3.12]; op 1 stalls on the swap-out: [2.12, 3.12];
    op 2 finds the swap-in just done (3.12, no stall): [3.12, 4.12]."""
    problem, plan = hand_problem_and_plan()
    validate(problem, plan)
    sim = simulate(problem, plan)
    assert sim.makespan == pytest.approx(4.0)
    assert sim.stalls == [(1.0, 2.0)]

    problem, plan = hand_problem_and_plan(copy_issue=0.1, sync=0.01)
    sim = simulate(problem, plan)
    assert list(sim.d2h_start) + list(sim.d2h_end) == pytest.approx([1.11, 2.11])
    assert list(sim.h2d_start) + list(sim.h2d_end) == pytest.approx([2.12, 3.12])
    assert list(sim.op_start) == pytest.approx([0.0, 2.12, 3.12])
    assert sim.makespan == pytest.approx(4.12)
    assert sim.stalls == [pytest.approx((1.2, 2.12))]


def test_a_copy_handed_to_a_long_idle_stream_costs_more_and_starts_later():
    """The measured hand-over curve, (idle, compute-stream time, the copy's start): after op 0
    [0, 1] y's swap-out goes to a stream idle for 1 s (0.3 s of compute; the copy starts at
    +0.05, before the hand-over ends), then its swap-in to a stream idle for 1.3 s
    (interpolated: 0.36 s, the copy from +0.095)."""
    problem, plan = hand_problem_and_plan(sync=0.01)
    curve = ((0.0, 0.1, 0.02), (1.0, 0.3, 0.05), (2.0, 0.5, 0.2))
    problem = dataclasses.replace(problem, copy_wake=curve)
    sim = simulate(problem, plan)
    assert list(sim.d2h_start) + list(sim.d2h_end) == pytest.approx([1.05, 2.05])
    # The compute stream is free after both hand-overs: 1 + 0.3 + 0.36.
    assert sim.op_ready[1] == pytest.approx(1.66)
    # The swap-in waits for the swap-out (resuming 0.01 after it), as does op 1.
    assert list(sim.h2d_start) + list(sim.h2d_end) == pytest.approx([2.06, 3.06])
    assert list(sim.op_start) == pytest.approx([0.0, 2.06, 3.06])
    # A one-point curve holds for every idle time: the copy starts at +0.02.
    flat = dataclasses.replace(problem, copy_wake=((0.0, 0.1, 0.02),))
    assert simulate(flat, plan).d2h_start[0] == pytest.approx(1.02)
    with pytest.raises(ValueError, match="copy_wake"):
        dataclasses.replace(problem, copy_wake=((0.0, -1.0, 0.0),))
    assert SwapProblem.from_json(problem.to_json()).copy_wake == curve


def test_runtime_costs_are_scored_by_the_search():
    """The search's core and the simulator agree with runtime costs too (the plan's
    predicted time is the simulated one), and the costs only add time."""
    problem = random_problem(3, num_ops=12, budget_frac=0.3, training=True)
    free = plan_swaps(problem, "lru")
    costly = dataclasses.replace(problem, copy_issue=1e-4, sync_latency=1e-4)
    plan = plan_swaps(costly, "lru")
    _check(costly, plan)
    assert plan.swap_ins and free.swap_ins
    assert plan.predicted_time > free.predicted_time
