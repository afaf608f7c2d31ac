"""SwapAdvisor-style swap planning: given a DataflowGraph and a device memory budget, find the
op schedule, memory placement and swaps that run one iteration fastest.

Plain data in (`SwapProblem`, built from a `DataflowGraph`), a `SwapPlan` out; nothing here
reads IR. `plan_swaps(problem, planner)` is the entry point; `simulate(problem, plan)` scores
any plan on three streams (compute, device-to-host, host-to-device), and
`validate(problem, plan)` checks its invariants.
"""

from __future__ import annotations

from .alignment import ALIGNMENT
from .baselines import checkpoint, ideal, lru, vdnn
from .plan import PlanError, Residency, SwapIn, SwapOut, SwapPlan
from .problem import InfeasibleBudgetError, SwapProblem
from .search import SearchConfig, swapadvisor_phases
from .simulator import SimResult, simulate, validate

PLANNERS = ("swapadvisor", "swap_only", "checkpoint", "vdnn", "lru", "ideal")


def plan_swaps(problem: SwapProblem, planner: str = "swapadvisor", *,
               time_budget_s: float = 30.0, seed: int = 0,
               config: SearchConfig | None = None) -> SwapPlan:
    """Plan one iteration of `problem` under its budget.

    Planners: "swapadvisor" (the search: schedule, layout, swaps and recompute), "swap_only"
    (the same search without recompute: SwapAdvisor as published), "checkpoint" (sqrt(n)
    recompute), "vdnn", "lru" and "ideal" (infinite memory).
    Raises `InfeasibleBudgetError` (with the smallest feasible budget) when no plan can fit.
    time_budget_s and seed apply to the SwapAdvisor search; the baselines are deterministic.
    """
    return plan_phases(problem, planner, time_budget_s=time_budget_s, seed=seed,
                       config=config)[-1]


def plan_phases(problem: SwapProblem, planner: str = "swapadvisor", *,
                time_budget_s: float = 30.0, seed: int = 0,
                config: SearchConfig | None = None) -> list[SwapPlan]:
    """The plan of each phase of `planner`'s search, the last being `plan_swaps`'s: for
    "swapadvisor" the swap-only phase's plan, then the plan of the phase that starts from its
    last population and adds recompute (a clock ends each phase, so two separate searches
    differ run to run: compare the phases of one); one plan for every other planner."""
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; planners: {', '.join(PLANNERS)}")
    if planner == "ideal":
        return [ideal(problem)]
    problem.check_feasible()
    if planner in ("swapadvisor", "swap_only"):
        return swapadvisor_phases(problem, time_budget_s, seed, config,
                                  recompute=planner == "swapadvisor", planner=planner)
    return [{"lru": lru, "vdnn": vdnn, "checkpoint": checkpoint}[planner](problem)]


__all__ = ["ALIGNMENT", "PLANNERS", "InfeasibleBudgetError", "PlanError", "Residency",
           "SearchConfig", "SimResult", "SwapIn", "SwapOut", "SwapPlan", "SwapProblem",
           "plan_phases", "plan_swaps", "simulate", "validate"]
