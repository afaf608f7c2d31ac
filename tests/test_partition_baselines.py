"""Baselines found from the graph: data parallel and Megatron layouts."""

from __future__ import annotations

import pytest

from tvm_ext.driver import partition_problem
from tvm_ext.models import get_model
from tvm_ext.partition import REP, make_model
from tvm_ext.partition.baselines import data_parallel_layouts, megatron_layouts


@pytest.fixture(scope="module")
def gpt():
    return partition_problem(get_model("gpt", "tiny", training=True, batch=4))


def layouts_by_name(problem, fixed):
    return {problem.graph.tensors[t].name: list(layout) for t, layout in fixed.items()}


def test_megatron_weights_column_then_row(gpt):
    model = make_model(gpt, 2)
    named = layouts_by_name(gpt, megatron_layouts(model))
    for block in (0, 1):
        for column in ("q", "k", "v", "fc1"):
            assert named[f"blocks.{block}.{column}.weight"] == [0]  # output features
            assert named[f"blocks.{block}.{column}.bias"] == [0]
        for row in ("proj", "fc2"):
            assert named[f"blocks.{block}.{row}.weight"] == [1]  # input features
            assert named[f"blocks.{block}.{row}.bias"] == [REP]
        # Gradients share their parameter's layout.
        assert named[f"blocks_{block}_fc2_weight_adjoint_out"] == [1]
    # Not in a block: the LM head, embeddings and norms are left to the search.
    assert not any(n.startswith(("head", "wte", "wpe", "ln")) or ".ln" in n for n in named)


def test_data_parallel_cuts_the_batch(gpt):
    model = make_model(gpt, 4)
    tensors, ops = data_parallel_layouts(model)
    g = gpt.graph
    ids = next(t for t in g.tensors if t.kind == "input" and t.name == "ids")
    assert tensors[ids.id] == [0, 0]
    params = [t for t in g.tensors if t.kind == "parameter"]
    assert all(tensors[t.id] == [REP, REP] for t in params)
    # Ops on the data path split their batch dim; weight-side ops (transposes) replicate.
    for op in g.ops:
        assert (ops[op.id][0] != REP) == model.data_path[op.id] or \
            not model.specs[op.id].dims, op.name
    assert data_parallel_layouts(make_model(gpt, 3)) is None  # batch 4
