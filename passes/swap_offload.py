"""SwapOffload: run a Relax function in less device memory than it needs, by a swap plan.

Input: a module after legalization and fusion (`tvm_ext.pipeline.legalize_passes`), before
dataflow lowering. The pass builds the function's `DataflowGraph`, asks a planner for a
`SwapPlan` under the device budget (or takes the plan given) and rewrites `main` into the
lowered, destination-passing form the rest of the pipeline leaves alone:

1. the bindings in the planned order;
2. explicit device memory: one `R.memory.alloc_storage` per planned pool at the start, every
   tensor placed at its window (`R.memory.alloc_tensor(pool, offset, ...)`, offsets aligned to
   256 bytes) and each kernel called with its outputs (`gv(inputs..., outputs...)`), so
   `StaticPlanBlockMemory` has nothing to plan and the pools are all the device memory used
   beyond the arguments kept there;
3. copies on two streams through the runtime library (`tvm_ext.runtime.swap_streams`): swap-outs
   (stream 0, device to host, into one host pool) after the op the plan names, swap-ins
   (stream 1) into their window, a `wait` right before the first op that reads a swapped-in
   tensor and before any op that overwrites a region still being copied out, and `wait_all`
   before returning. A swap-in into a region still being copied out (or of data still being
   copied out) is not waited for by the caller: the runtime orders it after that swap-out on
   the copy streams, so the compute goes on as the simulator assumes;
4. arguments the plan leaves on the host are declared on a host virtual device (VM device 1),
   the others on the device (VM device 0);
5. the function attribute `tvm_ext.swap_plan` records the plan summary (budget, planned peak,
   bytes swapped, predicted time) and `tvm_ext.swap_arguments` where each argument lives;
6. an optimizer step's update (an op that overwrites an argument in place, see
   `tvm_ext.graph`) writes into the argument's current device copy (its pool window, or the
   argument itself when the plan keeps it on the device) through the in-place form of its
   kernel (`tvm_ext.ir.inplace_kernels`); the plan copies an argument kept on the host back
   into the argument's host buffer after it is overwritten, so each step starts where the last
   one left it.

Run it after the legalize phase (and the partition phase, per device) and before the schedule
phase and `dataflow_lower_passes`, as the "tvm_ext" pipeline does with `device_memory=`. A
function already rewritten is left unchanged.

The plan comes from `tvm_ext.ir.swap_planning` (the one way swaps are planned); the rewrite is
`passes/swap_rewrite/`: whole ops and copies (`whole_ops`), ops run in chunks (`chunked_ops`),
the function around them (`function`).
"""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax

from tvm_ext.cost import Hardware
from tvm_ext.ir.graph_builder import read_pass_input
from tvm_ext.ir.inplace_kernels import drop_unused
from tvm_ext.ir.kernel_fission import fission_kernels
from tvm_ext.ir.local_kernels import LoweringError
from tvm_ext.ir.pass_records import SWAP_PLAN_ATTR, has_record
from tvm_ext.ir.swap_planning import plan_module_swaps
from tvm_ext.ir.targets import host_vdevice
from tvm_ext.ir.time_splits import annotate_time_splits
from tvm_ext.swap import SwapPlan, validate
from tvm_ext.swap.problem import problem_for_budget

from .swap_rewrite.emission import SwapOffloadError
from .swap_rewrite.function import FunctionRewriter

__all__ = ["SwapOffload", "SwapOffloadError"]


