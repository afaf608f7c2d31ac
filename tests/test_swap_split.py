"""Operator splitting in time in the swap plan: the smallest feasible budget falls to what the
finest split needs, the split chosen is the one that fits with the fewest chunks (two buffers
before one, unless each chunk's kernel call costs more than overlapping its copies saves),
each chunk costs a kernel call and a copy latency, split plans hold every invariant (checked
and simulated), a split op's output ends on the host, and its streams wait for what its chunk
buffers' window held."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tvm_ext.swap import (
    InfeasibleBudgetError,
    PlanError,
    SwapProblem,
    plan_swaps,
    simulate,
    validate,
)
from tvm_ext.swap.derive import Evaluator, Knobs
from tvm_ext.swap.split import (
    SplitOption,
    choose_splits,
    chunk_counts,
    scratch_bytes,
    working_set,
)


def _chain(splits=True, sizes=(256, 4096, 4096, 4096, 256), link=4096.0) -> SwapProblem:
    """w -> op0 -> a -> op1 -> b -> op2 -> c -> op3 -> d (returned); op1 and op2 may run in up to
    16 chunks along their leading axis (a in, b out; b in, c out)."""
    return SwapProblem(
        op_names=["op0", "op1", "op2", "op3"], durations=[1.0] * 4,
        op_deps=[[], [0], [1], [2]], op_inputs=[[0], [1], [2], [3]],
        op_outputs=[[1], [2], [3], [4]], op_scratch=[[]] * 4, op_phases=["forward"] * 4,
        tensor_names=["w", "a", "b", "c", "d"], sizes=list(sizes),
        tensor_kinds=["parameter"] + ["activation"] * 4, producers=[-1, 0, 1, 2, 3],
        host_start=[True] + [False] * 4, pinned=[False] * 5, outputs=[4], budget=1 << 20,
        h2d_bandwidth=link, h2d_latency=0.0, d2h_bandwidth=link, d2h_latency=0.0,
        op_splits=[[], [[0, 16, [1], [], [2]]], [[0, 16, [2], [], [3]]], []] if splits
        else None)


def test_splitting_lowers_the_smallest_feasible_budget():
    whole, split = _chain(splits=False), _chain()
    # Without splitting op1 needs a and b whole: 8192 B; split into 16 chunks with one buffer
    # each it needs two chunk buffers of 256 B; op0 (w + a) then sets the floor.
    assert whole.min_budget() == (8192, 1)
    assert split.min_budget() == (4352, 0)
    assert split.op_working_set(1) == 512 and split.op_working_set(1, split=False) == 8192
    with pytest.raises(InfeasibleBudgetError, match=r"smallest feasible budget is 4\.25 KiB"):
        plan_swaps(split.with_budget(4351))


def test_the_fewest_chunks_that_fit_with_two_buffers_are_chosen():
    p = _chain()
    fixed = np.zeros(p.num_tensors, dtype=bool)
    # room -> (chunks, buffers) of op1 and op2 alike (None: whole); each needs 8192 B whole.
    for room, want in ((8192, None), (8191, (4, 2)), (2048, (8, 2)), (1024, (16, 2)),
                       (600, (16, 1))):
        chosen = choose_splits(p, room, fixed)
        assert {op: (c, b) for op, (_, c, b) in chosen.items()} == \
            ({} if want is None else {1: want, 2: want}), room
        for op, (o, c, b) in chosen.items():
            assert working_set(p.sizes, p.needs(op), fixed, o, c, b) <= room


def test_one_buffer_and_fewer_chunks_win_when_each_chunk_costs_more_than_the_overlap():
    """In 2048 B op1 and op2 fit in 8 chunks with two buffers or in 4 with one; at 10 s per
    kernel call the extra chunks cost more than serial copies (0.5 s per chunk)."""
    fixed = np.zeros(5, dtype=bool)
    cheap = _chain()
    assert {op: (c, b) for op, (_, c, b) in choose_splits(cheap, 2048, fixed).items()} == \
        {1: (8, 2), 2: (8, 2)}
    costly = dataclasses.replace(_chain(), launch_overhead=10.0)
    assert {op: (c, b) for op, (_, c, b) in choose_splits(costly, 2048, fixed).items()} == \
        {1: (4, 1), 2: (4, 1)}


def test_each_chunk_costs_a_kernel_call_and_a_copy_latency():
    """The same split plan simulated with a launch overhead and a link latency: the split ops'
    streams take one latency per chunk, their compute one launch overhead per chunk after
    the first."""
    base = _chain().with_budget(4352)
    plan = Evaluator(base, "swapadvisor").plan(np.asarray(base.order), Knobs(keep=0.0),
                                               "swapadvisor")
    costly = dataclasses.replace(base, launch_overhead=0.25, h2d_latency=0.125)
    lean, slow = simulate(base, plan), simulate(costly, plan)
    for sp in plan.splits:
        i = sp.position
        work = slow.op_end[i] - slow.op_start[i]
        assert work >= lean.op_end[i] - lean.op_start[i] + (sp.chunks - 1) * 0.25 - 1e-9
        for k, s in enumerate(plan.swap_ins):
            if s.residency < 0 and s.before == i:  # streamed: a copy per chunk
                assert slow.h2d_end[k] - slow.h2d_start[k] == pytest.approx(
                    sp.chunks * 0.125 + base.sizes[s.tensor] / 4096.0)
    assert slow.makespan > lean.makespan + sum((sp.chunks - 1) * 0.25 for sp in plan.splits)


def test_a_kept_cut_input_is_read_in_place():
    p = _chain()
    fixed = np.zeros(p.num_tensors, dtype=bool)
    fixed[1] = True  # a stays on the device: op1 reads chunks of it, streams only b out
    option = p.split_options()[1][0].on_device(fixed)
    assert option.cut_inputs == () and option.viewed_inputs == (1,)
    assert scratch_bytes(p.sizes, option, 4) == 2 * 1024


@pytest.mark.parametrize("budget", [4352, 5000, 6400, 8191])
def test_split_plans_hold_and_stream_through_the_host(budget):
    p = _chain().with_budget(budget)
    for mode in ("swapadvisor", "lru", "vdnn"):
        plan = Evaluator(p, mode).plan(np.asarray(p.order), Knobs(keep=0.0), mode)
        validate(p, plan)
        sim = simulate(p, plan)
        assert sim.memory_bytes.max() <= budget
        assert sim.makespan == pytest.approx(plan.predicted_time)
        assert plan.splits and plan.info["split_ops"] == len(plan.splits)
        for sp in plan.splits:
            # Its cut inputs come in from the host with no window; its output goes out.
            ins = [s for s in plan.swap_ins if s.before == sp.position and s.residency < 0]
            assert sorted(s.tensor for s in ins) == sorted(sp.cut_inputs)
            outs = [s for s in plan.swap_outs if s.after == sp.position]
            assert sorted(s.tensor for s in outs) == sorted(sp.cut_outputs)
            # The op starts once a chunk is in, not the whole input.
            first = min(sim.h2d_start[k] for k, s in enumerate(plan.swap_ins) if s in ins)
            assert sim.op_start[sp.position] < first + p.sizes[sp.cut_inputs[0]] / 4096.0


def test_consecutive_splits_wait_for_the_previous_streams_out():
    """op1 and op2 share the chunk buffers' window: op2's streams in wait for op1's output to
    have left it."""
    p = _chain().with_budget(4352)
    plan = Evaluator(p, "swapadvisor").plan(np.asarray(p.order), Knobs(keep=0.0), "swapadvisor")
    first, second = plan.splits
    assert (first.pool, first.offset) == (second.pool, second.offset)
    out_of_first = next(k for k, s in enumerate(plan.swap_outs)
                        if s.after == first.position and s.tensor in first.cut_outputs)
    for s in plan.swap_ins:
        if s.residency < 0 and s.before == second.position:
            assert s.wait_swap_out >= out_of_first
    assert second.wait_swap_out >= out_of_first


def test_a_split_plan_for_an_op_without_that_option_is_refused():
    p = _chain().with_budget(4352)
    plan = Evaluator(p, "swapadvisor").plan(np.asarray(p.order), Knobs(keep=0.0), "swapadvisor")
    with pytest.raises(PlanError):
        validate(_chain(splits=False).with_budget(4352), plan)


def test_split_plans_round_trip_through_json():
    p = _chain().with_budget(5000)
    plan = plan_swaps(p, "swapadvisor", time_budget_s=2)
    again = type(plan).from_json(plan.to_json())
    assert again.splits == plan.splits
    validate(p, again)


def test_split_option_lists_round_trip():
    option = SplitOption(2, 8, (1, 4), (0,), (5,), cut_bytes=((1, 4096), (4, 1000)))
    again = SplitOption.from_list(option.to_list())
    assert again == option and again.cut_bytes == option.cut_bytes
    # Lists written before the unaligned bytes were recorded still load.
    assert SplitOption.from_list(option.to_list()[:5]) == option


def test_unaligned_chunks_stream_but_are_read_in_place_only_where_aligned():
    """Streamed chunks may start anywhere; a cut input kept on the device is read in place,
    so only counts that start each of its chunks at an aligned offset remain."""
    sizes = np.array([0, 2560, 0, 0, 1024, 8192])  # aligned sizes, as the problem keeps them
    option = SplitOption(2, 8, (1, 4), (0,), (5,), cut_bytes=((1, 2560), (4, 1000)))
    assert chunk_counts(option, sizes) == [2, 4, 8]
    fixed = np.zeros(6, dtype=bool)
    fixed[4] = True  # 1000 bytes: no chunk of it starts aligned
    assert chunk_counts(option.on_device(fixed), sizes) == []
    fixed[:] = False
    fixed[1] = True  # 2560 bytes: halves of 1280 start aligned, quarters of 640 do not
    assert chunk_counts(option.on_device(fixed), sizes) == [2]


def test_a_split_op_is_not_run_again_to_recompute_its_output():
    """b (op1's output, read by op2 and again by op4) is a recompute candidate; once op1 runs
    in chunks, b is streamed to the host as it is made, so a second run of op1 would copy it
    out twice and free nothing: the recompute choice is dropped and the plan holds."""
    p = SwapProblem(
        op_names=["op0", "op1", "op2", "op3", "op4"], durations=[1.0] * 5,
        op_deps=[[], [0], [1], [2], [1, 3]], op_inputs=[[0], [1], [2], [3], [2, 4]],
        op_outputs=[[1], [2], [3], [4], [5]], op_scratch=[[]] * 5,
        op_phases=["forward"] * 5, tensor_names=["w", "a", "b", "c", "d", "e"],
        sizes=[256, 4096, 4096, 256, 256, 256], tensor_kinds=["parameter"] + ["activation"] * 5,
        producers=[-1, 0, 1, 2, 3, 4], host_start=[True] + [False] * 5, pinned=[False] * 6,
        outputs=[5], budget=1 << 20, h2d_bandwidth=4096.0, h2d_latency=0.0,
        d2h_bandwidth=4096.0, d2h_latency=0.0,
        op_splits=[[], [[0, 16, [1], [], [2]]], [], [], []])
    from tvm_ext.swap.recompute import candidates

    order = np.asarray(p.order)
    assert 2 in candidates(p, order)
    small = p.with_budget(6144)
    ev = Evaluator(small, "swapadvisor")
    assert 1 in ev.splits(0.0).choice
    plan = ev.plan(order, Knobs(), "swapadvisor", recompute=np.array([2]))
    validate(small, plan)
    assert plan.schedule.count(1) == 1 and plan.info["recomputed"] == 0
    assert [s.tensor for s in plan.swap_outs].count(2) == 1


def test_a_split_ops_streamed_inputs_are_issued_by_the_op_after_every_other_copy():
    """The split op copies its streamed inputs in itself, after every copy issued before it:
    the h2d stream's order has them last among the swap-ins of that op, and a later swap-in
    (here a prefetch for position 5) is issued after the op."""
    from tvm_ext.swap import _core

    issue, needed = np.array([2, 1, 2, 2]), np.array([3, 3, 5, 3])
    streamed = np.array([True, False, False, True])
    _, order, final = _core.fifo_orders(issue, needed, np.ones(4, dtype=bool), streamed,
                                        np.zeros(0, dtype=np.int64), 9)
    assert order.tolist() == [1, 0, 3, 2]
    assert final.tolist() == [2, 1, 3, 2]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_swap_ins_wait_only_for_swap_outs_issued_before_them(name):
    """A split op's chunk buffers wait for what their window held, and so do its streamed
    inputs, but a swap-in of a window of its own waits for that window's occupant only (it
    may be issued before the split op's swap-outs, which it cannot wait for)."""
    import tvm

    from tvm_ext.driver import fused_graph
    from tvm_ext.models import get_model
    from tvm_ext.swap.problem import problem_for_budget

    graph = fused_graph(get_model(name, "tiny", training=True), tvm.target.Target("llvm"))
    problem = problem_for_budget(graph, "100%", "cpu")
    problem = problem.with_budget(problem.min_budget()[0])
    for seed in range(3):
        plan = plan_swaps(problem, "swapadvisor", time_budget_s=0.3, seed=seed)
        validate(problem, plan)
        assert plan.splits
        for k, s in enumerate(plan.swap_ins):
            if s.wait_swap_out >= 0:
                assert plan.swap_outs[s.wait_swap_out].after <= s.after, (seed, k, s)


def test_the_plot_marks_split_work_on_the_compute_lane(tmp_path):
    """The split ops' spans on the compute lane are the ones drawn as "split" (the recomputed
    ones are tests/test_swap_recompute.py's); the PNG is written."""
    from tvm_ext.swap.timeline_plot import marked_spans, plot_plan

    p = _chain().with_budget(4352)
    plan = plan_swaps(p, "swapadvisor", time_budget_s=0.5, seed=0)
    assert plan.splits
    compute = simulate(p, plan).timelines(plan)["compute"]
    marked = marked_spans(plan, compute)
    split = {sp.position for sp in plan.splits}
    assert marked["split"] == [(s, e) for k, (_, s, e) in enumerate(compute) if k in split]
    assert marked["recompute"] == []
    path = plot_plan(p, plan, str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").stat().st_size > 0 and path.endswith("plan.png")


def test_chunk_counts_are_the_divisors_above_one():
    """Every divisor of the option's divisor (found in O(sqrt n): a vocabulary's rows are a
    divisor the search asks about thousands of times)."""
    from tvm_ext.swap.split import SplitOption, chunk_counts

    for n in (2, 12, 97, 4096, 4 * 50257):
        option = SplitOption(0, n, (0,), (), (1,))
        assert chunk_counts(option, [1 << 20, 1 << 20]) == \
            [c for c in range(2, n + 1) if n % c == 0]


def _update(options) -> SwapProblem:
    """g = op0(w) (a gradient); op1 updates p and m in place from g (an optimizer step): p and
    m are 4 KiB arguments on the host, g 4 KiB; `options` are op1's split options."""
    return SwapProblem(
        op_names=["op0", "op1"], durations=[1.0, 1.0], op_deps=[[], [0]],
        op_inputs=[[0], [1, 2, 3]], op_outputs=[[2], []], op_scratch=[[], []],
        op_phases=["backward", "update"], tensor_names=["w", "p", "g", "m"],
        sizes=[256, 4096, 4096, 4096], tensor_kinds=["input", "parameter", "activation",
                                                     "state"],
        producers=[-1, -1, 0, -1], host_start=[True, True, False, True], pinned=[False] * 4,
        outputs=[1, 3], budget=1 << 20, h2d_bandwidth=4096.0, h2d_latency=0.0,
        d2h_bandwidth=4096.0, d2h_latency=0.0, op_writes=[[], [1, 3]],
        op_splits=[[], options])


def test_an_update_in_place_splits_where_each_chunk_reads_only_what_it_writes():
    """Chunk j of an elementwise update reads p's, g's and m's chunk j and writes p's: split,
    p streams in from its host buffer and its chunks go back there, so the update's floor
    falls from its three tensors whole to its chunk buffers. An option that reads p whole,
    cuts it along a later axis, or adds chunks up is refused: a chunk would read what another
    wrote."""
    safe = [0, 16, [1, 2, 3], [], [1, 3]]
    unsafe = [[1, 16, [2, 3], [1], [1, 3]],  # p read whole
              [2, 16, [1, 2, 3], [], [1, 3], [], [1]],  # p strided
              [3, 16, [1, 2, 3], [], [], [], [], True],  # chunks added up
              [4, 16, [1, 2, 3], [], [1]]]  # m written but not cut
    refused = _update(unsafe)
    assert refused.split_options()[1] == []
    assert refused.min_budget() == (3 * 4096, 1)
    p = _update([safe, *unsafe])
    assert [o.dim for o in p.split_options()[1]] == [0]
    floor = p.min_budget()[0]
    assert p.min_budget() == (256 + 4096, 0)  # the update is no longer the floor: op0 is
    fixed = np.zeros(p.num_tensors, dtype=bool)
    fixed[1] = True  # p kept on the device: its chunks would have no host copy to go to
    assert p.split_options()[1][0].on_device(fixed) is None
    plan = plan_swaps(p.with_budget(floor), "swapadvisor", time_budget_s=1.0)
    validate(p.with_budget(floor), plan)
    (sp,) = plan.splits
    assert {1, 3} <= set(sp.cut_inputs) and {1, 3} == set(sp.cut_outputs)
    assert {s.tensor for s in plan.swap_outs if s.after == sp.position} == {1, 3}
