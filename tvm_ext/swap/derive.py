"""From (schedule, memory layout, policy knobs) to a scored SwapPlan: the compiled swap
derivation (`_core.derive`) and simulation behind every planner, SwapAdvisor's size classes,
and the initial-residency decision.

Size classes: the distinct tensor sizes (`size_classes`); a layout gives each class a number
of objects, at least the most tensors of that class any op needs at once (`min_counts`), and
the plan gets one pool per class of objects x object bytes.

Initial residency: arguments start on the host and are fetched into the arena when needed,
except those kept on the device across calls (outside the arena): the smallest up to a
fraction `keep` of the budget (each fetch costs a link latency, so many tiny fetches of biases
and norm weights cost more than the bytes they would free), and before them, up to a fraction
`keep_exposed`, those whose copies no schedule can hide behind compute (`exposure.py`: a tied
embedding read at the start and updated with its moments at the end).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import numpy as np

from . import _core, exposure
from .alignment import ALIGNMENT
from .orders import reference_order
from .plan import Residency, Split, SwapIn, SwapOut, SwapPlan
from .problem import SwapProblem
from .recompute import augment
from .simulator import link, makespan_of, simulate
from .split import (
    SplitOption,
    added_seconds,
    choose_splits,
    largest_working_set,
    scratch_bytes,
)

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
    fraction of small arguments kept on the device, and `keep_exposed`, that of the arguments
    whose copies no schedule can hide."""

    beta: float = 1.0  # link time of evictions
    gamma: float = 1.0  # stall of the tensor being placed
    delta: float = 0.0  # Belady: prefer evicting tensors used far in the future
    keep: float = 0.02
    # copy an argument back to the host right after its final in-place update (overlapping
    # the ops after it), rather than when it is evicted or the call ends
    write_back: bool = True
    # the budget fraction for the arguments whose copies no schedule hides (`exposure.py`),
    # kept on the device before the small ones
    keep_exposed: float = 0.0


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
    op_ready: np.ndarray  # when compute could have started each op, had it not waited
    runs: np.ndarray  # the op at each position: the order with its recompute runs
    recomputed: np.ndarray  # tensors made again (recompute): their producers run twice
    split: SplitSetup  # ops split in time


@dataclasses.dataclass
class SplitSetup:
    """Ops split in time (`split.py`) and the derivation's graph with them: a split op's cut
    tensors leave its needs for its streams, and its chunk buffers are a scratch tensor of its
    own (ids after the problem's)."""

    choice: dict[int, tuple[SplitOption, int, int]]  # op -> (option, chunks, buffers)
    scratch: dict[int, int]  # op -> its scratch tensor
    graph: _core.Graph
    fixed: np.ndarray  # with the scratch tensors (never fixed)
    host_start: np.ndarray

    @property
    def padding(self) -> int:
        return len(self.scratch)

    @classmethod
    def build(cls, p: SwapProblem, choice: dict, fixed: np.ndarray,
              is_output: np.ndarray) -> SplitSetup:
        n_t = p.num_tensors
        scratch = {op: n_t + k for k, op in enumerate(sorted(choice))}
        needs, streams, outs, chunks = [], [], [], np.zeros(p.num_ops, dtype=np.int64)
        durations = p.durations.copy()
        for op in range(p.num_ops):
            if op not in choice:
                needs.append(p.needs(op))
                streams.append([])
                outs.append([])
                continue
            option, c, buffers = choice[op]
            durations[op] += added_seconds(p, option, c, buffers)
            cut = {*option.cut_inputs, *option.cut_outputs}
            needs.append([t for t in p.needs(op) if t not in cut] + [scratch[op]])
            streams.append(list(option.cut_inputs))
            outs.append(list(option.cut_outputs))
            chunks[op] = c
        extra = [scratch_bytes(p.sizes, *choice[op]) for op in sorted(choice)]
        sizes = np.concatenate([p.sizes, np.asarray(extra, dtype=np.int64)]).astype(np.int64)
        producer = np.concatenate([np.asarray(p.producers, dtype=np.int64),
                                   np.asarray(sorted(choice), dtype=np.int64)])
        pad = np.zeros(len(choice), dtype=bool)
        end_on_host = np.zeros(n_t, dtype=bool)
        end_on_host[list(p.end_on_host or [])] = True
        writer = np.concatenate([p.writer(), np.full(len(choice), -1, dtype=np.int64)])
        graph = _core.Graph(*_csr(needs), producer, sizes, durations,
                            np.concatenate([is_output, pad]), *_csr(streams), *_csr(outs),
                            chunks, writer, np.concatenate([end_on_host, pad]))
        return cls(choice, scratch, graph, np.concatenate([fixed, pad]),
                   np.concatenate([p.host_start, pad]))


