"""Seed schedules of the swap search: topological orders of a problem's ops that hold
tensors for less time than the IR's (memory-aware greedy, as late as possible, the backward
made where it is read, updates right after their gradients), and the reference order that
ranks which arguments to keep on the device (`reference_order`)."""

from __future__ import annotations

import heapq

import numpy as np

from .problem import SwapProblem


def successors(problem: SwapProblem) -> list[list[int]]:
    """Each op's distinct successors: the ops that name it in their `op_deps`."""
    succs: list[list[int]] = [[] for _ in range(problem.num_ops)]
    for op in range(problem.num_ops):
        for d in set(problem.op_deps[op]):
            succs[d].append(op)
    return succs


def in_degrees(problem: SwapProblem) -> np.ndarray:
    """Each op's number of distinct predecessors."""
    return np.array([len(set(d)) for d in problem.op_deps], dtype=np.int64)


def positions(order) -> np.ndarray:
    """The position of each op in `order`."""
    pos = np.empty(len(order), dtype=np.int64)
    pos[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
    return pos


def memory_aware_order(problem: SwapProblem) -> list[int]:
    """A greedy topological order that runs, among the ready ops, the one that adds the
    fewest bytes (outputs made minus inputs freed), ties broken by IR position.

    A ready op's bytes change only when one of its inputs comes down to its last reader, so
    the ready ops sit in a heap whose stale entries (an older stamp) are skipped."""
    n = problem.num_ops
    ir_pos = positions(problem.order)
    succs, indeg = successors(problem), in_degrees(problem)
    readers: list[list[int]] = [[] for _ in range(problem.num_tensors)]
    for op in range(n):
        for t in problem.op_inputs[op]:
            readers[t].append(op)
    _, need_idx, _ = problem.needs_csr()
    remaining = np.bincount(need_idx, minlength=problem.num_tensors)
    keep = problem.host_start | problem.pinned
    keep[problem.outputs] = True
    sizes = problem.sizes
    made = [int(sizes[problem.op_outputs[op]].sum()) for op in range(n)]

    def delta(op: int) -> int:
        return made[op] - sum(int(sizes[t]) for t in problem.op_inputs[op]
                              if remaining[t] == 1 and not keep[t])

    stamp = np.zeros(n, dtype=np.int64)
    ready = np.zeros(n, dtype=bool)
    heap = []
    for op in np.nonzero(indeg == 0)[0].tolist():
        ready[op] = True
        heap.append((delta(op), int(ir_pos[op]), op, 0))
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, _, best, version = heapq.heappop(heap)
        if version != stamp[best] or not ready[best]:
            continue
        ready[best] = False
        order.append(best)
        changed: set[int] = set()
        for t in problem.needs(best):
            remaining[t] -= 1
            if remaining[t] == 1:
                changed.update(r for r in readers[t] if ready[r])
        for s in succs[best]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready[s] = True
                changed.add(s)
        for op in changed:
            stamp[op] += 1
            heapq.heappush(heap, (delta(op), int(ir_pos[op]), op, int(stamp[op])))
    return order


def as_late_as_possible_order(problem: SwapProblem) -> list[int]:
    """A topological order that runs each op as late as its consumers allow (built backwards
    from the end, latest IR position first): tensors are made just before they are used,
    e.g. a weight's transpose right before its matmul rather than at the top of the IR."""
    n = problem.num_ops
    ir_pos = positions(problem.order)
    succ_count = np.array([len(s) for s in successors(problem)], dtype=np.int64)
    ready = [(-int(ir_pos[op]), op) for op in range(n) if succ_count[op] == 0]
    heapq.heapify(ready)
    backwards: list[int] = []
    while ready:
        _, op = heapq.heappop(ready)
        backwards.append(op)
        for d in set(problem.op_deps[op]):
            succ_count[d] -= 1
            if succ_count[d] == 0:
                heapq.heappush(ready, (-int(ir_pos[d]), d))
    return backwards[::-1]


def late_backward_order(problem: SwapProblem, base) -> list[int]:
    """`base` with every op of the backward phase moved to right before its first consumer
    (the last op first, so that a chain moves with its end), the others in their order. A
    training step's IR makes what the backward reads again (activations recomputed for it,
    attention probabilities) and many of its gradients at the top of the backward, far from
    their uses; here each is made right before its first use, so it is held for that
    stretch only instead of being held, or swapped out and back, across the whole
    backward."""
    succs = successors(problem)
    order = np.asarray(base, dtype=np.int64).copy()
    pos = positions(order)
    for op in reversed(np.asarray(base).tolist()):
        if problem.op_phases[op] != "backward" or not succs[op]:
            continue
        k, target = int(pos[op]), int(pos[succs[op]].min()) - 1
        if target > k:
            order[k:target] = order[k + 1:target + 1].copy()
            order[target] = op
            pos[order[k:target + 1]] = np.arange(k, target + 1)
    return order.tolist()


def early_update_order(problem: SwapProblem, base) -> list[int]:
    """`base` with every op that only feeds in-place updates (an optimizer step's update of a
    parameter and its state, and what only those updates read: its gradient's last kernels,
    the step's bias corrections) moved as early as its inputs allow: each runs as soon as the
    last op it follows has run, so a gradient is consumed where it is made. The other ops keep
    their order."""
    succs, indeg = successors(problem), in_degrees(problem)
    returned = set(problem.outputs)
    pos = positions(base)
    feeds_updates = np.zeros(problem.num_ops, dtype=bool)
    for op in reversed(list(base)):  # successors first
        feeds_updates[op] = bool(problem.op_writes[op]) or (
            bool(succs[op]) and all(feeds_updates[s] for s in succs[op])
            and not returned.intersection(problem.op_outputs[op]))
    order: list[int] = []
    # Update-side ops whose inputs are made, by position in `base`.
    ready = [(int(pos[op]), op) for op in np.nonzero(feeds_updates & (indeg == 0))[0].tolist()]
    heapq.heapify(ready)

    def run(op: int) -> None:
        order.append(op)
        for s in succs[op]:
            indeg[s] -= 1
            if indeg[s] == 0 and feeds_updates[s]:
                heapq.heappush(ready, (int(pos[s]), s))

    for op in base:
        if not feeds_updates[op]:
            run(int(op))
        while ready:
            run(heapq.heappop(ready)[1])
    return order


def reference_order(problem: SwapProblem) -> list[int]:
    """The order whose stretches of compute say which copies nothing can hide
    (`exposure.keep_order`): the IR's with its backward made where it is read and its
    updates right after their gradients, the way a budgeted step runs; the IR's runs every
    update at the end, where no update's write-back could overlap anything."""
    return early_update_order(problem, late_backward_order(problem, problem.order))
