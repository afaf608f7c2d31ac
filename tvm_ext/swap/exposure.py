"""Which arguments' copies the compute around them cannot hide, most exposed first.

With the ops in a given order, an argument that starts the iteration on the host is copied in
before its first reader: that copy can overlap the compute before the reader, its `room`. One
updated in place is copied back after its last writer, overlapping the compute after it.
Copies one way share one link, so by the end of a room every copy whose room is no longer must
have crossed it: what the copies of the arguments with rooms up to r take beyond r is exposed,
and each of those arguments is charged with it. A tied embedding read by the first op and
updated with its two moments by the last pays its fetch and three write-backs in full, where
a middle layer's weight pays nothing. The order is the one a budgeted step runs in
(`orders.reference_order`: the backward made where it is read, each update right after its
gradient); in the IR's every update comes last, where every write-back would look exposed.

Keeping an argument on the device across iterations takes its copies off the link outright,
which keeping the smallest arguments (saving link latencies) does not; the search weighs both
(`derive.Knobs.keep_exposed`). `exposed_arguments` ranks greedily: the argument charged most,
then the charges again without it, until none is charged.
"""

from __future__ import annotations

import numpy as np

from .problem import SwapProblem


def copy_rooms(problem: SwapProblem, order) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the arguments that may start on the host; per argument and link, its room in
    seconds, `inf` where it makes no copy that way; its copy's seconds): rows [0] the copies
    in, [1] the write-backs, with the ops run in `order`: the compute before an argument's
    first reader, and after its last writer (of those updated in place)."""
    p, n = problem, problem.num_ops
    args = p.movable_arguments()
    rooms = np.full((2, len(args)), np.inf)
    if not n or not len(args):
        return args, rooms, np.zeros((2, len(args)))
    order = np.asarray(order, dtype=np.int64)
    ends = np.cumsum(p.durations[order])
    before = np.empty(n)
    before[order] = ends - p.durations[order]
    after = np.empty(n)
    after[order] = ends[-1] - ends
    column = {int(t): k for k, t in enumerate(args)}
    for op in range(n):
        for t in p.needs(op):
            if t in column:
                rooms[0, column[t]] = min(rooms[0, column[t]], before[op])
        for t in p.op_writes[op]:
            if t in column:
                rooms[1, column[t]] = min(rooms[1, column[t]], after[op])
    seconds = np.array([[p.transfer_time(float(p.sizes[t]), way) for t in args]
                        for way in ("h2d", "d2h")])
    return args, rooms, seconds


def _charges(rooms: np.ndarray, seconds: np.ndarray, by_room: np.ndarray,
             active: np.ndarray) -> np.ndarray:
    """Per argument, the exposed seconds of one link's copies (`rooms`, `seconds`, and the
    arguments in order of room, `by_room`) among the `active` arguments."""
    order = by_room[active[by_room] & np.isfinite(rooms[by_room])]
    charge = np.zeros(len(rooms))
    if not len(order):
        return charge
    room = rooms[order]
    done = np.cumsum(seconds[order])
    # Copies with equal rooms finish together: each is charged with the last of them.
    done = done[np.searchsorted(room, room, side="right") - 1]
    charge[order] = np.maximum(done - room, 0.0)
    return charge


def exposed_arguments(problem: SwapProblem, order) -> tuple[np.ndarray, np.ndarray]:
    """(the arguments whose copies are exposed with the ops run in `order`, most exposed
    first; the seconds each was charged with when it was ranked): see the module
    docstring."""
    args, rooms, seconds = copy_rooms(problem, order)
    if not len(args):
        return args, np.zeros(0)
    by_room = [np.argsort(rooms[k], kind="stable") for k in range(2)]
    active = np.ones(len(args), dtype=bool)
    # Ties: the smaller argument, then the lower id.
    tie = np.lexsort((-args, -problem.sizes[args]))
    rank_of = np.empty(len(args), dtype=np.int64)
    rank_of[tie] = np.arange(len(args))
    ranked, charged = [], []
    while True:
        charge = sum(_charges(rooms[k], seconds[k], by_room[k], active) for k in range(2))
        if charge.max() <= 0:
            break
        best = np.nonzero(charge == charge.max())[0]
        top = int(best[np.argmax(rank_of[best])])
        ranked.append(int(args[top]))
        charged.append(float(charge[top]))
        active[top] = False
    return np.array(ranked, dtype=np.int64), np.array(charged, dtype=np.float64)
