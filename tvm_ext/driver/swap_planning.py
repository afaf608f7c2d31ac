"""Planning the swaps of a model: the entry the CLI, the GPU bundle and the benchmarks plan
through (`plan_swap`), over `tvm_ext.ir.swap_planning`, which SwapOffload plans with too."""

from __future__ import annotations

from collections.abc import Sequence

import tvm

from .. import pipeline
from ..cost import Hardware
from ..graph import DataflowGraph
from ..ir.swap_planning import SwapPlanning, plan_module_swaps
from ..models import Model
from ..swap.problem import problem_for_budget


def plan_swap(
    model: Model | tvm.IRModule,
    target: tvm.target.Target,
    device_memory: int | str,
    *,
    hardware: str | Hardware = "h100",
    planner: str = "swapadvisor",
    seed: int = 0,
    time_budget_s: float = 30.0,
    op_times: Sequence[float] | None = None,
    reserved: int | None = None,
    fission: bool = True,
    graph: DataflowGraph | None = None,
) -> SwapPlanning:
    """Plan the swaps of `model` on `target` under `device_memory` (bytes, "512MiB", "25%" of
    the no-swap peak, or "min"): fused as the pipeline fuses it, its graph, the swap problem,
    the fused kernels no split fits run as their parts (`fission`), the search of `planner`.

    `op_times`: measured seconds per op of the fused graph, instead of `hardware`'s roofline
    (nothing is then fissioned). `reserved`: device bytes outside the graph; None: the vendor
    library's workspace on `target` (what a build with the library keeps). `graph`: the fused
    graph (`fused_graph`), where the caller has it; the model is then not fused again unless a
    kernel may be fissioned. A plan built with `build(..., swap_plan=planning.plan)` runs on
    `planning.graph`; `planning.sidecar` goes beside an exported module. Raises
    `InfeasibleBudgetError` with the smallest feasible budget.
    """
    if reserved is None:
        reserved = pipeline.library_reserved_bytes(target)
    fissions = fission and op_times is None
    fused = None if graph is not None and not fissions else \
        pipeline.fuse(model.mod if isinstance(model, Model) else model, target)
    return plan_module_swaps(fused, device_memory, target=str(target.kind.name),
                             hardware=hardware, planner=planner, seed=seed,
                             time_budget_s=time_budget_s, op_times=op_times, reserved=reserved,
                             fission=fission, graph=graph)


def check_swap_budget(graph: DataflowGraph, target: tvm.target.Target,
                      device_memory: int | str, reserved: int | None = None) -> None:
    """Raise `InfeasibleBudgetError` where no plan of `graph`'s kernels, whole, fits
    `device_memory` (`reserved` as for `plan_swap`): the check before kernel times are measured
    for a plan (measured times are of the fused kernels, so no kernel is fissioned)."""
    if reserved is None:
        reserved = pipeline.library_reserved_bytes(target)
    problem_for_budget(graph, device_memory, "cpu", reserved=reserved).check_feasible()
