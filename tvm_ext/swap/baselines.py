"""Baseline planners, scored by the same simulator as SwapAdvisor.

* `ideal`: infinite device memory: everything resident, nothing swapped; the time is the sum
  of the op durations in the IR's order.
* `lru`: on-demand swapping: a tensor is copied in right before the op that needs it, and the
  least recently used tensors are evicted (copied out first if they have no host copy) to
  make room. Nothing overlaps but the two copy streams.
* `vdnn` (Rhu et al., MICRO 2016): forward activations that the backward pass reads are
  offloaded right after their last forward use and prefetched one op ahead of their use in
  the backward pass; everything else is swapped on demand as in `lru`. Like vDNN_dyn, it
  falls back to offloading nothing (on demand only) when that is faster.
* `checkpoint` (Chen et al. 2016, sqrt(n) checkpointing): the recompute-only policy: of the
  activations the backward pass reads, every ~sqrt(n)-th is kept and the others are made again
  before their backward use (`recompute.checkpoint_set`); what still does not fit (weights, the
  checkpoints themselves) is swapped by SwapAdvisor's derivation.
All run the IR's schedule with the same arena and stream model as SwapAdvisor, and the best
of a few initial-residency choices (`KEEP_CHOICES`).
"""

from __future__ import annotations

import time

import numpy as np

from .derive import Evaluator, Knobs
from .plan import SwapPlan
from .problem import SwapProblem
from .recompute import candidates, checkpoint_set


def ideal(problem: SwapProblem) -> SwapPlan:
    """Infinite memory: the lower bound on iteration time."""
    start = time.perf_counter()
    order = list(problem.order)
    on_device = np.nonzero(problem.host_start | problem.pinned)[0].tolist()
    return SwapPlan(
        planner="ideal", budget=problem.budget, schedule=order, pools=[], pinned=on_device,
        host_start=[], outputs_on_host=[], residencies=[], swap_outs=[], swap_ins=[],
        size_classes=[], predicted_time=float(problem.durations.sum()),
        predicted_peak=problem.no_swap_peak(),
        planning_time=time.perf_counter() - start)


# Budget fractions that small arguments may hold on the device; each baseline takes its best,
# so that it is not handicapped by a residency choice its own policy does not make.
KEEP_CHOICES = (0.0, 0.02, 0.1, 0.25, 0.5, 0.75, 1.0)


def _best_of(problem: SwapProblem, modes: tuple[str, ...], planner: str,
             recompute: np.ndarray | None = None) -> SwapPlan:
    start = time.perf_counter()
    order = np.asarray(problem.order, dtype=np.int64)
    best = None
    for mode in modes:
        evaluator = Evaluator(problem, mode)
        for keep in KEEP_CHOICES:
            t = evaluator.score(order, Knobs(keep=keep), recompute=recompute)
            if best is None or t < best[0]:
                best = (t, evaluator, Knobs(keep=keep), mode)
    _, evaluator, knobs, mode = best
    return evaluator.plan(order, knobs, planner, planning_time=time.perf_counter() - start,
                          info={"policy": mode}, recompute=recompute)


def lru(problem: SwapProblem) -> SwapPlan:
    """On-demand swap-in, least-recently-used eviction."""
    return _best_of(problem, ("lru",), "lru")


def checkpoint(problem: SwapProblem) -> SwapPlan:
    """sqrt(n) checkpointing: recompute every activation the backward pass reads but every
    ~sqrt(n)-th; swap only what still does not fit."""
    order = np.asarray(problem.order, dtype=np.int64)
    chosen = checkpoint_set(problem, order, candidates(problem, order))
    return _best_of(problem, ("swapadvisor",), "checkpoint", chosen)


def vdnn(problem: SwapProblem) -> SwapPlan:
    """vDNN_dyn: the faster of offloading every activation the backward pass reads
    (vDNN_all, the rest on demand) and offloading none (everything on demand), as vDNN picks
    its policy from a profiling run."""
    return _best_of(problem, ("vdnn", "lru"), "vdnn")
