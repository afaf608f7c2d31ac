"""Repeated structure of a graph: the ops that play one role in each repeat of a block (the
same kernel at the same place in each transformer layer), so that the search can carry a
decision made for one layer over to the others (as torchtitan's planner reuses one layer's
plan for its repeats).

An op's role is found by colour refinement (Weisfeiler-Lehman) over the dependency graph:
every op starts with its kernel and phase (`SwapProblem.op_kernels`: ops of one kernel do the
same work at the same shapes), and each round an op's colour takes in the colours of the
producers of its inputs (by argument) and of its consumers. After `ROUNDS` rounds two ops
share a colour when their neighbourhoods of that radius look alike: the same op of each
layer, away from the first and last few layers (whose neighbourhoods reach the model's ends).
A role is a hint for the search's moves, never a fact it relies on: each op it moves stays
between its producers and its consumers, and the plan is derived and simulated as any other.
"""

from __future__ import annotations

import numpy as np

from .problem import SwapProblem

ROUNDS = 3  # neighbourhood radius: enough to tell apart the ops of one kernel within a layer


def repeat_groups(problem: SwapProblem, rounds: int = ROUNDS) -> list[np.ndarray]:
    """Per op, the ops that share its role (itself included), in increasing op id; every op
    its own group when the problem does not name its kernels."""
    n = problem.num_ops
    if problem.op_kernels is None:
        return [np.array([op], dtype=np.int64) for op in range(n)]
    colour = _dense([(k, phase) for k, phase in zip(problem.op_kernels, problem.op_phases,
                                                     strict=True)])
    consumers: list[list[int]] = [[] for _ in range(n)]
    for op in range(n):
        for t in problem.op_inputs[op]:
            if problem.producers[t] >= 0:
                consumers[problem.producers[t]].append(op)
    for _ in range(rounds):
        colour = _dense([
            (int(colour[op]),
             tuple(int(colour[problem.producers[t]]) if problem.producers[t] >= 0 else -1
                   for t in problem.op_inputs[op]),
             tuple(sorted(int(colour[c]) for c in consumers[op])))
            for op in range(n)])
    members: dict[int, list[int]] = {}
    for op in range(n):
        members.setdefault(int(colour[op]), []).append(op)
    groups = {c: np.asarray(ops, dtype=np.int64) for c, ops in members.items()}
    return [groups[int(colour[op])] for op in range(n)]


def _dense(keys: list) -> np.ndarray:
    """Each key's index among the distinct keys in order of first appearance."""
    index: dict = {}
    return np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)
