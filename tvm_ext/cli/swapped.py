"""--device-memory: plan the swaps (for an emulated link with --link-gbps), write the plan's
sidecar, run the swapped module."""

from __future__ import annotations

import contextlib
import json
import sys

import numpy as np

from tvm_ext import driver
from tvm_ext.cost.emulation import fixed_link
from tvm_ext.errors import CheckError
from tvm_ext.ir.targets import vm_devices
from tvm_ext.models.reference import tolerance
from tvm_ext.runtime import swap_streams
from tvm_ext.swap.timeline_plot import plot_plan
from tvm_ext.units import format_size

from .args import link_gbps
from .check import autocast_tolerance, check_against_torch
from .presets import default_hardware
from .report import failed_check, replacing
from .training import (
    check_training,
    match_build,
    parted_line,
    print_steps,
    reference_of,
    run_steps,
    step_report,
)


def plan_swaps_for(args, model, graph, target) -> tuple:
    """Plan before any compilation, so that a budget too small costs nothing. Returns
    (`driver.SwapPlanning`, its report), or (None, None) after printing why not. Under an
    emulated link the plan is made for the kernel times measured here (of the fused kernels,
    so none is run as its parts)."""
    hardware, op_times, link = default_hardware(args, target), None, None
    reserved = None if args.library else 0
    try:
        if args.link_gbps is not None:
            # A budget too small is refused before the kernels are measured.
            driver.check_swap_budget(graph, target, args.device_memory, reserved)
            link = emulated_link_for(args, model, graph, target)
            hardware, op_times = link.hardware, link.op_times
        planning = driver.plan_swap(model, target, args.device_memory, hardware=hardware,
                                    planner=args.planner, seed=args.seed,
                                    time_budget_s=args.swap_time_budget, op_times=op_times,
                                    reserved=reserved, graph=graph)
    except ValueError as err:  # InfeasibleBudgetError, or a budget that cannot be read
        print(f"error: {err}", file=sys.stderr)
        return None, None
    plan, problem = planning.plan, planning.problem
    ideal_time = planning.ideal_time()
    name = hardware if isinstance(hardware, str) else hardware.name
    info = {**plan.summary(), "no_swap_peak": problem.no_swap_peak(),
            "ideal_time": ideal_time, "hardware": name}
    if link is not None:
        info["emulated_link"] = link.summary()
    more = ""
    if plan.info.get("recomputed"):
        more += f", recomputes {plan.info['recomputed']} tensors"
    if plan.splits:
        more += f", splits {len(plan.splits)} ops in time"
    if planning.fissioned:
        more += f", runs {len(planning.fissioned)} fused kernels as their parts"
    print(f"swap    budget {format_size(problem.budget)} of no-swap peak "
          f"{format_size(problem.no_swap_peak())}: {plan.planner} plans "
          f"{format_size(plan.predicted_peak)}, swaps {format_size(plan.bytes_swapped)}{more}, "
          f"predicted {plan.predicted_time * 1e3:.3f} ms ({name}; ideal "
          f"{ideal_time * 1e3:.3f} ms), planned in {plan.planning_time:.1f} s")
    if args.plot:
        with replacing(args.plot) as (temp,):
            plot_plan(problem, plan, temp)
        info["plot"] = args.plot
        print(f"plot    {args.plot}")
    return planning, info


def emulated_link_for(args, model, graph, target) -> driver.StandIn:
    """--link-gbps: this CPU's kernel times and the link (fixed, or the --hardware preset's
    scaled to this CPU), with the swap runtime's costs measured on it."""
    gbps = link_gbps(args)
    with driver.dedicated_copy_cpu():  # measured as the swapped run will run
        timings = driver.measure_kernels(model, target, graph)
        if gbps is None:
            stand = driver.stand_in(graph, timings, preset=args.hardware or "h100")
            how = f"{stand.preset}'s link scaled by {stand.scale:.3g} (this CPU's compute " \
                  f"time / the preset's)"
        else:
            stand = driver.stand_in(graph, timings,
                                    link=fixed_link(gbps, args.link_latency_us or 0))
            how = "--link-gbps"
    print(f"link    emulated {stand.link.bandwidth / 1e9:.4g} GB/s, "
          f"{stand.link.latency * 1e6:.4g} us per copy ({how}); measured: kernels "
          f"{np.sum(stand.op_times) * 1e3:.3f} ms per iteration, copy issue "
          f"{_issue_range(stand.costs)} (by the stream's idle time), resume "
          f"{stand.costs.sync * 1e6:.0f} us")
    return stand


def write_swap_sidecar(path: str, planning, link=None) -> None:
    data = planning.sidecar
    if link is not None:  # what the plan was made for: set it when running the module
        data["emulated_link"] = {
            "environment": {swap_streams.LINK_ENV_GBPS: f"{link['link_gbps']:.6g}",
                            swap_streams.LINK_ENV_LATENCY_US: f"{link['link_latency_us']:.6g}"},
            **link}
    with open(path, "w") as f:
        json.dump(data, f)


