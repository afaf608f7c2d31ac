"""Measured swapped runs (tvm_ext/driver/measure_swap.py) on the CPU stand-in with a slow
emulated link: outputs stay exact (within the float tolerance where a vendor-library kernel
runs in chunks), the traced iteration has every kernel (a split op's once per chunk) and copy on
its lane in order, and the runtime's own costs are measured."""

from __future__ import annotations

import itertools

import pytest
import tvm

from tvm_ext import driver
from tvm_ext.cost.emulation import fixed_link
from tvm_ext.ir.targets import vm_devices
from tvm_ext.models import get_model
from tvm_ext.models.reference import tolerance
from tvm_ext.runtime import swap_streams
from tvm_ext.swap import SwapIn, plan_swaps, simulate
from tvm_ext.swap.exactness import inexact_splits
from tvm_ext.swap.measured import compare
from tvm_ext.swap.placement import argument_devices
from tvm_ext.swap.problem import problem_for_budget
from tvm_ext.swap.split import chunk_kernel_name

LLVM = tvm.target.Target("llvm")
SLOW = fixed_link(0.02, 1000.0)  # 20 MB/s, 1 ms per copy: slower than the tiny kernels
REPEAT = 2


@pytest.fixture(scope="module")
def swapped():
    """mlp tiny's training step at its smallest budget (LRU), run with the slow link on."""
    model = get_model("mlp", "tiny", training=True)
    graph = driver.fused_graph(model, LLVM)
    problem = problem_for_budget(graph, "min", "cpu")
    plan = plan_swaps(problem, "lru")
    assert plan.swap_ins and plan.swap_outs
    args = model.random_arguments(0)
    device, host = vm_devices(LLVM)
    plain_exe = driver.build(model, LLVM)
    plain = driver.measure_run(plain_exe, args, device, repeat=1)
    plain_call = driver.unswapped_call(plain_exe, args, device)
    copies_seen = []  # by each call of the unswapped module timed beside the swapped one

    def beside():
        copies_seen.append(sum(s.copies for s in swap_streams.stream_stats()))
        return plain_call()

    swap_streams.reset()
    swap_streams.set_emulated_link(SLOW.bandwidth, SLOW.latency)
    try:
        run = driver.measure_run(driver.build(model, LLVM, swap_plan=plan), args, device,
                                 host=host, arg_devices=argument_devices(graph, plan),
                                 repeat=REPEAT, beside=beside)
    finally:
        swap_streams.set_emulated_link(0.0)
    run.copies_seen = copies_seen
    return graph, problem, plan, plain, run


def test_swapped_run_stays_exact_with_the_emulated_link(swapped):
    graph, _, plan, plain, run = swapped
    # Bit for bit, unless a vendor-library kernel runs in chunks (`swap.exactness`).
    inexact = inexact_splits(graph, plan)
    driver.compare(run.outputs, plain.outputs,
                   tolerances=[tolerance(o.dtype) if inexact else (0.0, 0.0)
                               for o in run.outputs])
    # A split op's streamed tensors are copied a chunk at a time.
    copies = len(_copy_names(graph, plan, plan.swap_ins)) + \
        len(_copy_names(graph, plan, plan.swap_outs))
    summary = run.summary()
    assert summary["emulated_link"] == pytest.approx({"gbps": 0.02, "latency_us": 1000.0})
    # Every copy of every timed call went through the link (and none of the plain run's).
    assert summary["copies"] == summary["paced_copies"] == REPEAT * copies
    # The link is the bottleneck: a timed call takes at least its copies on one stream.
    per_stream = max(sum(SLOW.transfer_time(c.nbytes) for c in plan.swap_outs),
                     sum(SLOW.transfer_time(c.nbytes) for c in plan.swap_ins))
    assert min(run.latencies_ms) >= per_stream * 1e3
    assert 0.0 <= run.hidden_fraction <= 1.0
    assert 0.0 < run.cpu_share <= 1.05


def test_unswapped_module_timed_in_alternation(swapped):
    """`beside` runs before each timed call: the swapped calls' copies counted so far go up
    by one call's worth between its calls, and its own calls copy nothing."""
    *_, run = swapped
    per_call = run.summary()["copies"] // REPEAT
    assert per_call > 0
    assert run.copies_seen == [i * per_call for i in range(REPEAT)]
    assert len(run.beside_ms) == REPEAT and min(run.beside_ms) > 0.0
    assert run.beside_median_ms < run.median_ms  # the link slows the swapped one


