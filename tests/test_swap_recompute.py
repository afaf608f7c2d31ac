"""Recompute in the swap plan: where second runs go (`augment`), which tensors may be made again,
plans that recompute hold every invariant (simulated and checked), recompute frees device
memory without copies, and the search with recompute is never slower than the swap-only search
it starts from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from swap_dags import random_problem

from tvm_ext.swap import PlanError, SwapProblem, plan_swaps, simulate, validate
from tvm_ext.swap.derive import Evaluator, Knobs
from tvm_ext.swap.recompute import augment, candidates, chain_links, cheapest_sets, checkpoint_set
from tvm_ext.swap.search import GeneticSearch, SearchConfig, swapadvisor_phases

FAST_SEARCH = SearchConfig(population=8, generations=10, patience=10)


def _chain(kinds=None, phases=None, durations=None, link=1e3) -> SwapProblem:
    """w -> a (op0) -> b (op1) -> c (op2) -> d (op3, reads a and c); d is returned.
    a is used at op1 and again at op3: its longest gap ends at op3."""
    return SwapProblem(
        op_names=["op0", "op1", "op2", "op3"], durations=durations or [1.0] * 4,
        op_deps=[[], [0], [1], [0, 2]], op_inputs=[[0], [1], [2], [1, 3]],
        op_outputs=[[1], [2], [3], [4]], op_scratch=[[]] * 4,
        op_phases=phases or ["forward", "forward", "backward", "backward"],
        tensor_names=["w", "a", "b", "c", "d"], sizes=[256, 1024, 1024, 1024, 256],
        tensor_kinds=["parameter", "activation", "activation", "activation", "activation"],
        producers=[-1, 0, 1, 2, 3], host_start=[True, False, False, False, False],
        pinned=[False] * 5, outputs=[4], budget=1 << 20, h2d_bandwidth=link, h2d_latency=0.0,
        d2h_bandwidth=link, d2h_latency=0.0, op_kinds=kinds)


def test_second_run_goes_before_the_use_after_the_longest_gap():
    p = _chain()
    assert candidates(p, p.order).tolist() == [1]  # a: used at op1, then at op3
    assert augment(p, p.order, [1]).tolist() == [0, 1, 2, 0, 3]
    assert augment(p, p.order, []).tolist() == [0, 1, 2, 3]


def test_only_one_output_kernels_are_made_again():
    p = _chain(kinds=["builtin", "kernel", "kernel", "kernel"])
    assert candidates(p, p.order).tolist() == []
    assert not p.is_run_sequence([0, 1, 2, 0, 3])
    assert _chain().is_run_sequence([0, 1, 2, 0, 3])
    assert not _chain().is_run_sequence([0, 2, 1, 3])  # not topological
    assert not _chain().is_run_sequence([0, 1, 2])  # op3 never runs


def test_a_chosen_input_dropped_by_then_is_made_again_first():
    """a = op0(w), b = op1(a), x = op2(b), y = op3(x), e = op4(b, y), f = op5(a, e): b is made
    again before e from a, which is dropped by then and chosen for its own late use (f): a's
    second run moves up to just before b's (a chain), and f reads that copy."""
    p = SwapProblem(
        op_names=["a", "b", "x", "y", "e", "f"], durations=[1.0] * 6,
        op_deps=[[], [0], [1], [2], [1, 3], [0, 4]],
        op_inputs=[[0], [1], [2], [3], [2, 4], [1, 5]],
        op_outputs=[[1], [2], [3], [4], [5], [6]], op_scratch=[[]] * 6,
        op_phases=["forward"] * 6, tensor_names=["w", "a", "b", "x", "y", "e", "f"],
        sizes=[256] * 7, tensor_kinds=["parameter"] + ["activation"] * 6,
        producers=[-1, 0, 1, 2, 3, 4, 5], host_start=[True] + [False] * 6, pinned=[False] * 7,
        outputs=[6], budget=1 << 20, h2d_bandwidth=1e3, h2d_latency=0.0, d2h_bandwidth=1e3,
        d2h_latency=0.0)
    assert candidates(p, p.order).tolist() == [1, 2]
    assert augment(p, p.order, [2]).tolist() == [0, 1, 2, 3, 1, 4, 5]
    assert augment(p, p.order, [1, 2]).tolist() == [0, 1, 2, 3, 0, 1, 4, 5]
    plan = Evaluator(p.with_budget(p.min_budget()[0])).plan(p.order, Knobs(), "swapadvisor",
                                                            recompute=[1, 2])
    validate(p.with_budget(p.min_budget()[0]), plan)
    # The first copies of a and b are dropped, not copied out (a copy of the second a may be
    # copied out at this smallest budget: it is needed again, by f).
    assert not [s for s in plan.swap_outs if s.tensor in (1, 2) and s.after < 4]


