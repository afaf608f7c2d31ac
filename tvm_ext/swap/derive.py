"""From (schedule, memory layout, policy knobs) to a scored SwapPlan: the compiled swap
derivation (`_core.derive`) and simulation behind every planner, SwapAdvisor's size classes,
and the initial-residency decision.

Size classes: the distinct tensor sizes (`size_classes`); a layout gives each class a number
of objects, at least the most tensors of that class any op needs at once (`min_counts`), and
the plan gets one pool per class of objects x object bytes.

Initial residency: arguments start on the host and are fetched into the arena when needed,
except the smallest ones, kept on the device for the whole call (outside the arena) up to a
fraction `keep` of the budget: each fetch costs a link latency, so many tiny fetches (biases,
norm weights) cost more than the bytes they would free.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from . import _core
from .plan import Residency, SwapIn, SwapOut, SwapPlan
from .problem import ALIGNMENT, SwapProblem
from .simulator import link, simulate

MODES = {"swapadvisor": _core.SWAPADVISOR, "lru": _core.LRU, "vdnn": _core.VDNN}
CLASS_TOLERANCE = 0.05  # sizes within 5% share a class (e.g. 500 MiB tensors in 512 MiB objects)


def size_classes(problem: SwapProblem) -> tuple[np.ndarray, np.ndarray]:
    """SwapAdvisor's size classes: the distinct (aligned) sizes of the tensors the pools
    hold, largest first, a size joining the class above it when within CLASS_TOLERANCE.
    Returns (object bytes per class, class of each tensor or -1)."""
    sizes = problem.sizes
    planned = (sizes > 0) & ~problem.pinned
    distinct = np.unique(sizes[planned])[::-1]
    bounds: list[int] = []
    for size in distinct:
        if not bounds or size < bounds[-1] * (1 - CLASS_TOLERANCE):
            bounds.append(int(size))
    class_sizes = np.array(bounds, dtype=np.int64)
    class_of = np.full(problem.num_tensors, -1, dtype=np.int64)
    if len(class_sizes):
        # The smallest class at least as large as the tensor (class_sizes is descending).
        idx = np.searchsorted(-class_sizes, -sizes[planned], side="right") - 1
        class_of[planned] = idx
    return class_sizes, class_of


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Policy weights of the swapadvisor derivation (see `_core`), and `keep`, the budget
    fraction of small arguments kept on the device."""

    beta: float = 1.0  # link time of evictions
    gamma: float = 1.0  # stall of the tensor being placed
    delta: float = 0.0  # Belady: prefer evicting tensors used far in the future
    keep: float = 0.02


@dataclasses.dataclass
class Evaluation:
    """One schedule derived (`_core.Derivation`) and simulated."""

    makespan: float
    derived: _core.Derivation
    d_order: np.ndarray  # swap-out ids in d2h stream order
    h_order: np.ndarray  # valid swap-in ids in h2d stream order
    q_final: np.ndarray  # issue position of each swap-in, raised to keep the stream order
    fixed: np.ndarray  # tensors on the device for the whole call
    arena: int  # bytes of the planned region
    op_start: np.ndarray  # simulated, by position
    op_end: np.ndarray


