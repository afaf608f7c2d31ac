"""PartitionProblem: validation, JSON round trip, reported unsupported operators."""

from __future__ import annotations

import pytest
from partition_graphs import GraphMaker, elementwise_spec, matmul_spec

from tvm_ext.partition import PartitionProblem, plan_partition


def small_problem():
    g = GraphMaker()
    x = g.tensor("x", (8, 4), kind="input")
    w = g.tensor("w", (4, 8), kind="parameter")
    (y,) = g.op(matmul_spec(8, 4, 8), [x, w], [(8, 8)], 512)
    (z,) = g.op(elementwise_spec((8, 8)), [y], [(8, 8)], 64)
    return g.problem([z])


def test_json_round_trip_gives_the_same_plan():
    problem = small_problem()
    again = PartitionProblem.from_json(problem.to_json())
    assert again.to_dict() == problem.to_dict()
    a, b = plan_partition(problem, 2), plan_partition(again, 2)
    assert a.to_dict() | {"search_seconds": 0} == b.to_dict() | {"search_seconds": 0}


def test_validation():
    problem = small_problem()
    with pytest.raises(ValueError, match="op specs"):
        PartitionProblem(problem.graph, problem.specs, problem.op_spec[:1])
    with pytest.raises(ValueError, match="unknown spec"):
        PartitionProblem(problem.graph, problem.specs, ["nope", None])
    with pytest.raises(ValueError, match="inputs"):
        PartitionProblem(problem.graph, problem.specs, [problem.op_spec[1]] * 2)


def test_unanalysed_ops_run_replicated_and_are_reported():
    problem = small_problem()
    problem.op_spec[1] = None  # e.g. a packed builtin
    spec = problem.spec(1)
    assert spec.opaque and "not analysed" in spec.notes[0]
    assert any("not analysed" in reason for _, reason in problem.unsupported())
    plan = plan_partition(problem, 2)
    assert plan.ops[1].strategy == [-1]
