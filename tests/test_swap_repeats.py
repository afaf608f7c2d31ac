"""The repeats of a block (`swap/repeats.py`) and the search's moves that use them: tied
mutations keep every plan valid, and an evaluation cap ends a phase."""

from __future__ import annotations

import numpy as np

from tvm_ext.swap import SearchConfig, SwapProblem, validate
from tvm_ext.swap.repeats import repeat_groups
from tvm_ext.swap.search import GeneticSearch, swapadvisor_phases

LAYERS = 8


def _layers(num_layers: int = LAYERS, kernels: bool = True) -> SwapProblem:
    """x -> [c = cast(w_i); h = mm(x, c); x = act(h, x)] * num_layers -> head(x): the same
    three kernels in each layer, a weight per layer on the host (its cast free to move)."""
    sizes, kinds, producers = [4096], ["input"], [-1]
    op_inputs, op_outputs, op_deps, names, kernel_names = [], [], [], [], []
    x = 0

    def tensor(size: int, kind: str, producer: int) -> int:
        sizes.append(size)
        kinds.append(kind)
        producers.append(producer)
        return len(sizes) - 1

    def op(kernel: str, ins: list[int]) -> int:
        k = len(op_inputs)
        out = tensor(4096, "activation", k)
        op_inputs.append(ins)
        op_outputs.append([out])
        op_deps.append(sorted({producers[t] for t in ins if producers[t] >= 0}))
        names.append(f"{kernel}{k}")
        kernel_names.append(kernel)
        return out

    for _ in range(num_layers):
        w = tensor(8192, "parameter", -1)
        h = op("mm", [x, op("cast", [w])])
        x = op("act", [h, x])
    op("head", [x])
    n, n_t = len(op_inputs), len(sizes)
    problem = SwapProblem(
        op_names=names, durations=np.ones(n), op_deps=op_deps, op_inputs=op_inputs,
        op_outputs=op_outputs, op_scratch=[[] for _ in range(n)], op_phases=["forward"] * n,
        tensor_names=[f"t{i}" for i in range(n_t)], sizes=sizes, tensor_kinds=kinds,
        producers=producers, host_start=np.array([k != "activation" for k in kinds]),
        pinned=np.zeros(n_t, dtype=bool), outputs=[n_t - 1], budget=1 << 40,
        h2d_bandwidth=4096.0, h2d_latency=0.01, d2h_bandwidth=4096.0, d2h_latency=0.01,
        name="layers", op_kernels=kernel_names if kernels else None)
    low, high = problem.min_budget()[0], problem.no_swap_peak()
    return problem.with_budget((low + high) // 2)


def test_the_same_op_of_each_middle_layer_shares_a_role():
    groups = repeat_groups(_layers())
    mm = [3 * layer + 1 for layer in range(LAYERS)]
    middle = mm[3:-3]  # three rounds of refinement reach three ops from either end
    assert all(set(middle) <= set(groups[op].tolist()) for op in middle)
    assert all(set(groups[op].tolist()) <= set(mm) for op in mm)  # never another kernel
    assert groups[mm[0]].tolist() == [mm[0]]  # the first layer reads the model's input
    head = 3 * LAYERS
    assert groups[head].tolist() == [head]


def test_without_kernel_names_every_op_is_its_own_role():
    groups = repeat_groups(_layers(kernels=False))
    assert [g.tolist() for g in groups] == [[op] for op in range(len(groups))]


def test_tied_mutations_keep_every_plan_valid():
    problem = _layers()
    search = GeneticSearch(problem, SearchConfig(tie_repeats=1.0), seed=3)
    order = np.asarray(problem.order, dtype=np.int64)
    casts_moved = []
    for _ in range(40):
        new = search._mutate_order(order, tied=True)
        assert problem.is_topological(new.tolist())
        before, after = (np.argsort(o)[0::3] for o in (order, new))  # each cast's position
        casts_moved.append(int((before != after).sum()))
        order = new
    assert max(casts_moved) > 1  # a cast moved with its repeats
    plan = swapadvisor_phases(problem, 2.0, 0, SearchConfig(tie_repeats=0.5))[-1]
    validate(problem, plan)


def test_an_evaluation_cap_ends_each_phase():
    problem = _layers()
    capped = swapadvisor_phases(problem, 60.0, 0, SearchConfig(max_evaluations=30),
                                recompute=False)[-1]
    assert capped.info["evaluations"] <= 30 + SearchConfig().population
    validate(problem, capped)