class Evaluator:
    """Scores schedules of one problem under one policy; `plan()` builds the SwapPlan."""

    def __init__(self, problem: SwapProblem, mode: str = "swapadvisor"):
        problem.check_feasible()
        self.problem = problem
        self.mode = MODES[mode]
        self.mode_name = mode
        counts = [len(problem.needs(op)) for op in range(problem.num_ops)]
        self.need_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.need_idx = np.array([t for op in range(problem.num_ops) for t in problem.needs(op)],
                                 dtype=np.int64)
        self.need_op = np.repeat(np.arange(problem.num_ops), counts)
        self.producer = np.asarray(problem.producers, dtype=np.int64)
        self.is_output = np.zeros(problem.num_tensors, dtype=bool)
        self.is_output[problem.outputs] = True
        end_on_host = np.zeros(problem.num_tensors, dtype=bool)
        end_on_host[problem.end_on_host] = True
        self.graph = _core.Graph(self.need_ptr, self.need_idx, self.producer, problem.sizes,
                                 problem.durations, self.is_output, problem.writer(),
                                 end_on_host)
        self.link = link(problem)
        self.evaluations = 0
        self._fixed_cache: dict[float, tuple[np.ndarray, int]] = {}
        self.class_sizes, self.class_of = size_classes(problem)
        self._min_counts: dict[float, np.ndarray] = {}

    # ---------------------------------------------------------------- residency
    def fixed(self, keep: float) -> tuple[np.ndarray, int]:
        """(tensors on the device for the whole call, arena bytes) for a `keep` fraction."""
        if keep in self._fixed_cache:
            return self._fixed_cache[keep]
        p = self.problem
        fixed = p.pinned.copy()
        args = np.nonzero(p.host_start & ~p.pinned & (p.sizes > 0))[0]
        args = args[np.argsort(p.sizes[args], kind="stable")]
        allowance = keep * (p.budget - p.pinned_bytes)
        chosen = args[np.cumsum(p.sizes[args]) <= allowance]
        fixed[chosen] = True
        while True:
            arena = self._arena(fixed)
            if arena >= self._max_working_set(fixed) or not chosen.size:
                break
            fixed[chosen[-1]] = False  # drop the largest kept argument until the ops fit
            chosen = chosen[:-1]
        self._fixed_cache[keep] = (fixed, arena)
        return fixed, arena

    def _arena(self, fixed: np.ndarray) -> int:
        free = self.problem.budget - int(self.problem.sizes[fixed].sum())
        return max(free // ALIGNMENT * ALIGNMENT, 0)

    def _max_working_set(self, fixed: np.ndarray) -> int:
        w = self.problem.sizes[self.need_idx] * ~fixed[self.need_idx]
        return int(np.bincount(self.need_op, weights=w, minlength=self.problem.num_ops).max()) \
            if len(w) else 0

    # ---------------------------------------------------------------- size classes
    def min_counts(self, keep: float) -> np.ndarray:
        """Objects each size class needs at least: the most tensors of that class one op
        needs at once (arguments kept on the device aside)."""
        if keep not in self._min_counts:
            fixed, _ = self.fixed(keep)
            cls = self.class_of[self.need_idx]
            sel = (cls >= 0) & ~fixed[self.need_idx]
            per_op = np.zeros((self.problem.num_ops, len(self.class_sizes)), dtype=np.int64)
            np.add.at(per_op, (self.need_op[sel], cls[sel]), 1)
            self._min_counts[keep] = per_op.max(axis=0) if len(per_op) else \
                np.zeros(len(self.class_sizes), dtype=np.int64)
        return self._min_counts[keep]

    def repair(self, counts: np.ndarray, keep: float) -> np.ndarray | None:
        """`counts` raised to the minimum, capped at the class's tensor count and cut to the
        arena (largest slack first); None when size classes cannot fit this budget at all."""
        low = self.min_counts(keep)
        _, arena = self.fixed(keep)
        sizes = self.class_sizes
        if int((low * sizes).sum()) > arena:
            return None
        # No class needs more objects than it has tensors.
        most = np.maximum(np.bincount(self.class_of[self.class_of >= 0],
                                      minlength=len(sizes)), low)
        counts = np.clip(np.asarray(counts, dtype=np.int64), low, most)
        excess = int((counts * sizes).sum()) - arena
        while excess > 0:
            slack = np.nonzero(counts > low)[0]
            c = slack[np.argmax(sizes[slack])] if excess >= sizes[slack].max() else \
                slack[np.argmin(np.where(sizes[slack] >= excess, sizes[slack], 1 << 62))]
            counts[c] -= 1
            excess -= int(sizes[c])
        return counts

    def initial_counts(self, keep: float, spread: float = 1.0) -> np.ndarray | None:
        """Objects per class in proportion to each class's peak demand in the no-swap run of
        the IR order (`spread` < 1 leans towards the minimum), scaled to fill the arena."""
        low = self.min_counts(keep)
        _, arena = self.fixed(keep)
        demand = np.maximum(self._peak_demand(), low).astype(np.float64)
        sizes = self.class_sizes
        if int((low * sizes).sum()) > arena:
            return None
        lo, hi = 0.0, 1.0
        while int((np.floor(demand * hi) * sizes).sum()) <= arena and hi < 1e6:
            lo, hi = hi, hi * 2
        for _ in range(40):
            mid = (lo + hi) / 2
            if int((np.maximum(np.floor(low + (demand - low) * mid * spread), low) * sizes)
                   .sum()) <= arena:
                lo = mid
            else:
                hi = mid
        counts = np.maximum(np.floor(low + (demand - low) * lo * spread), low).astype(np.int64)
        # Fill what is left with objects of the classes most short of their demand.
        room = arena - int((counts * sizes).sum())
        for c in np.argsort(-(demand - counts) * sizes):
            add = min(room // int(sizes[c]), max(int(demand[c] - counts[c]), 0))
            counts[c] += add
            room -= add * int(sizes[c])
        return self.repair(counts, keep)

    def _peak_demand(self) -> np.ndarray:
        if not hasattr(self, "_demand"):
            p = self.problem
            n = p.num_ops
            first = np.full(p.num_tensors, n, dtype=np.int64)
            last = np.full(p.num_tensors, -1, dtype=np.int64)
            pos = np.empty(n, dtype=np.int64)
            pos[np.asarray(p.order)] = np.arange(n)
            np.minimum.at(first, self.need_idx, pos[self.need_op])
            np.maximum.at(last, self.need_idx, pos[self.need_op])
            last[np.asarray(p.outputs, dtype=np.int64)] = n - 1
            demand = np.zeros(len(self.class_sizes), dtype=np.int64)
            for c in range(len(self.class_sizes)):
                ts = np.nonzero((self.class_of == c) & (last >= 0))[0]
                delta = np.zeros(n + 1, dtype=np.int64)
                np.add.at(delta, first[ts], 1)
                np.add.at(delta, last[ts] + 1, -1)
                demand[c] = np.cumsum(delta).max() if len(ts) else 0
            self._demand = demand
        return self._demand

    def layout_arrays(self, counts: np.ndarray | None) -> _core.Layout:
        """The size-class layout of `counts` objects per class (an arena when None)."""
        if counts is None:
            none = np.zeros(1, dtype=np.int64)
            return _core.Layout(np.full(self.problem.num_tensors, -1, dtype=np.int64), none,
                                none, none)
        sizes = self.class_sizes
        base = np.concatenate([[0], np.cumsum(counts * sizes)[:-1]]).astype(np.int64)
        return _core.Layout(self.class_of, base, sizes, np.asarray(counts, dtype=np.int64))

    def offload_after(self, order: np.ndarray) -> np.ndarray:
        """vDNN: the position after which each forward activation read by the backward pass
        is offloaded (its last forward use), -1 for the others."""
        p = self.problem
        out = np.full(p.num_tensors, -1, dtype=np.int64)
        if self.mode != _core.VDNN:
            return out
        pos = np.empty(p.num_ops, dtype=np.int64)
        pos[order] = np.arange(len(order))
        last_fwd = np.full(p.num_tensors, -1, dtype=np.int64)
        used_bwd = np.zeros(p.num_tensors, dtype=bool)
        for op in range(p.num_ops):
            for t in p.needs(op):
                if p.op_phases[op] == "backward":
                    used_bwd[t] = True
                else:
                    last_fwd[t] = max(last_fwd[t], pos[op])
        act = np.array([k == "activation" for k in p.tensor_kinds])
        sel = act & used_bwd & (last_fwd >= 0)
        out[sel] = last_fwd[sel]
        return out

    # ---------------------------------------------------------------- scoring
    def run(self, order: np.ndarray, knobs: Knobs,
            counts: np.ndarray | None = None) -> Evaluation:
        """Derive and simulate `order` with one arena, or with size classes of `counts`
        objects each."""
        p = self.problem
        order = np.asarray(order, dtype=np.int64)
        fixed, arena = self.fixed(knobs.keep)
        if counts is not None:
            arena = int((np.asarray(counts) * self.class_sizes).sum())
        # Plain floats and ints only: another argument type would compile another version.
        policy = _core.Policy(self.mode, float(knobs.beta), float(knobs.gamma),
                              float(knobs.delta))
        derived = _core.derive(order, self.graph, fixed, p.host_start, int(arena), self.link,
                               policy, self.offload_after(order), self.layout_arrays(counts))
        ins, outs = derived.swap_ins, derived.swap_outs
        d_order, h_order, q_final = _core.fifo_orders(ins.after, ins.before, ins.valid,
                                                      outs.after, derived.big)
        sim = _core.simulate(p.durations[order], outs.after,
                             p.sizes[outs.tensor].astype(np.float64), d_order, q_final,
                             ins.before, ins.wait_key, p.sizes[ins.tensor].astype(np.float64),
                             h_order, derived.op_wait, self.link, derived.big)
        op_e, d_e = sim.op_end, sim.d2h_end
        makespan = max(op_e[-1] if len(op_e) else 0.0, d_e.max() if len(d_e) else 0.0)
        self.evaluations += 1
        return Evaluation(float(makespan), derived, d_order, h_order, q_final, fixed, arena,
                          sim.op_start, sim.op_end)

    def score(self, order: np.ndarray, knobs: Knobs, counts: np.ndarray | None = None) -> float:
        return self.run(order, knobs, counts).makespan

    def score_with_stalls(self, order: np.ndarray, knobs: Knobs,
                          counts: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """(simulated time, how long each position's op waited after its predecessor)."""
        ev = self.run(order, knobs, counts)
        stalls = ev.op_start - np.concatenate([[0.0], ev.op_end[:-1]])
        return ev.makespan, np.maximum(stalls, 0.0)

    # ---------------------------------------------------------------- the plan
    def plan(self, order: np.ndarray, knobs: Knobs, planner: str,
             planning_time: float = 0.0, info: dict | None = None,
             counts: np.ndarray | None = None) -> SwapPlan:
        """The SwapPlan of `order` under `knobs` (and size-class `counts`), renumbered into
        stream order."""
        start = time.perf_counter()
        p = self.problem
        order = np.asarray(order, dtype=np.int64)
        ev = self.run(order, knobs, counts)
        d = ev.derived
        residencies, swap_outs, swap_ins = self._tables(ev, counts)
        if counts is None:
            pools = [max((r.offset + r.nbytes for r in residencies), default=0)]
            classes: list[list[int]] = []
        else:
            classes = [[int(self.class_sizes[c]), int(n)] for c, n in enumerate(counts) if n > 0]
            pools = [size * count for size, count in classes]
        fixed = ev.fixed
        plan = SwapPlan(
            planner=planner, budget=p.budget, schedule=order.tolist(),
            pools=[int(x) for x in pools], size_classes=classes,
            pinned=np.nonzero(fixed)[0].tolist(),
            host_start=np.nonzero(p.host_start & ~fixed)[0].tolist(),
            outputs_on_host=[t for t in p.outputs if not d.end_on_device[t] and not fixed[t]],
            residencies=residencies, swap_outs=swap_outs, swap_ins=swap_ins,
            predicted_time=ev.makespan,
            predicted_peak=int(sum(pools)) + int(p.sizes[fixed].sum()),
            planning_time=planning_time,
            info={"layout": "arena" if counts is None else "size classes",
                  "arena": int(ev.arena), "fallbacks": int(d.fallbacks),
                  "max_segments": int(d.max_segments), "placements": int(d.placements),
                  "beta": knobs.beta, "gamma": knobs.gamma, "delta": knobs.delta,
                  "keep": knobs.keep, **(info or {})})
        sim = simulate(p, plan)
        if abs(sim.makespan - ev.makespan) > 1e-9 * max(1.0, ev.makespan):
            raise AssertionError(f"simulator disagrees with the search core: {sim.makespan} "
                                 f"vs {ev.makespan}")
        plan.info["peak_live"] = sim.peak_memory
        plan.planning_time = planning_time + (time.perf_counter() - start)
        return plan

    def _tables(self, ev: Evaluation, counts: np.ndarray | None
                ) -> tuple[list[Residency], list[SwapOut], list[SwapIn]]:
        """The residencies, swap-outs and swap-ins of a derivation, in the plan's numbering:
        copies in stream order, residencies in pools (one per size class with objects)."""
        sizes = self.problem.sizes
        res, ins, outs = ev.derived.residencies, ev.derived.swap_ins, ev.derived.swap_outs
        big = ev.derived.big
        d_index = np.empty(len(ev.d_order), dtype=np.int64)
        d_index[ev.d_order] = np.arange(len(ev.d_order))
        h_index = np.full(len(ins.after), -1, dtype=np.int64)
        h_index[ev.h_order] = np.arange(len(ev.h_order))
        swap_outs = [SwapOut(int(outs.tensor[e]), int(outs.after[e]), int(sizes[outs.tensor[e]]))
                     for e in ev.d_order]

        def out_index(key: int) -> int:
            return -1 if key < 0 else int(d_index[key % big])

        valid = np.nonzero(res.valid)[0]
        res_index = np.full(len(res.valid), -1, dtype=np.int64)
        res_index[valid] = np.arange(len(valid))
        pool_of, base = self._pools(res.tensor, counts)
        residencies = []
        for r in valid:
            e = res.swap_in[r]
            begin = int(ev.q_final[e] + 1) if e >= 0 else int(res.begin[r])
            residencies.append(Residency(
                int(res.tensor[r]), int(pool_of[r]), int(res.offset[r] - base[pool_of[r]]),
                int(sizes[res.tensor[r]]), begin, int(res.end[r]),
                "swap_in" if e >= 0 else "produced", int(h_index[e]) if e >= 0 else -1,
                out_index(int(res.wait_key[r]))))
        res_of_h2d = {int(res.swap_in[r]): int(res_index[r]) for r in valid
                      if res.swap_in[r] >= 0}
        swap_ins = [SwapIn(int(ins.tensor[e]), int(ev.q_final[e]), int(ins.before[e]),
                           int(sizes[ins.tensor[e]]), res_of_h2d[int(e)],
                           out_index(int(ins.wait_key[e]))) for e in ev.h_order]
        return residencies, swap_outs, swap_ins

    def _pools(self, tensors: np.ndarray, counts: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray]:
        """(pool of each residency of `tensors`, offset of each pool in the derivation's
        region): one arena, or one pool per size class that has objects."""
        if counts is None:
            return np.zeros(len(tensors), dtype=np.int64), np.zeros(1, dtype=np.int64)
        used = np.nonzero(np.asarray(counts) > 0)[0]
        pool_index = np.full(len(counts), -1, dtype=np.int64)
        pool_index[used] = np.arange(len(used))
        return pool_index[self.class_of[tensors]], self.layout_arrays(counts).base[used]
