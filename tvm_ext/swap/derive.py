"""From (schedule, policy knobs) to a scored SwapPlan: the compiled swap derivation
(`_core.derive`) and simulation behind every planner, plus the initial-residency decision.

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

MODES = {"swapadvisor": _core.SWAPADVISOR, "lru": _core.LRU, "vdnn": _core.VDNN}


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Policy weights of the swapadvisor derivation (see `_core`), and `keep`, the budget
    fraction of small arguments kept on the device."""

    beta: float = 1.0  # link time of evictions
    gamma: float = 1.0  # stall of the tensor being placed
    delta: float = 0.0  # Belady: prefer evicting tensors used far in the future
    keep: float = 0.02

    def as_tuple(self) -> tuple:
        return (self.beta, self.gamma, self.delta, self.keep)


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
        self.evaluations = 0
        self._fixed_cache: dict[float, tuple[np.ndarray, int]] = {}

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
    def run(self, order: np.ndarray, knobs: Knobs):
        p = self.problem
        order = np.asarray(order, dtype=np.int64)
        fixed, arena = self.fixed(knobs.keep)
        # Plain floats and ints only: another argument type would compile another version.
        raw = _core.derive(order, self.need_ptr, self.need_idx, self.producer, p.sizes,
                           p.host_start, fixed, self.is_output, p.durations, int(arena),
                           float(p.h2d_bandwidth), float(p.h2d_latency),
                           float(p.d2h_bandwidth), float(p.d2h_latency),
                           self.mode, float(knobs.beta), float(knobs.gamma), float(knobs.delta),
                           self.offload_after(order))
        h_t, h_q, h_r, h_dep, h_valid, d_t, d_p, op_wait = raw[7:15]
        big = raw[17]
        d_order, h_order, q_final = _core.fifo_orders(h_q, h_r, h_valid, d_p, big)
        sim = _core.simulate(p.durations[order], d_p, p.sizes[d_t].astype(np.float64), d_order,
                             q_final, h_r, h_dep, p.sizes[h_t].astype(np.float64), h_order,
                             op_wait, p.h2d_bandwidth, p.h2d_latency, p.d2h_bandwidth,
                             p.d2h_latency, big)
        op_e, d_e = sim[1], sim[3]
        makespan = max(op_e[-1] if len(op_e) else 0.0, d_e.max() if len(d_e) else 0.0)
        self.evaluations += 1
        return float(makespan), (raw, d_order, h_order, q_final, fixed, arena)

    def score(self, order: np.ndarray, knobs: Knobs) -> float:
        return self.run(order, knobs)[0]

    # ---------------------------------------------------------------- the plan
    def plan(self, order: np.ndarray, knobs: Knobs, planner: str,
             planning_time: float = 0.0, info: dict | None = None) -> SwapPlan:
        """The SwapPlan of `order` under `knobs`, renumbered into stream order."""
        from .simulator import simulate

        start = time.perf_counter()
        p = self.problem
        order = np.asarray(order, dtype=np.int64)
        makespan, (raw, d_order, h_order, q_final, fixed, arena) = self.run(order, knobs)
        (r_t, r_off, r_begin, r_end, r_h2d, r_wait, r_valid, h_t, h_q, h_r, h_dep, _,
         d_t, d_p, _, end_dev, fallbacks, big, max_segments, placements) = raw
        d_index = np.empty(len(d_order), dtype=np.int64)
        d_index[d_order] = np.arange(len(d_order))
        h_index = np.full(len(h_q), -1, dtype=np.int64)
        h_index[h_order] = np.arange(len(h_order))
        swap_outs = [SwapOut(int(d_t[e]), int(d_p[e]), int(p.sizes[d_t[e]])) for e in d_order]

        def out_index(key: int) -> int:
            return -1 if key < 0 else int(d_index[key % big])

        valid = np.nonzero(r_valid)[0]
        res_index = np.full(len(r_valid), -1, dtype=np.int64)
        res_index[valid] = np.arange(len(valid))
        residencies = []
        for r in valid:
            e = r_h2d[r]
            begin = int(q_final[e] + 1) if e >= 0 else int(r_begin[r])
            residencies.append(Residency(
                int(r_t[r]), 0, int(r_off[r]), int(p.sizes[r_t[r]]), begin, int(r_end[r]),
                "swap_in" if e >= 0 else "produced", int(h_index[e]) if e >= 0 else -1,
                out_index(int(r_wait[r]))))
        res_of_h2d = {int(r_h2d[r]): int(res_index[r]) for r in valid if r_h2d[r] >= 0}
        swap_ins = [SwapIn(int(h_t[e]), int(q_final[e]), int(h_r[e]), int(p.sizes[h_t[e]]),
                           res_of_h2d[int(e)], out_index(int(h_dep[e]))) for e in h_order]
        pool = max((r.offset + r.nbytes for r in residencies), default=0)
        pinned = np.nonzero(fixed)[0].tolist()
        host_start = np.nonzero(p.host_start & ~fixed)[0].tolist()
        outputs_on_host = [t for t in p.outputs if not end_dev[t] and not fixed[t]]
        plan = SwapPlan(
            planner=planner, budget=p.budget, schedule=order.tolist(),
            pools=[int(pool)], pinned=pinned, host_start=host_start,
            outputs_on_host=outputs_on_host, residencies=residencies, swap_outs=swap_outs,
            swap_ins=swap_ins, predicted_time=makespan,
            predicted_peak=int(pool) + int(p.sizes[fixed].sum()), planning_time=planning_time,
            info={"arena": int(arena), "fallbacks": int(fallbacks),
                  "max_segments": int(max_segments), "placements": int(placements),
                  "beta": knobs.beta, "gamma": knobs.gamma, "delta": knobs.delta,
                  "keep": knobs.keep, **(info or {})})
        sim = simulate(p, plan)
        if abs(sim.makespan - makespan) > 1e-9 * max(1.0, makespan):
            raise AssertionError(f"simulator disagrees with the search core: {sim.makespan} "
                                 f"vs {makespan}")
        plan.info["peak_live"] = sim.peak_memory
        plan.planning_time = planning_time + (time.perf_counter() - start)
        return plan