def _attention(budget: int = 2560) -> SwapProblem:
    """w -> s (op0, scores) -> p (op1, softmax) -> x (op2); backward: x -> u (op3, big) -> y
    (op4); z = op5(p, y) is returned. p's longest gap ends at op5; s is read by op1 only
    (no gap of its own): a chain link. At op3 p (or s) cannot stay beside x and u."""
    return SwapProblem(
        op_names=["scores", "softmax", "f", "g", "h", "grad"], durations=[1.0] * 6,
        op_deps=[[], [0], [1], [2], [3], [1, 4]],
        op_inputs=[[0], [1], [2], [3], [4], [2, 5]],
        op_outputs=[[1], [2], [3], [4], [5], [6]], op_scratch=[[]] * 6,
        op_phases=["forward"] * 3 + ["backward"] * 3,
        tensor_names=["w", "s", "p", "x", "u", "y", "z"],
        sizes=[256, 1024, 1024, 256, 2048, 256, 256],
        tensor_kinds=["parameter"] + ["activation"] * 6, producers=[-1, 0, 1, 2, 3, 4, 5],
        host_start=[True] + [False] * 6, pinned=[False] * 7, outputs=[6], budget=budget,
        h2d_bandwidth=256.0, h2d_latency=0.0, d2h_bandwidth=256.0, d2h_latency=0.0)


def test_a_chain_link_is_made_again_only_before_the_run_that_reads_it():
    p = _attention()
    cands = candidates(p, p.order)
    assert cands.tolist() == [1, 2]
    assert chain_links(p, p.order, cands).tolist() == [True, False]
    assert augment(p, p.order, [1]).tolist() == [0, 1, 2, 3, 4, 5]  # never on its own
    assert augment(p, p.order, [2]).tolist() == [0, 1, 2, 3, 4, 1, 5]  # s kept for it
    assert augment(p, p.order, [1, 2]).tolist() == [0, 1, 2, 3, 4, 0, 1, 5]
    # The search never flips a link on its own, and a probability it turns on brings it.
    search = GeneticSearch(p, FAST_SEARCH, seed=0)
    assert search.links.tolist() == [True, False]
    for _ in range(20):
        mask = search._mutate_recompute(None)
        assert not mask[0] or mask[1]
        assert mask[0] == mask[1]


def test_recomputing_through_a_chain_link_beats_swapping():
    """p made again alone keeps s (as big) from op1 to its second run: s must be copied out
    and back as p would be. With the chain, nothing but w moves."""
    p = _attention()
    swapped = plan_swaps(p, "swap_only", time_budget_s=5, config=FAST_SEARCH)
    chained = plan_swaps(p, "swapadvisor", time_budget_s=5, config=FAST_SEARCH)
    for plan in (swapped, chained):
        validate(p, plan)
    assert chained.schedule == [0, 1, 2, 3, 4, 0, 1, 5]
    assert not chained.swap_outs and {s.tensor for s in chained.swap_ins} <= {0}
    assert chained.predicted_time < swapped.predicted_time
    alone = Evaluator(p).score(np.asarray(p.order), Knobs(), recompute=[2])
    assert chained.predicted_time < alone


def test_recompute_frees_memory_without_copies():
    """A budget too small to keep `a` through the middle of the chain: swap-only copies it out
    and back; recompute makes it again, copying nothing of it."""
    p = _chain()
    low = p.min_budget()[0]
    p = p.with_budget(low)
    evaluator = Evaluator(p)
    swapped = evaluator.plan(p.order, Knobs(), "swapadvisor")
    recomputed = evaluator.plan(p.order, Knobs(), "swapadvisor", recompute=[1])
    for plan in (swapped, recomputed):
        validate(p, plan)
    assert any(s.tensor == 1 for s in swapped.swap_outs)
    assert not any(s.tensor == 1 for s in recomputed.swap_outs + recomputed.swap_ins)
    assert recomputed.info["recomputed"] == 1 and recomputed.info["bytes_recomputed"] == 1024
    assert recomputed.info["recompute_s"] == pytest.approx(1.0)
    # Two residencies of a, each produced by op0 (positions 0 and 3).
    made = [r.begin for r in recomputed.residencies if r.tensor == 1]
    assert made == [0, 3] and all(recomputed.schedule[b] == 0 for b in made)