@contextlib.contextmanager
def copy_cpu_for(link):
    """With an emulated link, the stand-in's copy workers on a CPU of their own and the
    compute on the others (`driver.dedicated_copy_cpu`), as a GPU's copy engines are not its
    cores; yields that CPU (None without a link, or with a single CPU)."""
    if not link:
        yield None
        return
    with driver.dedicated_copy_cpu() as cpu:
        yield cpu


@contextlib.contextmanager
def emulated(link: dict | None):
    """The emulated link of --link-gbps in force for the block (nothing to do without)."""
    if link is None:
        yield
        return
    swap_streams.set_emulated_link(link["link_gbps"] * 1e9, link["link_latency_us"] * 1e-6)
    try:
        yield
    finally:
        swap_streams.set_emulated_link(0.0)


def run_swapped(args, report, model, planning, executable, target, arguments,
                 tune_db=None, gradient_model=None) -> int:
    """Run the swapped module beside the unswapped one: outputs must match exactly (same
    kernels) and the measured device peak must fit the budget."""
    if gradient_model is not None:
        return run_swapped_training(args, report, model, gradient_model, planning,
                                    executable, target, tune_db)
    graph, plan = planning.graph, planning.plan
    device, host = vm_devices(target)
    link = report.get("swap", {}).get("emulated_link")
    with copy_cpu_for(link) as copy_cpu:
        with emulated(link):
            in_force = swap_streams.emulated_link()
            swapped = driver.run(executable, arguments, device, repeat=args.repeat, host=host,
                                 arg_devices=planning.argument_devices)
        # The unswapped twin: the same kernels as the plan's graph (budgeted: as fused under
        # a budget), so that outputs compare bit for bit.
        plain = driver.run(driver.build(model, target, tune_db=tune_db, library=args.library,
                                        budgeted=True),
                           arguments, device, repeat=args.repeat)
    constants = graph.bytes_of_kind("constant")  # loaded with the module, not by the VM
    measured = swapped.peak_bytes + constants
    budget = plan.budget
    report["run"] = {
        "latency_ms_median": swapped.median_ms, "no_swap_latency_ms_median": plain.median_ms,
        "measured_peak_bytes": measured, "planned_peak_bytes": plan.predicted_peak,
        "budget_bytes": budget, "no_swap_measured_peak_bytes": plain.peak_bytes,
        "host_peak_bytes": swapped.host_peak_bytes,
        "emulated_link": None if in_force is None else {
            "gbps": in_force.bandwidth / 1e9, "latency_us": in_force.latency * 1e6,
            "source": "--link-gbps" if link else "environment", "copy_cpu": copy_cpu},
    }
    if in_force is not None:
        print(f"link    the swapped run's copies were paced to an emulated link: "
              f"{in_force.describe()}" + ("" if link else
                                          f" (from ${swap_streams.LINK_ENV_GBPS})")
              + ("" if copy_cpu is None else f", copy workers on CPU {copy_cpu}"))
    ratio = swapped.median_ms / plain.median_ms if plain.median_ms else float("nan")
    print(f"memory  planned peak {format_size(plan.predicted_peak)}, measured peak "
          f"{format_size(measured)} on {device} (budget {format_size(budget)}; no-swap build "
          f"{format_size(plain.peak_bytes)}); host {format_size(swapped.host_peak_bytes)}")
    print(f"run     {swapped.median_ms:.3f} ms swapped vs {plain.median_ms:.3f} ms without "
          f"swapping ({ratio:.2f}x), median of {args.repeat}")
    status = 0
    if args.check:
        inexact = planning.inexact_splits
        tolerances = _tolerances(swapped.outputs, inexact, autocast_tolerance(model))
        try:
            driver.compare(swapped.outputs, plain.outputs, tolerances=tolerances)
        except CheckError as err:
            print(f"check   FAILED: {err}", file=sys.stderr)
            status = 1
        if measured > budget:
            print(f"check   FAILED: measured peak {measured} bytes exceeds the budget {budget}",
                  file=sys.stderr)
            status = 1
        report["check"] = {"ok": status == 0, "reference": "the unswapped TVM build",
                           "exact": not inexact, "inexact_splits": inexact,
                           "tolerances": tolerances, "within_budget": measured <= budget}
        if status == 0:
            print(f"check   OK: {len(swapped.outputs)} outputs equal the unswapped build "
                  f"{_how_equal(inexact)}, and the measured peak fits the budget")
        status = max(status, check_against_torch(args, report, model, arguments,
                                                 swapped.outputs))
    return status


