"""The cost model's legal choices: divisibility per mesh level, the data path, contiguity."""

from __future__ import annotations

from partition_graphs import GraphMaker, elementwise_spec, matmul_spec

from tvm_ext.partition import REP, AxisCut, DimSpec, KernelSpec, make_model
from tvm_ext.partition.search import Searcher, State, tie_groups


def test_schemes_divide_by_the_prefix_of_the_mesh():
    g = GraphMaker()
    x = g.tensor("x", (6, 4), kind="input")
    (y,) = g.op(elementwise_spec((6, 4)), [x], [(6, 4)], 24)
    model = make_model(g.problem([y]), 6)  # mesh [3, 2]
    assert model.mesh == [3, 2]
    assert model.tensor_schemes[x] == [[REP, 0], [REP, 0]]  # 4 % 3 != 0, 6 % 6 == 0
    assert model.op_dims[0] == [[REP, 0], [REP, 0]]


def test_data_path_ops_must_split():
    g = GraphMaker()
    x = g.tensor("x", (8, 4), kind="input")
    w = g.tensor("w", (4, 8), kind="parameter")
    (wt,) = g.op(elementwise_spec((4, 8)), [w], [(4, 8)], 32, name="weight_prep")
    (y,) = g.op(matmul_spec(8, 4, 8), [x, wt], [(8, 8)], 512)
    model = make_model(g.problem([y]), 2)
    assert model.batch_axes[x] == 0 and model.batch_axes[y] == 0 and wt not in model.batch_axes
    assert model.data_path == [False, True]
    searcher = Searcher(model, tie_groups(model))
    assert (REP,) in searcher.strategies(0, [0], State(model))
    assert (REP,) not in searcher.strategies(1, [0], State(model))


def test_halo_dims_are_cut_contiguously():
    # A window dim split at level 2 must be split at level 1 too (mesh-digit index sets are
    # contiguous only then).
    spec = KernelSpec("conv1d", 1, 1, [
        DimSpec("n", 8, [AxisCut(0)], [0]),
        DimSpec("h", 16, [AxisCut(1, 1, 1)], [1], global_index=True),
    ])
    g = GraphMaker()
    x = g.tensor("x", (8, 16), kind="input")
    (y,) = g.op(spec, [x], [(8, 16)], 128)
    model = make_model(g.problem([y]), 4)
    assert model.contiguous_ok(0, [1, 1]) and model.contiguous_ok(0, [0, 0])
    assert not model.contiguous_ok(0, [0, 1])
    assert model.compute_time(0, [0, 1]) <= model.compute_time(0, [REP, REP])