def test_a_repeated_op_that_cannot_run_again_is_refused():
    p = _chain()
    plan = Evaluator(p).plan(p.order, Knobs(), "swapadvisor", recompute=[1])
    q = dataclasses.replace(p, op_kinds=["view", "kernel", "kernel", "kernel"])
    with pytest.raises(PlanError, match="one-output kernels run again"):
        validate(q, plan)


@pytest.mark.parametrize("seed", range(6))
def test_recompute_plans_of_random_training_graphs_hold(seed):
    p = random_problem(seed, num_ops=10, budget_frac=0.2, training=True)
    cands = candidates(p, p.order)
    evaluator = Evaluator(p)
    for chosen in (cands, checkpoint_set(p, p.order, cands), *cheapest_sets(p, cands)):
        plan = evaluator.plan(p.order, Knobs(), "swapadvisor", recompute=chosen)
        validate(p, plan)
        assert simulate(p, plan).makespan == pytest.approx(plan.predicted_time)


@pytest.mark.parametrize("seed", range(4))
def test_search_with_recompute_is_never_slower_than_swap_only(seed):
    p = random_problem(seed, num_ops=12, budget_frac=0.15, training=True, bandwidth=300.0)
    config = SearchConfig(generations=15, patience=15, time_budget_s=60.0)
    swap_only = plan_swaps(p, "swap_only", seed=seed, config=config)
    both = plan_swaps(p, "swapadvisor", seed=seed, config=config)
    validate(p, both)
    assert both.predicted_time <= swap_only.predicted_time * (1 + 1e-12)
    # The phases of one search: the first is that swap-only search (same seed and generation
    # limit), the second no slower than it.
    first, second = swapadvisor_phases(p, seed=seed, config=config)
    for plan in (first, second):
        validate(p, plan)
    assert (first.planner, second.planner) == ("swap_only", "swapadvisor")
    assert first.predicted_time == pytest.approx(swap_only.predicted_time, rel=1e-12)
    assert second.predicted_time == pytest.approx(both.predicted_time, rel=1e-12)
    assert first.info["recompute_candidates"] == 0 and not first.info["recomputed"]


def test_checkpoint_baseline_keeps_every_sqrt_nth_activation():
    p = random_problem(3, num_ops=16, budget_frac=0.3, training=True)
    cands = candidates(p, p.order)
    chosen = checkpoint_set(p, p.order, cands)
    plan = plan_swaps(p, "checkpoint")
    validate(p, plan)
    assert plan.info["recomputed"] == len(chosen)
    assert len(chosen) < len(cands) or not len(cands)


def test_cheapest_sets_grow_with_the_compute_allowed():
    p = random_problem(1, num_ops=14, training=True, bandwidth=10.0)
    sets = cheapest_sets(p, candidates(p, p.order), (0.01, 0.1, 0.5, 1.0))
    sizes = [len(s) for s in sets]
    assert sizes == sorted(sizes)
    for chosen, fraction in zip(sets, (0.01, 0.1, 0.5, 1.0), strict=True):
        producers = np.asarray(p.producers)[chosen]
        assert p.durations[producers].sum() <= fraction * p.durations.sum() + 1e-12


def test_the_plot_marks_the_second_run_as_recompute():
    """The compute lane's second run of op0 (recomputing `a`) is the span marked "recompute"."""
    from tvm_ext.swap.simulator import simulate
    from tvm_ext.swap.timeline_plot import marked_spans

    p = _chain()
    p = p.with_budget(p.min_budget()[0])
    plan = Evaluator(p).plan(p.order, Knobs(), "swapadvisor", recompute=[1])
    compute = simulate(p, plan).timelines(plan)["compute"]
    second = [k for k, op in enumerate(plan.schedule) if op in plan.schedule[:k]]
    assert second and marked_spans(plan, compute)["recompute"] == [
        compute[k][1:] for k in second]
    assert marked_spans(plan, compute)["split"] == []
