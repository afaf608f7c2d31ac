"""Which arguments the swap search may keep on the device first: those whose copies the compute
around them cannot hide (`tvm_ext.swap.exposure`), as a tied embedding's."""

from __future__ import annotations

import numpy as np
from swap_dags import step_problem

from tvm_ext.swap import SwapProblem, validate
from tvm_ext.swap.derive import Evaluator, Knobs
from tvm_ext.swap.exposure import copy_rooms, exposed_arguments
from tvm_ext.swap.orders import reference_order


def tied_embedding_step(budget: int = 1 << 20) -> SwapProblem:
    """An AdamW-like step of a one-layer model whose embedding E is also its head: `take`
    reads E first, `head` reads it again, its gradient is complete only after the layer's
    backward, and its update (with its moment ME) runs last. The layer's weight W is read
    after `take` and updated (with MW) right after its gradient, with two ops to follow.
    Every op takes 1 s; every tensor is 256 B and crosses the link in 1 s."""
    names = ["X", "E", "W", "ME", "MW", "H", "A", "L", "G", "gE1", "gW", "GH", "gE2", "gE"]
    ops = [("take", ["X", "E"], ["H"], []), ("layer", ["H", "W"], ["A"], []),
           ("head", ["A", "E"], ["L"], []), ("head_bwd", ["L", "A", "E"], ["G", "gE1"], []),
           ("layer_bwd", ["G", "H", "W"], ["gW", "GH"], []),
           ("uW", ["W", "MW", "gW"], [], ["W", "MW"]),
           ("take_bwd", ["GH", "X"], ["gE2"], []), ("sum", ["gE1", "gE2"], ["gE"], []),
           ("uE", ["E", "ME", "gE"], [], ["E", "ME"])]
    return step_problem(
        names, ops, {"X", "E", "W", "ME", "MW"}, ["L", "E", "W", "ME", "MW"],
        kinds=["input", "parameter", "parameter", "state", "state", "activation",
               "activation", "activation", "gradient", "gradient", "gradient", "gradient",
               "gradient", "gradient"],
        phases=["forward"] * 3 + ["backward"] * 6, budget=budget)


def test_copy_rooms_are_the_compute_before_the_first_read_and_after_the_last_write():
    problem = tied_embedding_step()
    order = reference_order(problem)
    assert order == list(range(problem.num_ops))  # uW already follows its gradient
    args, rooms, seconds = copy_rooms(problem, order)
    room = {problem.tensor_names[t]: (rooms[0, k], rooms[1, k]) for k, t in enumerate(args)}
    assert room == {"X": (0.0, np.inf), "E": (0.0, 0.0), "W": (1.0, 3.0), "ME": (8.0, 0.0),
                    "MW": (5.0, 3.0)}  # X is read only: nothing to write back
    np.testing.assert_allclose(seconds, 1.0)


def test_the_tied_embedding_is_ranked_first_and_the_layer_never():
    """E's fetch overlaps nothing (1 s, shared with X's: 2 s by its room's end) and its
    write-back shares the last second with ME's (2 s): charged 4 s. Without it, X's fetch and
    ME's write-back are 1 s each; W's fetch, behind E's alone, then overlaps `take`."""
    problem = tied_embedding_step()
    names = problem.tensor_names
    ranked, charged = exposed_arguments(problem, reference_order(problem))
    assert [names[t] for t in ranked] == ["E", "X", "ME"]
    np.testing.assert_allclose(charged, [4.0, 1.0, 1.0])


def test_an_exposed_share_keeps_the_embedding_and_saves_its_copies():
    problem = tied_embedding_step(budget=6 * 256)
    names = problem.tensor_names
    evaluator = Evaluator(problem)
    order = np.asarray(reference_order(problem))
    fixed, arena = evaluator.fixed(0.0, 0.2)  # room for one 256 B argument: E
    assert [names[t] for t in np.nonzero(fixed)[0]] == ["E"]
    assert arena == 5 * 256
    kept = evaluator.plan(order, Knobs(keep=0.0, keep_exposed=0.2), "swapadvisor")
    fetched = evaluator.plan(order, Knobs(keep=0.0), "swapadvisor")
    validate(problem, kept)
    validate(problem, fetched)
    assert names.index("E") in kept.pinned and names.index("E") not in kept.host_start
    assert kept.predicted_time < fetched.predicted_time
    # Small arguments come after the exposed ones, from their own share, where the ops
    # still fit the arena (layer_bwd needs five tensors); the small ones are dropped first.
    fixed, _ = Evaluator(problem.with_budget(7 * 256)).fixed(1 / 7, 1 / 7)
    assert sorted(names[t] for t in np.nonzero(fixed)[0]) == ["E", "X"]
    fixed, _ = evaluator.fixed(0.2, 0.2)
    assert [names[t] for t in np.nonzero(fixed)[0]] == ["E"]


def test_at_the_smallest_budget_nothing_is_kept():
    problem = tied_embedding_step()
    tight = problem.with_budget(problem.min_budget()[0])
    fixed, arena = Evaluator(tight).fixed(0.5, 1.0)
    assert not fixed.any() and arena == tight.budget