@tvm.transform.module_pass(opt_level=0, name="SwapOffload")
class SwapOffload:
    """Plan and apply swapping so that `main` runs within `device_memory` bytes.

    Args:
        device_memory: the device budget: bytes, a size string ("512MiB"), or a percentage of
            the no-swap peak ("25%").
        host: the host virtual device (default: `host_vdevice(target)`).
        hardware: the cost-model preset (or `Hardware`) the planner times ops and copies with.
        planner: "swapadvisor", "vdnn", "lru" (see `tvm_ext.swap.plan_swaps`).
        time_budget_s, seed: for the SwapAdvisor search.
        plan: a `SwapPlan` (or its JSON) to apply instead of planning.
        op_times: measured seconds per op, instead of the roofline.
        function: the function to rewrite.
        reserved_bytes: device memory outside the graph (the vendor library's workspace): an
            absolute budget is shared with it.
    """

    def __init__(
        self,
        device_memory: int | str | None = None,
        *,
        host: relax.VDevice | None = None,
        hardware: str | Hardware = "h100",
        planner: str = "swapadvisor",
        time_budget_s: float = 10.0,
        seed: int = 0,
        plan: SwapPlan | str | None = None,
        op_times: Sequence[float] | None = None,
        function: str = "main",
        reserved_bytes: int = 0,
    ):
        if device_memory is None and plan is None:
            raise ValueError("SwapOffload needs device_memory or a plan")
        self.device_memory = device_memory
        self.host = host
        self.hardware = hardware
        self.planner = planner
        self.time_budget_s = time_budget_s
        self.seed = seed
        self.plan = SwapPlan.from_json(plan) if isinstance(plan, str) else plan
        self.op_times = op_times
        self.function = function
        self.reserved_bytes = reserved_bytes

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext):
        names = [gv.name_hint for gv in mod.functions]
        if self.function in names and has_record(mod[self.function], SWAP_PLAN_ATTR):
            return mod  # already swapped
        given = mod
        if self.plan is not None and self.plan.fissioned:
            given = self._fission(given, self.plan.fissioned)
        mod, graph, bindings, constants = read_pass_input(
            given, self.function, "SwapOffload", SwapOffloadError, _check_form)
        annotate_time_splits(mod, graph)
        target = tvm.target.Target.current(allow_none=True) or tvm.target.Target("llvm")
        if self.plan is not None:
            budget = self.plan.budget if self.device_memory is None else self.device_memory
            # A plan's own budget is what it was planned under, the reserve already out.
            reserved = self.reserved_bytes if self.device_memory is not None else 0
            problem = problem_for_budget(graph, budget, self.hardware, self.op_times, reserved)
            plan = self.plan
            try:
                validate(problem, plan)
            except Exception as err:  # PlanError, or ids that do not fit this graph
                raise SwapOffloadError(f"the plan given does not fit this function: {err}") \
                    from err
        else:
            plan = plan_module_swaps(
                mod, self.device_memory, target=str(target.kind.name), hardware=self.hardware,
                planner=self.planner, seed=self.seed, time_budget_s=self.time_budget_s,
                op_times=self.op_times, reserved=self.reserved_bytes, function=self.function,
                graph=graph).plan
            if plan.fissioned:  # rewritten on the graph of its parts, which it indexes
                given = self._fission(given, plan.fissioned)
                mod, graph, bindings, constants = read_pass_input(
                    given, self.function, "SwapOffload", SwapOffloadError, _check_form)
                annotate_time_splits(mod, graph)
        func = given[self.function]
        device = relax.VDevice(target, 0, "global")
        host = self.host or host_vdevice(target)
        rewriter = FunctionRewriter(graph, bindings, constants, plan, device, host,
                                    _match_casts(mod[self.function]), mod)
        new_func = rewriter.rewrite(func)
        mod = mod.clone()
        mod.update_func(mod.get_global_var(self.function), new_func)
        for gv, kernel in rewriter.new_kernels:
            mod[gv] = kernel
        mod.update_global_info("vdevice", [device, host])
        return drop_unused(mod, rewriter.replaced_kernels)

    def _fission(self, mod: tvm.IRModule, kernels: list[str]) -> tvm.IRModule:
        """`mod` with the named kernels run as their parts (`kernel_fission`)."""
        try:
            return fission_kernels(mod, kernels, self.function)
        except (LoweringError, KeyError, ValueError) as err:
            raise SwapOffloadError(f"the plan runs kernels as their parts, which this module "
                                   f"cannot: {err}") from err


def _match_casts(func: relax.Function) -> dict:
    """Var -> the MatchCast bindings of it (the symbolic values it defines)."""
    casts: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if isinstance(binding, relax.MatchCast) and isinstance(binding.value, relax.Var):
                casts.setdefault(binding.value, []).append(binding)
    return casts


def _check_form(func: relax.Function) -> None:
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
                    value.op.name in ("relax.builtin.alloc_tensor", "relax.memory.alloc_storage",
                                      "relax.vm.alloc_storage"):
                raise SwapOffloadError(
                    "the function is already lowered to explicit memory: run SwapOffload "
                    "before dataflow lowering (tvm_ext.pipeline.dataflow_lower_passes, i.e. "
                    "before CallTIRRewrite)")
