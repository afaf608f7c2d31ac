"""Known answers for the partition search (no GPU, mostly no IR).

* the search equals the exact optimum (joint solve) on random small graphs, for k = 2 .. 8;
* the exact solve equals brute-force enumeration on tiny graphs;
* an MLP with large weights and a small batch gets the Megatron plan (one allreduce per block),
  a small-weight large-batch MLP gets data parallelism.
"""

from __future__ import annotations

import itertools

import pytest
from partition_graphs import GraphMaker, elementwise_spec, matmul_spec, random_problem

from tvm_ext.driver import partition_problem
from tvm_ext.models import get_model
from tvm_ext.partition import REP, TableTooLarge, make_model, plan_partition
from tvm_ext.partition.plan import build_plan
from tvm_ext.partition.search import objective, search, solve_exact


@pytest.mark.parametrize("k", [2, 3, 4, 6, 8])
def test_search_equals_exact_on_random_graphs(k):
    for seed in range(40):
        model = make_model(random_problem(seed, num_ops=6), k)
        ours = objective(model, search(model))
        best = objective(model, solve_exact(model))
        assert ours == pytest.approx(best, rel=1e-9, abs=1e-18), f"seed {seed}"


def brute_force(model) -> float:
    """The least objective over every assignment, enumerated (independent of the solver)."""
    g = model.graph
    levels = range(model.levels)
    tensor_options = []
    for t in g.tensors:
        if model.free[t.id]:
            tensor_options.append([tuple([REP] * model.levels)])
        else:
            tensor_options.append(list(itertools.product(
                *(model.tensor_schemes[t.id][lvl] for lvl in levels))))
    best = float("inf")
    for layouts in itertools.product(*tensor_options):
        total = sum(model.memory_weight * model.stored_bytes(t, layouts[t])
                    for t in range(len(g.tensors)) if not model.free[t])
        for op in g.ops:  # each op takes its cheapest legal strategy
            must = model.data_path[op.id]
            per_level = [[d for d in model.op_dims[op.id][lvl] if not must or d != REP]
                         or model.op_dims[op.id][lvl] for lvl in levels]
            total += min(
                model.op_cost(op.id, strategy) + sum(
                    model.edge_time(e, op.id, layouts[e.tensor], strategy)
                    for e in model.edges[op.id])
                for strategy in itertools.product(*per_level)
                if model.contiguous_ok(op.id, strategy))
        best = min(best, total)
    return best


@pytest.mark.parametrize(("k", "num_ops", "seeds"), [(2, 3, 10), (3, 3, 10), (4, 2, 4)])
def test_exact_equals_brute_force(k, num_ops, seeds):
    for seed in range(seeds):
        model = make_model(random_problem(seed, num_ops=num_ops), k)
        assert objective(model, solve_exact(model)) == pytest.approx(
            brute_force(model), rel=1e-9, abs=1e-18), f"seed {seed}"


def mlp_problem(batch: int, width: int, layers: int):
    return partition_problem(get_model("mlp", "tiny", training=True, batch=batch, features=width,
                             hidden=width, classes=width, layers=layers))


def weight_layouts(plan) -> list[list[int]]:
    return [t.layout for t in plan.tensors if t.kind == "parameter" and len(t.shape) == 2]


def test_large_weights_small_batch_get_megatron():
    # 2 blocks of (column-parallel, row-parallel) linear layers, weights [out, in].
    problem = mlp_problem(batch=8, width=1024, layers=4)
    plan = plan_partition(problem, 2)
    assert weight_layouts(plan) == [[0], [1], [0], [1]]
    # One reduction per block in the forward pass: the row-parallel layer's allreduce of the
    # [batch, width] activation, inside its fused matmul + bias kernel.
    forward = [s for o in plan.ops if o.phase == "forward" for s in o.inner
               if s.group_bytes == 8 * 1024 * 4]
    assert len(forward) == 2
    megatron = plan_partition(problem, 2, strategy="megatron")
    assert plan.bytes_per_device == pytest.approx(megatron.bytes_per_device)
    # On 4 devices every weight stays split and nothing sends more than Megatron.
    plan4 = plan_partition(problem, 4)
    assert all(REP not in layout for layout in weight_layouts(plan4))
    assert plan4.bytes_per_device <= plan_partition(problem, 4,
                                                    strategy="megatron").bytes_per_device


@pytest.mark.parametrize("k", [2, 4])
def test_small_weights_large_batch_get_data_parallel(k):
    problem = mlp_problem(batch=4096, width=32, layers=4)
    plan = plan_partition(problem, k)
    dp = plan_partition(problem, k, strategy="data_parallel")
    assert plan.bytes_per_device == pytest.approx(dp.bytes_per_device)
    # Every activation is split along the batch; weights are replicated, or sharded where
    # that costs the same (a reduce-scatter and an allgather instead of an allreduce).
    batch = [t for t in plan.tensors if t.kind in ("activation", "input", "gradient")
             and t.shape and t.shape[0] == 4096]
    assert batch and all(t.layout == [0] * len(plan.mesh) for t in batch)
    assert {c for c in plan.collectives} <= {"allreduce", "reduce_scatter", "allgather"}


def test_search_respects_fixed_layouts():
    g = GraphMaker()
    x = g.tensor("x", (8, 4), kind="input")
    w = g.tensor("w", (4, 8), kind="parameter")
    (y,) = g.op(matmul_spec(8, 4, 8), [x, w], [(8, 8)], 512)
    (z,) = g.op(elementwise_spec((8, 8)), [y], [(8, 8)], 64)
    model = make_model(g.problem([z]), 2)
    state = search(model, fixed={w: [1]})
    assert state.layout[w] == [1]
    free = search(model)
    assert objective(model, free) <= objective(model, state)


def shared_weights_problem(weights: int = 5, layers: int = 4):
    """`layers` repeats of a chain of matmuls by the same `weights` square weights (weights
    shared across layers, as ALBERT's): each weight's layout is one variable that every
    layer's factors mention, so the elimination's tables grow as (layouts)^weights."""
    g = GraphMaker()
    h = g.tensor("x", (8, 8), kind="input")
    ws = [g.tensor(f"w{j}", (8, 8), kind="parameter") for j in range(weights)]
    for _ in range(layers):
        for w in ws:
            (h,) = g.op(matmul_spec(8, 8, 8), [h, w], [(8, 8)], 1024)
    return g.problem([h])


def test_search_holds_shared_tensors_when_tables_are_too_large():
    model = make_model(shared_weights_problem(), 2)
    exact = solve_exact(model)
    assert exact.held == [] and search(model).held == []
    with pytest.raises(TableTooLarge):
        solve_exact(model, max_table=200)
    state = search(model, max_table=200)
    assert state.held and all(model.graph.tensors[t].kind == "parameter" for t in state.held)
    assert all(None not in layout for layout in state.layout)
    assert all(None not in strategy for strategy in state.strategy)
    assert objective(model, state) >= objective(model, exact) * (1 - 1e-9)
    # The plan names them.
    plan = build_plan(model, state, "tofu")
    assert plan.held == [model.graph.tensors[t].name for t in state.held]
    assert plan.summary()["held"] == len(state.held)
