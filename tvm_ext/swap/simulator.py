"""Simulate one iteration of a plan on three streams: compute, device-to-host, host-to-device.

Compute runs the ops in schedule order, one at a time. Each copy stream runs its copies in
the plan's order (the order the pass issues them), one at a time; a copy takes
latency + bytes / bandwidth. Two costs of the runtime that are 0 on the GPU presets and
measured on the CPU stand-in (`tvm_ext.driver.measure_runtime_costs`): issuing a copy to an
idle copy stream takes `copy_issue` seconds of the compute stream (it wakes the stream's worker)
and the copy starts `sync_latency` after that, or, with a measured `copy_wake` curve, both
depend on how long the stream was idle (a worker asleep longer wakes slower; the copy may start
before the hand-over ends); a stream that stalls on another's event (an op on its swap-in, a
copy on the swap-out it must follow) resumes `sync_latency` after the event. Dependencies:
  * a swap-out starts after the op it is issued after has finished;
  * a swap-in starts after the op it is issued after, and after the swap-out it waits for
    (the previous holder of its window, and its own data if it was swapped out before);
  * an op starts after its predecessor in the schedule, its swap-ins, and the swap-out of
    whatever its outputs' windows held.
The makespan is the end of the last op or copy. Device memory at time t is the pinned bytes
plus the bytes of every residency holding its window at t: from its op's start (produced) or
its copy's start (swapped in) to its last op's end, or to the end of its swap-out.
`validate` checks a plan's invariants, including those only a simulation shows (device memory
within the budget, each swap-in after its data's swap-out).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import _core
from .plan import PlanError, SwapPlan
from .problem import SwapProblem
from .split import added_seconds


@dataclasses.dataclass
class SimResult:
    makespan: float
    op_start: np.ndarray  # by position
    op_end: np.ndarray
    d2h_start: np.ndarray  # by swap-out index
    d2h_end: np.ndarray
    h2d_start: np.ndarray  # by swap-in index
    h2d_end: np.ndarray
    memory_times: np.ndarray  # step function: bytes from memory_times[k] on
    memory_bytes: np.ndarray
    op_ready: np.ndarray | None = None  # by position: when compute could have started it

    @property
    def stalls(self) -> list[tuple[float, float]]:
        """The spans during which the compute stream waited for a copy."""
        if self.op_ready is None:
            return []
        return [(float(r), float(s)) for r, s in zip(self.op_ready, self.op_start, strict=True)
                if s > r]

    def timelines(self, plan: SwapPlan) -> dict[str, list[tuple[int, float, float]]]:
        """Per stream, (op id or tensor id, start, end) of each event in stream order."""
        return {
            "compute": [(op, float(s), float(e)) for op, s, e in
                        zip(plan.schedule, self.op_start, self.op_end, strict=True)],
            "d2h": [(c.tensor, float(s), float(e)) for c, s, e in
                    zip(plan.swap_outs, self.d2h_start, self.d2h_end, strict=True)],
            "h2d": [(c.tensor, float(s), float(e)) for c, s, e in
                    zip(plan.swap_ins, self.h2d_start, self.h2d_end, strict=True)],
        }

    @property
    def peak_memory(self) -> int:
        return int(self.memory_bytes.max()) if self.memory_bytes.size else 0


def simulate(problem: SwapProblem, plan: SwapPlan) -> SimResult:
    """Times and device memory of one iteration of `plan` (see the module docstring)."""
    n = len(plan.schedule)
    dur = problem.durations[np.asarray(plan.schedule, dtype=np.int64)] if n else np.zeros(0)
    dur = dur.copy()
    big = len(plan.swap_outs) + 1
    d_p = np.array([s.after for s in plan.swap_outs], dtype=np.int64)
    d_bytes = np.array([s.nbytes for s in plan.swap_outs], dtype=np.float64)

    def key(idx: int) -> int:
        return -1 if idx < 0 else int(plan.swap_outs[idx].after) * big + idx

    h_q = np.array([s.after for s in plan.swap_ins], dtype=np.int64)
    h_r = np.array([s.before for s in plan.swap_ins], dtype=np.int64)
    h_dep = np.array([key(s.wait_swap_out) for s in plan.swap_ins], dtype=np.int64)
    h_bytes = np.array([s.nbytes for s in plan.swap_ins], dtype=np.float64)
    op_wait = np.full(n, -1, dtype=np.int64)
    for r in plan.residencies:
        if r.source == "produced" and r.wait_swap_out >= 0:
            op_wait[r.begin] = max(op_wait[r.begin], key(r.wait_swap_out))
    # Split ops: their chunks, their streamed inputs (no window) and outputs.
    chunks = np.zeros(n, dtype=np.int64)
    streamed_out = set()
    for sp in plan.splits:
        chunks[sp.position] = sp.chunks
        dur[sp.position] += added_seconds(problem, sp.option(sp.chunks), sp.chunks, sp.buffers)
        if sp.wait_swap_out >= 0:
            op_wait[sp.position] = max(op_wait[sp.position], key(sp.wait_swap_out))
        streamed_out |= {(t, sp.position) for t in sp.cut_outputs}
    h_stream = np.array([s.residency < 0 for s in plan.swap_ins], dtype=bool)
    d_stream = np.array([(s.tensor, s.after) in streamed_out for s in plan.swap_outs],
                        dtype=bool)
    tl = _core.simulate(
        dur, d_p, d_bytes, np.arange(len(d_p), dtype=np.int64), h_q, h_r, h_dep, h_bytes,
        np.arange(len(h_q), dtype=np.int64), op_wait, link(problem), big, chunks, h_stream,
        d_stream)
    makespan = makespan_of(problem, tl)
    times, nbytes = _memory(problem, plan, tl.op_start, tl.op_end, tl.d2h_end, tl.h2d_start,
                            makespan)
    return SimResult(makespan, op_start=tl.op_start, op_end=tl.op_end, d2h_start=tl.d2h_start,
                     d2h_end=tl.d2h_end, h2d_start=tl.h2d_start, h2d_end=tl.h2d_end,
                     memory_times=times, memory_bytes=nbytes, op_ready=tl.op_ready)


def makespan_of(problem: SwapProblem, tl) -> float:
    """The end of the compute stream (the last op and the copies issued after it), or of the
    last swap-out, which the final `wait_all` stalls for."""
    compute = float(tl.compute_end)
    copies = float(tl.d2h_end.max()) if len(tl.d2h_end) else 0.0
    return compute if copies <= compute else copies + problem.sync_latency


def link(problem: SwapProblem) -> _core.Link:
    """The problem's copy links, as the compiled core takes them."""
    # Plain floats and float64 arrays only: other argument types would compile other versions
    # of the core.
    idle, issue, start = np.asarray(wake_curve(problem), dtype=np.float64).T.copy()
    return _core.Link(float(problem.h2d_bandwidth), float(problem.h2d_latency),
                      float(problem.d2h_bandwidth), float(problem.d2h_latency),
                      float(problem.sync_latency), idle, issue, start)


