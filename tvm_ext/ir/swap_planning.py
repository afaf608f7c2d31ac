"""Swap planning of a fused module, the one way a swap plan is made: read the graph SwapOffload
rewrites (`swap_graph`), size the swap problem for the budget, run the fused kernels that no
split in time fits as their parts (`fission_to_fit`), and search (`tvm_ext.swap.plan_phases`).
`plan_module_swaps` does all of it; `tvm_ext.driver.plan_swap` (a model, fused as the pipeline
fuses it), SwapOffload planning on its own and each device of a partitioned build call it.

It lives in `ir/` because the budget search cuts kernels and reads the cut module's graph: the
planners of `tvm_ext.swap` import no TVM, and SwapOffload (`passes/`) plans through it without
importing the driver above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tvm
from tvm import relax

from ..cost import Hardware
from ..graph import DataflowGraph
from ..swap import SwapPlan, plan_phases, plan_swaps
from ..swap.exactness import inexact_splits
from ..swap.placement import argument_devices
from ..swap.problem import SwapProblem, problem_for_budget
from .graph_builder import build_graph
from .kernel_fission import fission_kernels
from .local_kernels import LoweringError
from .time_splits import annotate_time_splits


@dataclasses.dataclass
class SwapPlanning:
    """A swap plan with what it was made from and for: the graph it indexes (of the kernels'
    parts where it runs kernels as their parts), the problem it solves, and the plan of each
    phase of the search (`plan_phases`; the last is `plan`)."""

    graph: DataflowGraph
    problem: SwapProblem
    plan: SwapPlan
    phases: list[SwapPlan]
    target: str  # the kind of target the module was fused for ("llvm", "cuda")

    @property
    def fissioned(self) -> list[str]:
        """The fused kernels the plan runs as their parts."""
        return list(self.plan.fissioned)

    @property
    def argument_devices(self) -> list[int]:
        """Per function argument, where the plan takes it: `DEVICE` or `HOST`."""
        return argument_devices(self.graph, self.plan)

    @property
    def inexact_splits(self) -> list[str]:
        """The ops the plan runs in chunks that may round differently (`swap.exactness`)."""
        return inexact_splits(self.graph, self.plan)

    @property
    def sidecar(self) -> dict:
        """What a deployment of the swapped module needs beside it (`PATH.swap.json`): the
        plan, and which device (0) or host (1) each argument goes to."""
        return {"plan": self.plan.to_dict(), "argument_devices": self.argument_devices,
                "devices": ["device", "host"], "target": self.target}

    def ideal_time(self) -> float:
        """The iteration's simulated time with unbounded device memory."""
        return plan_swaps(self.problem, "ideal").predicted_time


def plan_module_swaps(
    mod: tvm.IRModule | None,
    device_memory: int | str,
    *,
    target: str,
    hardware: str | Hardware = "h100",
    planner: str = "swapadvisor",
    seed: int = 0,
    time_budget_s: float = 30.0,
    op_times: Sequence[float] | None = None,
    reserved: int = 0,
    fission: bool = True,
    function: str = "main",
    graph: DataflowGraph | None = None,
) -> SwapPlanning:
    """Plan the swaps of `function` of a fused module under `device_memory` (bytes, "512MiB",
    "25%" of the no-swap peak, or "min"; see `problem_for_budget`, `reserved` included).

    `fission`: where no split in time of a fused kernel fits, run it as its parts
    (`fission_to_fit`); measured `op_times` (per op of the fused graph) fission nothing.
    `graph`: the module's graph with its split options (`swap_graph`), where the caller has
    it; `mod` may then be None when nothing is fissioned. Raises `InfeasibleBudgetError` with
    the smallest feasible budget.
    """
    if fission:
        _, graph, problem, fissioned = fission_to_fit(mod, device_memory, hardware, op_times,
                                                      reserved, function, graph)
    else:
        graph = graph if graph is not None else swap_graph(mod, function)
        problem = problem_for_budget(graph, device_memory, hardware, op_times, reserved)
        fissioned = []
    phases = plan_phases(problem, planner, time_budget_s=time_budget_s, seed=seed)
    phases[-1].fissioned = fissioned
    return SwapPlanning(graph, problem, phases[-1], phases, target)


def fission_to_fit(mod: tvm.IRModule, device_memory, hardware="h100",
                   op_times=None, reserved: int = 0, function: str = "main",
                   graph: DataflowGraph | None = None
                   ) -> tuple[tvm.IRModule, DataflowGraph, SwapProblem, list[str]]:
    """(module, its graph with split options, swap problem, kernels run as their parts) for a
    fused module under `device_memory` (as `problem_for_budget` reads it; a percentage of the
    unfissioned graph's peak): while the op that sets the smallest feasible budget (at its
    finest split) does not fit, its kernel runs as its parts where that lowers the smallest
    budget ("min": the smallest budget is the fissioned graph's). Measured `op_times` are per
    op of the unfissioned graph: with them nothing is fissioned. `graph`: the module's, where
    the caller has it (with its split options)."""
    graph = graph if graph is not None else swap_graph(mod, function)
    problem = problem_for_budget(graph, device_memory, hardware, op_times, reserved)
    text = device_memory.strip().lower() if isinstance(device_memory, str) else ""
    if op_times is not None:
        return mod, graph, problem, []
    names: list[str] = []
    fissioned = mod
    while True:
        minimum, op = problem.min_budget()
        if op < 0 or (text != "min" and problem.budget >= minimum):
            break
        kernel = graph.ops[op].kernel
        if graph.ops[op].kind != "kernel" or kernel in names:
            break
        try:
            trial = fission_kernels(mod, [*names, kernel], function)
        except LoweringError:  # it does not cut, or it is not called by call_tir alone
            break
        trial_graph = swap_graph(trial, function)
        trial_problem = SwapProblem.from_graph(trial_graph, 1, hardware)
        if trial_problem.min_budget()[0] >= minimum:
            break
        names.append(kernel)
        fissioned, graph = trial, trial_graph
        problem = trial_problem.with_budget(trial_problem.min_budget()[0] if text == "min"
                                            else problem.budget)
    return fissioned, graph, problem, names


def swap_graph(mod: tvm.IRModule, function: str = "main") -> DataflowGraph:
    """The graph SwapOffload reads of a fused module (dataflow reshapes, and parts of a
    fissioned kernel that only reshape, as views), with its split options."""
    mod = relax.transform.RewriteDataflowReshape()(mod)
    return annotate_time_splits(mod, build_graph(mod, function))