def run_swapped_training(args, report, step, gradient_model, planning, executable, target,
                         tune_db=None) -> int:
    """--steps steps of a swapped optimizer step beside the unswapped build: every step's
    device peak within the budget, the host memory the same after every step, losses,
    parameters and state equal to the unswapped build's exactly; then --check against
    torch.optim."""
    graph, plan = planning.graph, planning.plan
    device, host = vm_devices(target)
    batch = step.random_inputs(args.seed)
    session = driver.TrainingSession(executable, step, device, host=host, seed=args.seed,
                                     arg_devices=planning.argument_devices)
    results, trail = run_steps(session, batch, args)
    constants = graph.bytes_of_kind("constant")  # loaded with the module, not by the VM
    for r in results:
        r.peak_bytes += constants
    print_steps(results)
    budget = plan.budget
    worst = max(r.peak_bytes for r in results)
    hosts = {r.host_bytes for r in results}
    report["training"] = {**step_report(results), "budget_bytes": budget,
                          "planned_peak_bytes": plan.predicted_peak}
    print(f"memory  planned peak {format_size(plan.predicted_peak)}, measured peak "
          f"{format_size(worst)} in the worst step (budget {format_size(budget)}); host "
          f"{format_size(max(hosts))} after every step"
          + ("" if len(hosts) == 1 else " (NOT constant)"))
    if not args.check:
        return 0
    plain = driver.TrainingSession(driver.build(step, target, tune_db=tune_db,
                                                library=args.library, budgeted=True), step,
                                   device, seed=args.seed)
    expected = plain.run([batch] * args.steps)
    problems = []
    inexact = planning.inexact_splits
    # Losses in the step's own dtype (collected as Python floats), held to its tolerance.
    loss_dtype = graph.tensors[graph.outputs[0]].dtype
    losses = [np.array([r.loss for r in results], dtype=loss_dtype)]
    values = [*session.parameters(), *session.state()]
    reference, noise, stepwise = None, 0, False
    try:
        driver.compare(losses, [np.array([r.loss for r in expected], dtype=loss_dtype)],
                       tolerances=_tolerances(losses, inexact), names=["the losses"])
        if inexact and args.dtype == "fp32":
            # Chunks round otherwise: Adam's steps on rounding-noise gradients differ.
            reference = reference_of(args, step, gradient_model, target, batch, args.steps)
            matched = match_build(args, results, session.parameters(), session.state(),
                                  expected, plain, reference, *tolerance("float32"),
                                  gradient_model, batch, target, trail)
            noise, stepwise = matched.noise_elements, matched.step_by_step
        else:
            driver.compare(values, [*plain.parameters(), *plain.state()],
                           tolerances=_tolerances(values, inexact))
    except CheckError as err:
        problems.append(f"{err} (against the unswapped build)")
    if worst > budget:
        problems.append(f"a step's measured peak {worst} bytes exceeds the budget {budget}")
    if len(hosts) != 1:
        problems.append(f"host memory changes from step to step: {sorted(hosts)}")
    if problems:
        return failed_check(report, "the unswapped TVM build", problems)
    if stepwise:
        print(parted_line(len(results), "unswapped",
                          ", every step within the budget, host memory constant"))
    else:
        print(f"check   OK: {len(results)} steps equal the unswapped build "
              f"{_how_equal(inexact, 'exactly')} (losses, parameters, state"
              + (f"; {noise} elements with rounding-noise gradients within 2 N lr"
                 if noise else "")
              + "), every step within the budget, host memory constant")
    return check_training(args, report, step, gradient_model, target, batch, results,
                          session.parameters(), session.state(), reference, trail)


def _tolerances(outputs, inexact: list[str], least=None) -> list[tuple[float, float]]:
    """Exact, unless the plan runs ops in chunks that may round differently (`swap.exactness`:
    kernels that reduce): then the float tolerance of each output's dtype, at least `least`
    (an autocast model's low dtype, whose roundings its float32 outputs carry)."""
    return [tolerance(o.dtype, least) if inexact else (0.0, 0.0) for o in outputs]


def _how_equal(inexact: list[str], exactly: str = "exactly (rtol 0, atol 0)") -> str:
    if not inexact:
        return exactly
    names = ", ".join(inexact[:3]) + (f" and {len(inexact) - 3} more" if len(inexact) > 3 else "")
    return (f"within the float tolerance of their dtype (ops run in chunks that may round "
            f"differently, kernels that reduce: {names})")


def _issue_range(costs) -> str:
    """The measured hand-over of a copy to an idle stream, as 'a-b us'."""
    issue = [c for _, c, _ in costs.wake] or [costs.copy_issue]
    low, high = min(issue) * 1e6, max(issue) * 1e6
    return f"{low:.0f} us" if round(low) == round(high) else f"{low:.0f}-{high:.0f} us"
