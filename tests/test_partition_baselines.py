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


@pytest.fixture(scope="module")
def adamw_mlp():
    """An AdamW step of a small-weight, large-batch MLP: the data parallel regime."""
    from tvm_ext.models.optimizer import Optimizer, make_optimizer_step

    step = make_optimizer_step(get_model("mlp", "small", training=True, batch=1536),
                               Optimizer("adamw"))
    return partition_problem(step)


def _trained_bytes(problem):
    g = problem.graph
    return sum(g.tensors[g.base(t.id)].nbytes for t in g.tensors
               if t.overwrites is not None and g.tensors[g.base(t.id)].kind == "parameter")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_layouts_shard_what_each_stage_shards(adamw_mlp, stage):
    from tvm_ext.partition.baselines import zero_layouts

    model = make_model(adamw_mlp, 4)
    fixed, ops = zero_layouts(model, stage)
    g = adamw_mlp.graph
    for t in g.tensors:
        if t.arg_index is None or not t.shape or t.shape[0] % 4:
            continue
        sharded = fixed[t.id] == [0] * model.levels
        if t.kind == "state":
            assert sharded
        elif t.kind == "parameter":
            assert sharded == (stage == 3)
    assert all(g.ops[o].phase != "update" for o in ops)  # the updates' splits are searched


def test_zero_plans_send_their_closed_form_and_the_search_meets_the_best(adamw_mlp):
    """Planned in the cost model, data parallelism and ZeRO 1 and 2 send exactly their closed
    form (and the loss, a few bytes: an MLP has no other traffic); the search sends no more
    than the best of them, with the optimizer state sharded and less memory than data
    parallelism: ZeRO-2's placement, found on its own."""
    from tvm_ext.partition import plan_partition, zero_bytes

    k, trained = 4, _trained_bytes(adamw_mlp)
    plans = {s: plan_partition(adamw_mlp, k, strategy=s)
             for s in ("tofu", "data_parallel", "zero1", "zero2", "zero3")}
    for stage, name in enumerate(("data_parallel", "zero1", "zero2")):
        assert plans[name].bytes_per_device == pytest.approx(zero_bytes(trained, k, stage),
                                                             abs=64)
    assert plans["zero3"].bytes_per_device <= zero_bytes(trained, k, 3) * (1 + 1e-9)
    best = min(p.bytes_per_device for name, p in plans.items() if name != "tofu")
    ours = plans["tofu"]
    assert ours.bytes_per_device <= best * (1 + 1e-9)
    assert ours.peak_bytes_per_device < plans["data_parallel"].peak_bytes_per_device
    state = [t for t in ours.tensors if adamw_mlp.graph.tensors[t.id].kind == "state"
             and len(t.shape) == 2]
    assert state and all(t.layout != [REP, REP] for t in state)