def test_measured_timeline_has_every_kernel_and_copy_in_order(swapped):
    graph, problem, plan, _, run = swapped
    timeline = driver.timeline_of(run, graph, plan)
    assert plan.splits, "the smallest budget splits ops: their chunks are traced too"
    assert [name for name, _, _ in timeline.lanes["compute"]] == _kernel_calls(graph, plan)
    assert [n for n, _, _ in timeline.lanes["d2h"]] == _copy_names(graph, plan, plan.swap_outs)
    assert [n for n, _, _ in timeline.lanes["h2d"]] == _copy_names(graph, plan, plan.swap_ins)
    for lane in ("compute", "d2h", "h2d", "stall"):
        spans = timeline.lanes[lane]
        assert all(0.0 <= s <= e <= timeline.makespan for _, s, e in spans), lane
        # One thing at a time on each stream, in order.
        assert all(a[2] <= b[1] for a, b in itertools.pairwise(spans)), lane
    for lane in ("d2h", "h2d"):
        for name, s, e in timeline.lanes[lane]:
            assert e - s >= SLOW.latency, f"{lane} copy of {name} was not paced"
    assert timeline.lanes["stall"], "with a link this slow the compute waits for copies"
    cmp = compare(problem, plan, simulate(problem, plan), timeline)
    assert cmp["measured_s"] == timeline.makespan
    assert cmp["measured_d2h_s"] >= len(plan.swap_outs) * SLOW.latency


def _kernel_calls(graph, plan) -> list[str]:
    """The kernels `plan` runs, in order: a split op's chunk kernel once per chunk (a split
    that accumulates: its first chunk's kernel, then the adding one; an epilogue after)."""
    split_at = plan.split_at()
    calls = []
    for i, op in enumerate(plan.schedule):
        if graph.ops[op].kind != "kernel":
            continue
        sp = split_at.get(i)
        kernel = graph.ops[op].kernel
        if sp is None:
            calls.append(kernel)
            continue
        calls.append(chunk_kernel_name(kernel, sp.chunks, sp.dim))
        calls += [chunk_kernel_name(kernel, sp.chunks, sp.dim, sp.accumulate)] * (sp.chunks - 1)
        if sp.epilogue:
            calls.append(chunk_kernel_name(kernel, sp.chunks, sp.dim, epilogue=True))
    return calls


def _copy_names(graph, plan, copies) -> list[str]:
    """The copies one stream runs, by tensor name, in order: the tensors a split op streams
    go a chunk at a time, chunk by chunk across them."""
    split_at = plan.split_at()
    names: list[str] = []
    group: list[str] = []
    group_at = None

    def flush():
        names.extend(group * split_at[group_at].chunks if group else [])
        group.clear()

    for c in copies:
        if isinstance(c, SwapIn):  # streamed: no window of its own
            at = c.before if c.residency < 0 else None
        else:
            streamed = c.after in split_at and c.tensor in split_at[c.after].cut_outputs
            at = c.after if streamed else None
        streamed = at is not None
        if at != group_at:
            flush()
            group_at = at
        if streamed:
            group.append(graph.tensors[c.tensor].name)
        else:
            names.append(graph.tensors[c.tensor].name)
    flush()
    return names


def test_runtime_costs_are_measured():
    costs = driver.measure_runtime_costs(fixed_link(1.0, 200.0), samples=10,
                                         idle_gaps=(0.0, 2e-3))
    assert 0 < costs.copy_issue < 0.05
    # The hand-over by the stream's idle time, as it was measured (about the gaps asked).
    assert len(costs.wake) == 2
    (short, issue_short, start_short), (long, issue_long, start_long) = costs.wake
    assert 0 <= short < 1e-3 <= long < 0.05
    assert costs.copy_issue == issue_short
    assert 0 < issue_long < 0.05 and 0 < start_short < 0.05 and 0 < start_long < 0.05
    with pytest.raises(ValueError, match="idle times"):
        driver.measure_runtime_costs(fixed_link(1.0), idle_gaps=(-1.0,))
    assert 0 <= costs.sync < 0.05
    assert 0 <= costs.overshoot < 0.05
    assert swap_streams.emulated_link() is None, "the link in force before is restored"
