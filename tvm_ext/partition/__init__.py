"""Tofu-style operator partitioning over k devices.

Plain data in, a plan out; nothing here reads IR. `tvm_ext.driver.partition_problem(model)`
(through `tvm_ext.ir.kernel_dims`) gives a `PartitionProblem`; `plan_partition(problem,
num_devices, link=..., strategy=...)` gives a `PartitionPlan`:

    from tvm_ext.driver import partition_problem
    from tvm_ext.models import get_model
    from tvm_ext.partition import plan_partition

    problem = partition_problem(get_model("gpt", "small", training=True))
    plan = plan_partition(problem, 4, link="nvlink")
    print(plan.summary())

Strategies: "tofu" (coarsening + dynamic programming per mesh level, the default),
"data_parallel", "megatron", "exact" (joint optimum, small graphs only), and for an optimizer
step "zero1", "zero2", "zero3" (ZeRO's stages over data parallelism: optimizer state,
gradients, parameters sharded).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from ..cost.hardware import Hardware, Link
from ..errors import InputError
from .baselines import data_parallel_layouts, megatron_layouts, zero_bytes, zero_layouts
from .elimination import TableTooLarge
from .layout import REP, factorize
from .model import MEMORY_TIE_BREAK, PartitionModel
from .plan import (
    InnerStep,
    InputConversion,
    OpPlacement,
    OutputConversion,
    PartitionPlan,
    TensorPlacement,
    build_plan,
)
from .problem import PartitionProblem
from .search import Searcher, State, search, solve_exact, tie_groups
from .spec import AxisCut, DimSpec, InnerReduce, KernelSpec

STRATEGIES = ("tofu", "data_parallel", "megatron", "exact", "zero1", "zero2", "zero3")

__all__ = [
    "REP",
    "STRATEGIES",
    "AxisCut",
    "DimSpec",
    "InnerReduce",
    "InnerStep",
    "InputConversion",
    "KernelSpec",
    "NotApplicable",
    "OpPlacement",
    "OutputConversion",
    "PartitionModel",
    "PartitionPlan",
    "PartitionProblem",
    "TableTooLarge",
    "TensorPlacement",
    "make_model",
    "plan_partition",
    "zero_bytes",
]


class NotApplicable(InputError):
    """The strategy cannot partition this graph over this many devices."""


def make_model(
    problem: PartitionProblem,
    num_devices: int,
    link: str | Link = "nvlink",
    hardware: str | Hardware = "h100",
    topology: Sequence[tuple[int, str | Link]] | None = None,
    memory_weight: float = MEMORY_TIE_BREAK,
) -> PartitionModel:
    """The cost model of a problem on `num_devices` devices.

    Args:
        topology: levels `(devices, link)` outermost first, e.g. `[(2, "pcie"), (4, "nvlink")]`
            for two nodes of four GPUs; each level is factored further into primes. Default:
            every level on `link`.
        memory_weight: seconds the objective charges per byte a device stores (default: a
            tie-break only; about 1 / link bandwidth makes memory as dear as traffic).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1, got {num_devices}")
    if topology is None:
        topology = [(num_devices, link)]
    mesh, links = [], []
    for parts, level_link in topology:
        for p in factorize(int(parts)):
            mesh.append(p)
            links.append(level_link)
    total = 1
    for p in mesh:
        total *= p
    if total != num_devices:
        raise ValueError(f"the topology {topology} has {total} devices, not {num_devices}")
    return PartitionModel(problem, mesh, links, hardware, memory_weight=memory_weight)


def plan_partition(
    problem: PartitionProblem,
    num_devices: int,
    *,
    link: str | Link = "nvlink",
    strategy: str = "tofu",
    hardware: str | Hardware = "h100",
    topology: Sequence[tuple[int, str | Link]] | None = None,
    coarsen: bool = True,
    memory_weight: float = MEMORY_TIE_BREAK,
    disallow: Mapping[str, Mapping[int, str]] | None = None,
) -> PartitionPlan:
    """Partition `problem` over `num_devices` devices with one of `STRATEGIES`.

    `disallow[spec key][dim] = reason` restricts the choices to what a lowering can express
    (`tvm_ext.passes.PartitionOperators` passes the dims it cannot lower): those dims are never
    split, so the plan's traffic and memory are those of the code that runs; the plan's
    `unsupported` lists them with their reasons.

    Raises `NotApplicable` when a baseline does not fit (the batch does not divide by k for
    data parallelism; no block whose weights split k ways for Megatron) and `TableTooLarge`
    when "exact" is out of reach.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    if not isinstance(problem, PartitionProblem):
        raise TypeError("plan_partition takes a PartitionProblem: build one with "
                        "tvm_ext.driver.partition_problem(model)")
    if disallow:
        problem = problem.restricted(disallow)
    if num_devices == 1:
        model = PartitionModel(problem, [], [], hardware)
        state = State(model)
        return build_plan(model, state, strategy)
    model = make_model(problem, num_devices, link, hardware, topology, memory_weight)
    start = time.perf_counter()
    if strategy == "tofu":
        seeds = []
        fixed = data_parallel_layouts(model)
        if fixed is not None:  # refine the textbook plan too (it can win on mixed links)
            seeds.append(Searcher(model, tie_groups(model), fixed[0], fixed_ops=fixed[1])
                         .solve(State(model), list(range(model.levels))))
        state = search(model, coarsen=coarsen, seeds=seeds)
    elif strategy == "exact":
        state = solve_exact(model)
    elif strategy.startswith("zero"):
        fixed = zero_layouts(model, int(strategy[-1]))
        if fixed is None:
            raise NotApplicable(f"ZeRO needs an optimizer step whose batch divides by "
                                f"{num_devices}")
        searcher = Searcher(model, tie_groups(model), fixed[0], fixed_ops=fixed[1])
        state = searcher.solve(State(model), list(range(model.levels)))
    elif strategy == "data_parallel":
        fixed = data_parallel_layouts(model)
        if fixed is None:
            raise NotApplicable(f"data parallelism needs the batch to divide by {num_devices}")
        searcher = Searcher(model, tie_groups(model), fixed[0], fixed_ops=fixed[1])
        state = searcher.solve(State(model), list(range(model.levels)))
    else:
        fixed = megatron_layouts(model)
        if not fixed:
            raise NotApplicable(f"no MLP or attention block whose weights split {num_devices} "
                                f"ways")
        state = search(model, fixed=fixed, coarsen=coarsen)
    return build_plan(model, state, strategy, time.perf_counter() - start)