def _split_info(p: SwapProblem, splits: list[Split]) -> dict:
    """What splitting in time adds to a plan: ops split, the bytes their streams move."""
    cut = [t for s in splits for t in (*s.cut_inputs, *s.cut_outputs)]
    return {"split_ops": len(splits), "bytes_split": int(p.sizes[cut].sum()) if cut else 0}


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
    idx = np.asarray([t for x in lists for t in x], dtype=np.int64)
    return ptr, idx


class Evaluator:
    """Scores schedules of one problem under one policy; `plan()` builds the SwapPlan."""

    def __init__(self, problem: SwapProblem, mode: str = "swapadvisor"):
        problem.check_feasible()
        self.problem = problem
        self.mode = MODES[mode]
        self.mode_name = mode
        self.need_ptr, self.need_idx, self.need_op = problem.needs_csr()
        self.producer = np.asarray(problem.producers, dtype=np.int64)
        self.is_output = np.zeros(problem.num_tensors, dtype=bool)
        self.is_output[problem.outputs] = True
        self.link = link(problem)
        self.evaluations = 0
        self._counting = threading.Lock()  # searches score on several threads
        self._fixed_cache: dict[tuple[float, float], tuple[np.ndarray, int]] = {}
        self._splits: dict[tuple[float, float], SplitSetup] = {}
        self.split_options = problem.split_options()
        self.class_sizes, self.class_of = size_classes(problem)
        self._min_counts: dict[tuple[float, float], np.ndarray] = {}

    # ---------------------------------------------------------------- residency
    def fixed(self, keep: float, exposed: float = 0.0) -> tuple[np.ndarray, int]:
        """(tensors on the device for the whole call, arena bytes): the arguments whose copies
        no schedule hides, most exposed first, while they fit an `exposed` fraction of the
        budget, then the smallest others while they fit a `keep` fraction; then the last one
        kept is dropped until every op fits the arena (small ones before exposed ones)."""
        key = (keep, exposed)
        if key in self._fixed_cache:
            return self._fixed_cache[key]
        p = self.problem
        fixed = p.pinned.copy()
        chosen: list[int] = []
        for order, share in ((self.exposed_order, exposed), (self.small_order, keep)):
            room = share * (p.budget - p.pinned_bytes)
            for t in order.tolist():
                if p.sizes[t] <= room and not fixed[t]:
                    chosen.append(t)
                    fixed[t] = True
                    room -= int(p.sizes[t])
        while True:
            arena = self._arena(fixed)
            if arena >= self._max_working_set(fixed) or not chosen:
                break
            fixed[chosen.pop()] = False
        self._fixed_cache[key] = (fixed, arena)
        return fixed, arena

    @functools.cached_property
    def small_order(self) -> np.ndarray:
        """The arguments that may start on the host, smallest first."""
        args = self.problem.movable_arguments()
        return args[np.argsort(self.problem.sizes[args], kind="stable")]

    @functools.cached_property
    def exposed_order(self) -> np.ndarray:
        """The arguments whose copies no schedule hides, most exposed first
        (`exposure.exposed_arguments` in the `orders.reference_order`)."""
        return exposure.exposed_arguments(self.problem, reference_order(self.problem))[0]

    def _arena(self, fixed: np.ndarray) -> int:
        free = self.problem.budget - int(self.problem.sizes[fixed].sum())
        return max(free // ALIGNMENT * ALIGNMENT, 0)

    def _max_working_set(self, fixed: np.ndarray) -> int:
        """The most any op needs in the arena, split in time where that needs less."""
        return largest_working_set(self.problem, fixed)[0]

    # ---------------------------------------------------------------- splitting in time
    def splits(self, keep: float, exposed: float = 0.0) -> SplitSetup:
        """The ops split in time for a `keep` fraction (those that do not fit the arena
        whole: `split.choose_splits`) and the derivation's graph with them."""
        key = (keep, exposed)
        if key not in self._splits:
            fixed, arena = self.fixed(keep, exposed)
            self._splits[key] = SplitSetup.build(self.problem,
                                                 choose_splits(self.problem, arena, fixed),
                                                 fixed, self.is_output)
        return self._splits[key]

    # ---------------------------------------------------------------- size classes
    def min_counts(self, keep: float, exposed: float = 0.0) -> np.ndarray:
        """Objects each size class needs at least: the most tensors of that class one op
        needs at once (arguments kept on the device aside)."""
        key = (keep, exposed)
        if key not in self._min_counts:
            fixed, _ = self.fixed(keep, exposed)
            cls = self.class_of[self.need_idx]
            sel = (cls >= 0) & ~fixed[self.need_idx]
            per_op = np.zeros((self.problem.num_ops, len(self.class_sizes)), dtype=np.int64)
            np.add.at(per_op, (self.need_op[sel], cls[sel]), 1)
            self._min_counts[key] = per_op.max(axis=0) if len(per_op) else \
                np.zeros(len(self.class_sizes), dtype=np.int64)
        return self._min_counts[key]

    def repair(self, counts: np.ndarray, keep: float, exposed: float = 0.0
               ) -> np.ndarray | None:
        """`counts` raised to the minimum, capped at the class's tensor count and cut to the
        arena (largest slack first); None when size classes cannot fit this budget at all."""
        low = self.min_counts(keep, exposed)
        _, arena = self.fixed(keep, exposed)
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

    def initial_counts(self, keep: float, spread: float = 1.0, exposed: float = 0.0
                       ) -> np.ndarray | None:
        """Objects per class in proportion to each class's peak demand in the no-swap run of
        the IR order (`spread` < 1 leans towards the minimum), scaled to fill the arena."""
        low = self.min_counts(keep, exposed)
        _, arena = self.fixed(keep, exposed)
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
        return self.repair(counts, keep, exposed)

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

    def layout_arrays(self, counts: np.ndarray | None, padding: int = 0) -> _core.Layout:
        """The size-class layout of `counts` objects per class (an arena when None), for the
        problem's tensors and `padding` scratch tensors after them (an arena)."""
        if counts is None:
            none = np.zeros(1, dtype=np.int64)
            return _core.Layout(np.full(self.problem.num_tensors + padding, -1, dtype=np.int64),
                                none, none, none)
        sizes = self.class_sizes
        base = np.concatenate([[0], np.cumsum(counts * sizes)[:-1]]).astype(np.int64)
        return _core.Layout(np.concatenate([self.class_of, np.full(padding, -1)]).astype(
            np.int64), base, sizes, np.asarray(counts, dtype=np.int64))

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
    def run(self, order: np.ndarray, knobs: Knobs, counts: np.ndarray | None = None,
            recompute: np.ndarray | None = None) -> Evaluation:  # long: one derivation
        """Derive and simulate `order` with one arena, or with size classes of `counts`
        objects each, making the `recompute` tensors again before their late uses
        (`recompute.augment`; SwapAdvisor's policy only)."""
        p = self.problem
        order = np.asarray(order, dtype=np.int64)
        recompute = np.zeros(0, dtype=np.int64) if recompute is None else \
            np.asarray(recompute, dtype=np.int64)
        if len(recompute) and self.mode != _core.SWAPADVISOR:
            raise ValueError("recompute is planned with SwapAdvisor's policy only")
        _, arena = self.fixed(knobs.keep, knobs.keep_exposed)
        split = self.splits(knobs.keep, knobs.keep_exposed)
        if len(recompute) and split.choice:
            # A split op streams its outputs to the host as it makes them: a second run of it
            # would copy them out again and free nothing.
            recompute = recompute[~np.isin(self.producer[recompute], list(split.choice))]
        runs = augment(p, order, recompute)
        if len(recompute):  # chain links no second run reads are not made again
            ops, times = np.unique(runs, return_counts=True)
            recompute = recompute[np.isin(self.producer[recompute], ops[times > 1])]
        if split.choice and counts is not None:
            raise ValueError("size classes cannot hold the chunk buffers of split ops")
        if counts is not None:
            arena = int((np.asarray(counts) * self.class_sizes).sum())
        # Plain floats and ints only: another argument type would compile another version.
        policy = _core.Policy(self.mode, float(knobs.beta), float(knobs.gamma),
                              float(knobs.delta), float(knobs.write_back))
        pad = split.padding
        derived = _core.derive(runs, split.graph, split.fixed, split.host_start, int(arena),
                               self.link, policy, np.concatenate([self.offload_after(order),
                                                                  np.full(pad, -1)]),
                               self.layout_arrays(counts, pad))
        ins, outs = derived.swap_ins, derived.swap_outs
        d_order, h_order, q_final = _core.fifo_orders(ins.after, ins.before, ins.valid,
                                                      ins.stream, outs.after, derived.big)
        sizes = split.graph.sizes
        sim = _core.simulate(split.graph.durations[runs], outs.after,
                             sizes[outs.tensor].astype(np.float64), d_order, q_final,
                             ins.before, ins.wait_key, sizes[ins.tensor].astype(np.float64),
                             h_order, derived.op_wait, self.link, derived.big,
                             split.graph.chunks[runs], ins.stream, outs.stream)
        with self._counting:
            self.evaluations += 1
        return Evaluation(makespan_of(p, sim), derived, d_order, h_order, q_final,
                          split.fixed[:p.num_tensors], arena, sim.op_start, sim.op_end,
                          sim.op_ready, runs, recompute, split)

    def score(self, order: np.ndarray, knobs: Knobs, counts: np.ndarray | None = None,
              recompute: np.ndarray | None = None) -> float:
        return self.run(order, knobs, counts, recompute).makespan

    def score_with_stalls(self, order: np.ndarray, knobs: Knobs,
                          counts: np.ndarray | None = None,
                          recompute: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """(simulated time, how long each op of `order`, by its position there, waited for
        copies; a second run's wait counts for the op it runs before)."""
        ev = self.run(order, knobs, counts, recompute)
        stalls = np.maximum(ev.op_start - ev.op_ready, 0.0)
        if len(ev.runs) == len(order):
            return ev.makespan, stalls
        # Each run's op of `order`: first runs are those ops, in order; a second run is placed
        # right before the op it serves, whose index is the number of first runs before it.
        first = np.zeros(len(ev.runs), dtype=np.int64)
        first[np.unique(ev.runs, return_index=True)[1]] = 1
        served = np.cumsum(first) - first
        return ev.makespan, np.bincount(served, weights=stalls, minlength=len(order))

    # ---------------------------------------------------------------- the plan
    def plan(self, order: np.ndarray, knobs: Knobs, planner: str,
             planning_time: float = 0.0, info: dict | None = None,
             counts: np.ndarray | None = None,
             recompute: np.ndarray | None = None) -> SwapPlan:
        """The SwapPlan of `order` under `knobs` (and size-class `counts`, `recompute`
        tensors), renumbered into stream order."""
        start = time.perf_counter()
        p = self.problem
        order = np.asarray(order, dtype=np.int64)
        ev = self.run(order, knobs, counts, recompute)
        d = ev.derived
        residencies, swap_outs, swap_ins, splits = self._tables(ev, counts)
        if counts is None:
            pools = [max((w.offset + w.nbytes for w in (*residencies, *splits)), default=0)]
            classes: list[list[int]] = []
        else:
            classes = [[int(self.class_sizes[c]), int(n)] for c, n in enumerate(counts) if n > 0]
            pools = [size * count for size, count in classes]
        fixed = ev.fixed
        plan = SwapPlan(
            planner=planner, budget=p.budget, schedule=ev.runs.tolist(),
            pools=[int(x) for x in pools], size_classes=classes,
            pinned=np.nonzero(fixed)[0].tolist(),
            host_start=np.nonzero(p.host_start & ~fixed)[0].tolist(),
            outputs_on_host=[t for t in p.outputs if not d.end_on_device[t] and not fixed[t]],
            residencies=residencies, swap_outs=swap_outs, swap_ins=swap_ins,
            predicted_time=ev.makespan,
            predicted_peak=int(sum(pools)) + int(p.sizes[fixed].sum()), splits=splits,
            planning_time=planning_time,
            info={"layout": "arena" if counts is None else "size classes",
                  "arena": int(ev.arena), "fallbacks": int(d.fallbacks),
                  "max_segments": int(d.max_segments), "placements": int(d.placements),
                  "beta": knobs.beta, "gamma": knobs.gamma, "delta": knobs.delta,
                  "keep": knobs.keep, "keep_exposed": knobs.keep_exposed,
                  # the other modes leave arguments where eviction puts them
                  **({"write_back": knobs.write_back} if self.mode == _core.SWAPADVISOR
                     else {}),
                  **self.recompute_info(ev), **_split_info(p, splits),
                  **(info or {})})
        sim = simulate(p, plan)
        if abs(sim.makespan - ev.makespan) > 1e-9 * max(1.0, ev.makespan):
            raise AssertionError(f"simulator disagrees with the search core: {sim.makespan} "
                                 f"vs {ev.makespan}")
        plan.info["peak_live"] = sim.peak_memory
        plan.planning_time = planning_time + (time.perf_counter() - start)
        return plan

    def recompute_info(self, ev: Evaluation) -> dict:
        """What recompute adds to a plan: tensors made again, their bytes, the compute time
        of the second runs."""
        p = self.problem
        extra = float(p.durations[ev.runs].sum() - p.durations.sum())
        return {"recomputed": len(ev.recomputed),
                "bytes_recomputed": int(p.sizes[ev.recomputed].sum()),
                "recompute_s": max(extra, 0.0)}

    def _tables(self, ev: Evaluation, counts: np.ndarray | None
                ) -> tuple[list[Residency], list[SwapOut], list[SwapIn], list[Split]]:
        """The residencies, swap-outs, swap-ins and splits of a derivation, in the plan's
        numbering: copies in stream order, residencies in pools (one per size class with
        objects); a split's scratch tensor is its chunk buffers' window."""
        sizes = ev.split.graph.sizes
        n_t = self.problem.num_tensors
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
        residencies, splits = [], []
        for r in valid:
            if res.tensor[r] >= n_t:
                splits.append(self._split(ev, r, int(pool_of[r]), int(base[pool_of[r]]),
                                          out_index(int(res.wait_key[r]))))
                continue
            e = res.swap_in[r]
            begin = int(ev.q_final[e] + 1) if e >= 0 else int(res.begin[r])
            residencies.append(Residency(
                int(res.tensor[r]), int(pool_of[r]), int(res.offset[r] - base[pool_of[r]]),
                int(sizes[res.tensor[r]]), begin, int(res.end[r]),
                "swap_in" if e >= 0 else "produced", int(h_index[e]) if e >= 0 else -1,
                out_index(int(res.wait_key[r]))))
        kept = [r for r in valid if res.tensor[r] < n_t]
        res_of_h2d = {int(res.swap_in[r]): k for k, r in enumerate(kept) if res.swap_in[r] >= 0}
        # A split op's streamed inputs have no window of their own (residency -1).
        swap_ins = [SwapIn(int(ins.tensor[e]), int(ev.q_final[e]), int(ins.before[e]),
                           int(sizes[ins.tensor[e]]), res_of_h2d.get(int(e), -1),
                           out_index(int(ins.wait_key[e]))) for e in ev.h_order]
        return residencies, swap_outs, swap_ins, sorted(splits, key=lambda s: s.position)

    def _split(self, ev: Evaluation, r: int, pool: int, base: int, wait: int) -> Split:
        """The split whose scratch tensor has residency `r` (made and dead at its op)."""
        res = ev.derived.residencies
        op = int(ev.runs[res.begin[r]])
        option, chunks, buffers = ev.split.choice[op]
        return Split(int(res.begin[r]), op, option.dim, chunks, pool,
                     int(res.offset[r] - base), int(ev.split.graph.sizes[res.tensor[r]]),
                     list(option.cut_inputs), list(option.whole_inputs),
                     list(option.cut_outputs), wait, buffers, list(option.viewed_inputs),
                     option.accumulate, option.epilogue, option.epilogue_bytes,
                     [list(pair) for pair in option.halo_bytes], option.outer_dim,
                     option.outer_chunks)

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