def wake_curve(problem: SwapProblem) -> tuple[tuple[float, float, float], ...]:
    """(stream idle s, compute-stream s to hand it a copy, s from then to the copy's start),
    by idle time: the problem's measured curve, or `copy_issue` and the copy starting
    `sync_latency` after it whatever the idle time."""
    if problem.copy_wake:
        return problem.copy_wake
    return ((0.0, problem.copy_issue, problem.copy_issue + problem.sync_latency),)


def validate(problem: SwapProblem, plan: SwapPlan) -> None:
    """Raise `PlanError` unless `plan` holds the invariants of `SwapPlan.check_structure`
    and, simulated, never takes more device memory than the budget nor starts a swap-in
    before the swap-out of its tensor has finished."""
    plan.check_structure(problem)
    if plan.planner == "ideal":
        return
    swapped_out_at = {s.tensor: k for k, s in enumerate(plan.swap_outs)}
    result = simulate(problem, plan)
    if result.memory_bytes.size and result.memory_bytes.max() > problem.budget:
        raise PlanError("simulated device memory exceeds the budget")
    for k, s in enumerate(plan.swap_ins):
        out = swapped_out_at.get(s.tensor)
        # (An argument fetched, overwritten in place and written back is copied out after.)
        if out is not None and plan.swap_outs[out].after <= s.after and \
                result.h2d_start[k] < result.d2h_end[out] - 1e-12:
            raise PlanError(f"swap-in {k} starts before its swap-out has finished")


def _memory(problem, plan, op_s, op_e, d_e, h_s, makespan):
    pinned = int(sum(problem.sizes[t] for t in plan.pinned))
    starts, ends, sizes = [], [], []
    if plan.planner == "ideal":
        # No windows: every tensor lives from its producer's start to its last use's end.
        position = {op: i for i, op in enumerate(plan.schedule)}
        first, last = {}, {}
        for op in plan.schedule:
            for t in problem.needs(op):
                if t in plan.pinned:
                    continue
                first.setdefault(t, op_s[position[op]])
                last[t] = op_e[position[op]]
        for t in problem.outputs:
            last[t] = makespan
        for t, s in first.items():
            starts.append(s)
            ends.append(last[t])
            sizes.append(problem.sizes[t])
    else:
        out_end = {(s.tensor, s.after): float(e) for s, e in zip(plan.swap_outs, d_e,
                                                                  strict=True)}
        n = len(plan.schedule)
        for r in plan.residencies:
            begin = op_s[r.begin] if r.source == "produced" else h_s[r.swap_in]
            end = out_end.get((r.tensor, r.end), op_e[r.end])
            if r.end == n - 1 and r.tensor in problem.outputs and \
                    r.tensor not in plan.outputs_on_host:
                end = makespan
            starts.append(begin)
            ends.append(max(end, op_e[r.end]))
            sizes.append(r.nbytes)
        for sp in plan.splits:
            # Its chunk buffers, from its first streamed input to its last streamed output.
            ins = [h_s[k] for k, si in enumerate(plan.swap_ins)
                   if si.residency < 0 and si.before == sp.position]
            outs = [out_end[(t, sp.position)] for t in sp.cut_outputs]
            starts.append(min([op_s[sp.position], *ins]))
            ends.append(max([op_e[sp.position], *outs]))
            sizes.append(sp.nbytes)
    if not starts:
        return np.array([0.0]), np.array([pinned], dtype=np.int64)
    t = np.concatenate([starts, ends])
    delta = np.concatenate([sizes, -np.asarray(sizes)])
    # At equal times, releases come before acquisitions (a window is reused after release).
    order = np.lexsort((delta, t))
    times = t[order]
    level = np.cumsum(delta[order]) + pinned
    keep = np.append(times[1:] != times[:-1], True)
    return np.concatenate([[0.0], times[keep]]), np.concatenate([[pinned], level[keep]])
