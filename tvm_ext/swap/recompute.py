"""Recompute: a tensor dropped after one use and made again before a later one, instead of being
kept on the device or copied out and back.

A recompute choice is a set of tensors. `augment` turns a schedule (a topological order of the
ops) and the set into the sequence of op runs the swap derivation walks: the producer of each
chosen tensor runs a second time right before the use that ends the longest stretch of the
schedule in which the tensor is not used (for a training step's activation, its first backward
use), preceded by the second runs of the chosen tensors that run reads and no longer has
(chains, at most `MAX_CHAIN` runs deep). Between the two runs the tensor need not be on the
device and is never copied out: the derivation frees its window after its last use before the
second run, and the second run writes it into a window of its own (`_core.derive`).

Only one-output kernel ops are run again (`recomputable`): kernels are pure functions of their
inputs (Relax tensors are never written after they are made), so a second run makes the same
bytes; views, packed calls (collectives, copies) and kernels of several outputs are never
repeated. A tensor is a candidate when such an op makes it, it is neither an argument nor
returned, and at least `MIN_GAP` positions separate two of its consecutive uses; or when it is
read by the producer of such a candidate (a chain link, e.g. attention scores read only by the
softmax whose probabilities the backward pass reads): chosen, a chain link is never run again
on its own, only before a second run that reads it, which would otherwise keep it (or swap it)
from its first use to that run.

Heuristic seeds of the search (`cheapest_sets`, `checkpoint_set`): the tensors that cost least
compute per byte they free (and less than copying them out and back), up to a few fractions of
the iteration's compute; the classic recompute-only policy, keeping every ~sqrt(n)-th activation
a backward pass reads and recomputing the others.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from .problem import SwapProblem

MAX_CHAIN = 4  # second runs feeding one another, at most
MIN_GAP = 2  # positions between two uses for a drop to pay
# Seeds of the search: recompute adding at most these fractions of the iteration's compute.
SEED_FRACTIONS = (0.01, 0.02, 0.05, 0.1)


def recomputable(problem: SwapProblem) -> np.ndarray:
    """Per op: whether it may run a second time: a kernel with one output that writes nothing
    in place and reads nothing another op writes in place (a second run after that write would
    read the new value)."""
    return np.array([problem.may_run_again(op) for op in range(problem.num_ops)], dtype=bool)


class _Uses:
    """The positions at which each tensor is used under an order (the positions of the ops
    that need it, increasing), and per tensor used at least twice its drop point: the use
    ending the longest gap between consecutive uses (the first such), and that gap; built
    with array operations (the search asks for them at every evaluation)."""

    def __init__(self, problem: SwapProblem, order: np.ndarray):
        need_ptr, need_idx, _ = problem.needs_csr()
        lengths = np.diff(need_ptr)[order]
        total = int(lengths.sum())
        offsets = np.cumsum(lengths) - lengths
        gather = np.repeat(need_ptr[order] - offsets, lengths) + np.arange(total)
        tensors = need_idx[gather]
        by_tensor = np.argsort(tensors, kind="stable")
        self.pos = np.repeat(np.arange(len(order), dtype=np.int64), lengths)[by_tensor]
        count = np.bincount(tensors, minlength=problem.num_tensors)
        self.ptr = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
        self.count = count
        self.drop_index = np.full(problem.num_tensors, -1, dtype=np.int64)
        self.drop_gap = np.full(problem.num_tensors, -1, dtype=np.int64)
        multi = np.nonzero(count >= 2)[0]
        if not len(multi):
            return
        seg = np.repeat(np.arange(problem.num_tensors), count)
        same = seg[1:] == seg[:-1]
        gaps = np.where(same, np.diff(self.pos), -1)
        starts = self.ptr[multi]
        longest = np.maximum.reduceat(gaps, starts)
        full = np.full(problem.num_tensors, -2, dtype=np.int64)
        full[multi] = longest
        at = np.where(same & (gaps == full[seg[:-1]]), np.arange(len(gaps)), len(gaps))
        self.drop_index[multi] = np.minimum.reduceat(at, starts) - starts + 1
        self.drop_gap[multi] = longest

    def of(self, t: int) -> np.ndarray:
        return self.pos[self.ptr[t]:self.ptr[t + 1]]

    def drop_point(self, t: int) -> tuple[int, int]:
        """(use index ending the longest gap between consecutive uses, that gap)."""
        return int(self.drop_index[t]), int(self.drop_gap[t])


def candidates(problem: SwapProblem, order) -> np.ndarray:
    """Tensors that may be recomputed under `order`, chain links included (see the module
    docstring)."""
    order = np.asarray(order, dtype=np.int64)
    ok = recomputable(problem)
    returned = np.zeros(problem.num_tensors, dtype=bool)
    returned[problem.outputs] = True
    uses = _Uses(problem, order)
    eligible = [t for t in range(problem.num_tensors)
                if problem.producers[t] >= 0 and ok[problem.producers[t]] and not returned[t]
                and not problem.pinned[t] and not problem.host_start[t]
                and problem.sizes[t] > 0 and uses.count[t] >= 2]
    gapped = {t for t in eligible if uses.drop_gap[t] >= MIN_GAP}
    read = {x for t in gapped for x in problem.op_inputs[problem.producers[t]]}
    return np.asarray([t for t in eligible if t in gapped or t in read], dtype=np.int64)


def chain_links(problem: SwapProblem, order, cands: np.ndarray) -> np.ndarray:
    """Per candidate: whether it is a chain link only (no gap of its own to drop it in)."""
    uses = _Uses(problem, np.asarray(order, dtype=np.int64))
    return uses.drop_gap[np.asarray(cands, dtype=np.int64)] < MIN_GAP


def augment(problem: SwapProblem, order, chosen) -> np.ndarray:
    """The op runs of `order` with the second runs of the producers of `chosen` tensors (see
    the module docstring); `order` itself when nothing is chosen."""
    order = np.asarray(order, dtype=np.int64)
    chosen = [int(t) for t in chosen]
    if not chosen:
        return order
    uses = _Uses(problem, order)
    at: dict[int, int] = {}  # tensor -> position its second run goes before
    for t in chosen:
        j, gap = uses.drop_point(t)
        if gap >= MIN_GAP:  # a chain link runs again only before a run that reads it
            at[t] = int(uses.of(t)[j])
    position = np.empty(problem.num_ops, dtype=np.int64)
    position[order] = np.arange(len(order))
    # A chosen input of a second run is made again before it, unless it is still there (not
    # yet dropped: its own drop point lies after that run); deepest first (a producer runs
    # before its consumers), MAX_CHAIN deep.
    chosen_set = set(chosen)
    depth = dict.fromkeys(at, 0)
    heap = [(-int(position[problem.producers[t]]), t) for t in at]
    heapq.heapify(heap)
    while heap:
        _, t = heapq.heappop(heap)
        if depth[t] + 1 > MAX_CHAIN:
            continue
        for x in problem.op_inputs[problem.producers[t]]:
            if x in chosen_set and at.get(x, len(order)) > at[t] and \
                    _dropped_before(uses, x, at[t]):
                if x not in depth:
                    heapq.heappush(heap, (-int(position[problem.producers[x]]), x))
                at[x] = at[t]
                depth[x] = max(depth.get(x, 0), depth[t] + 1)
    if not at:
        return order
    before = np.fromiter(at.values(), dtype=np.int64, count=len(at))
    ops = np.asarray(problem.producers, dtype=np.int64)[np.fromiter(at, dtype=np.int64,
                                                                    count=len(at))]
    # Second runs in the order of their first ones: inputs before the runs that read them.
    rank = np.lexsort((position[ops], before))
    return np.insert(order, before[rank], ops[rank]).astype(np.int64)


def _dropped_before(uses: _Uses, x: int, pos: int) -> bool:
    """Whether tensor `x` is not used in the gap ending at `pos` (so a run at `pos` finds it
    dropped): its longest gap ends at or after `pos` (a chain link: its last use is before
    `pos`)."""
    j, gap = uses.drop_point(x)
    mine = uses.of(x)
    return int(mine[j - 1]) < pos if gap >= MIN_GAP else int(mine[-1]) < pos


def cheapest_sets(problem: SwapProblem, cands: np.ndarray,
                  fractions=SEED_FRACTIONS) -> list[np.ndarray]:
    """Per fraction f: the candidates that cost least recompute time per byte they free, as
    many as add at most f of the iteration's compute time; only those whose producer takes
    less time than copying them out and back."""
    producers = np.asarray(problem.producers, dtype=np.int64)[cands]
    seconds = problem.durations[producers]
    link = np.array([problem.transfer_time(b, "d2h") + problem.transfer_time(b, "h2d")
                     for b in problem.sizes[cands]])
    cheap = seconds < link
    ranked = cands[cheap][np.argsort(seconds[cheap] / problem.sizes[cands][cheap],
                                     kind="stable")]
    added = np.cumsum(problem.durations[np.asarray(problem.producers)[ranked]])
    total = float(problem.durations.sum())
    return [ranked[:int(np.searchsorted(added, f * total, side="right"))] for f in fractions]


def checkpoint_set(problem: SwapProblem, order, cands: np.ndarray) -> np.ndarray:
    """The recompute-only baseline: of the candidates made in the forward pass and read in the
    backward pass, keep every ~sqrt(n)-th (in schedule order) and recompute the others."""
    order = np.asarray(order, dtype=np.int64)
    position = np.empty(problem.num_ops, dtype=np.int64)
    position[order] = np.arange(len(order))
    backward_reads = np.zeros(problem.num_tensors, dtype=bool)
    for op in range(problem.num_ops):
        if problem.op_phases[op] == "backward":
            backward_reads[problem.op_inputs[op]] = True
    spanning = [int(t) for t in cands if backward_reads[t] and
                problem.op_phases[problem.producers[t]] == "forward"]
    spanning.sort(key=lambda t: position[problem.producers[t]])
    if not spanning:
        return np.zeros(0, dtype=np.int64)
    every = max(1, round(math.sqrt(len(spanning))))
    return np.asarray([t for k, t in enumerate(spanning) if k % every != every - 1],
                      dtype=np.int64)
