"""`compile.py MODEL --devices K`: plan, partition, build, export, run on K workers, check
against the single-device module, and report (see `tvm_ext.driver.partitioned`)."""

from __future__ import annotations

import json
import re
import sys
import time

import numpy as np
import tvm

from tvm_ext import driver, interrupts
from tvm_ext.driver.partitioned import build_partitioned, run_partitioned_build
from tvm_ext.errors import CheckError
from tvm_ext.ir.targets import is_cpu
from tvm_ext.partition import NotApplicable, PartitionPlan
from tvm_ext.passes import PartitionError
from tvm_ext.runtime import distributed
from tvm_ext.swap import InfeasibleBudgetError
from tvm_ext.units import format_size

from .check import check_against_reference
from .presets import default_hardware
from .report import failed_check, remove_stale_sidecars, replacing, write_report
from .training import (
    LOW_PRECISION_BOUND,
    check_training,
    match_build,
    parted_line,
    print_steps,
    reference_of,
    run_steps,
    step_report,
)


def load_plan(path: str):
    """A plan from a JSON file: a plan, a --report of a partitioned build, or an --output
    sidecar."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no partition plan: it holds a JSON "
                         f"{type(data).__name__}, not an object")
    if isinstance(data.get("partition"), dict) and "plan" in data["partition"]:
        data = data["partition"]["plan"]
    elif "plan" in data and "layout" in data:
        data = data["plan"]
    try:
        return PartitionPlan.from_dict(data)
    except (TypeError, AttributeError, KeyError, ValueError) as err:
        raise ValueError(f"{path} holds no partition plan: {_schema_problem(err)}; give a "
                         "plan, a --report of a partitioned build or an --output sidecar"
                         ) from None


def _schema_problem(err: Exception) -> str:
    """What a record of the JSON lacks or has too many of, from the dataclass' TypeError."""
    text = str(err)
    record = re.match(r"(\w+)\.__init__\(\)", text)
    where = f"a {record.group(1)} record" if record else "a record"
    extra = re.search(r"unexpected keyword argument '(\w+)'", text)
    if extra:
        return f"{where} has a field {extra.group(1)!r} a plan does not have"
    missing = re.search(r"missing \d+ required (?:positional |keyword-only )?arguments?: (.+)$",
                        text)
    if missing:
        return f"{where} lacks {missing.group(1)}"
    return f"a record is not what a plan holds ({type(err).__name__})"


def main_partitioned(args, report: dict, model, target, tune_db, gradient_model=None) -> int:
    plan = None
    try:
        if args.partition_plan:
            plan = load_plan(args.partition_plan)
    except (OSError, ValueError) as err:
        print(f"error: --partition-plan: {err}", file=sys.stderr)
        return 2
    k = args.devices
    if plan is not None and plan.num_devices != k:
        print(f"error: the plan in {args.partition_plan} partitions over {plan.num_devices} "
              f"devices, not {k}: plan again with --devices {k} (without --partition-plan)",
              file=sys.stderr)
        return 2
    cpu = is_cpu(target)
    hardware = default_hardware(args, target)
    # The plan predicts the peak of an unplanned build (each tensor allocated at its producer,
    # freed after its last use): build so when the result is measured.
    measure = args.run or args.check
    swap_options = None
    if args.device_memory:
        swap_options = {"hardware": hardware, "planner": args.planner, "seed": args.seed}
        if args.planner == "swapadvisor":
            swap_options["time_budget_s"] = args.swap_time_budget
    start = time.perf_counter()
    interrupts.enter("planning")  # then "build" and "codegen" (the pipeline's)
    try:
        build = build_partitioned(
            model, target, k, hardware=hardware, strategy=args.strategy, link=args.link,
            plan=plan, device_memory=args.device_memory, swap_options=swap_options,
            memory_planning=not measure, dump_dir=args.dump_dir, tune_db=tune_db,
            library=args.library)
    except (PartitionError, NotApplicable, InfeasibleBudgetError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report["compile_seconds"] = time.perf_counter() - start
    _report_plan(report, build, k)
    print(f"compile {report['compile_seconds']:.2f} s for {target.kind.name}, {k} devices"
          + (" (unplanned memory, as the plan predicts it)" if measure else ""))

    if args.output:
        _export(args, report, build, cpu, k)

    status = 0
    if measure:
        interrupts.enter("running")
        if not cpu:
            print(f"error: --run/--check of a {target.kind.name} module needs {k} GPUs; this "
                  "build runs partitioned modules on cpu workers only (--target llvm)",
                  file=sys.stderr)
            return 2
        if gradient_model is not None:
            status = _run_training(args, report, build, model, gradient_model, target, k)
            write_report(args, report)
            return status
        arguments = model.random_arguments(args.seed)
        with distributed.Session(k) as sess:
            result = run_partitioned_build(sess, build, arguments, repeat=args.repeat)
        status = _report_run(args, report, build, result, k)
        if args.check:
            checked = check_against_reference(args, report, model, target, tvm.cpu(0),
                                              arguments, result.outputs,
                                              "the single-device TVM build")
            status = max(status, checked)
    write_report(args, report)
    return status


def _export(args, report: dict, build, cpu: bool, k: int) -> None:
    """--output: the module and its sidecar (layouts, plan)."""
    side = args.output + ".partition.json"
    with replacing(args.output, side) as (module_path, side_path):
        driver.export(build.executable, module_path)
        with open(side_path, "w") as f:
            json.dump(build.sidecar(), f)
    remove_stale_sidecars(args.output, keep=(".partition.json",))
    report["output"] = args.output
    print(f"export  {args.output}")
    print(f"export  {side} (mesh, each argument's and output's layout, the plan)")
    if not cpu:
        print(f"        compile-only here: run it on {k} GPUs with tvm_ext.runtime.distributed."
              f"Session({k}, 'nccl') and run_partitioned (not run on this machine)")


def _report_plan(report: dict, build, k: int) -> None:
    plan = build.plan
    s = plan.summary()
    colls = ", ".join(f"{kind} x{c['count']}" for kind, c in s["collectives"].items()) or "none"
    report["partition"] = {
        "summary": s, "plan": plan.to_dict(), "layout": build.layout,
        "fallbacks": build.fallbacks, "unrestricted": build.unrestricted,
        "predicted_peak_bytes_per_device": build.predicted_peak,
    }
    print(f"plan    {plan.strategy} over {k} devices, mesh {plan.mesh} ({', '.join(plan.links)}"
          f", {plan.hardware}): {format_size(s['bytes_per_device'])} sent per device "
          f"({colls}); predicted {s['iteration_time_s'] * 1e6:.1f} us per step")
    print(f"memory  per device {format_size(s['peak_bytes_per_device'])} predicted (single "
          f"device {format_size(s['single_device_peak'])}); "
          f"{format_size(build.predicted_peak)} of it in allocators (no kernel scratch, no "
          "constants)")
    if plan.held:
        n = len(plan.held)
        shown = ", ".join(plan.held[:4]) + (f" and {n - 4} more" if n > 4 else "")
        print(f"held    {n} tensor{'s' if n > 1 else ''} at a fixed layout ({shown}): read by "
              "many ops across the graph, they make the search's tables too large to choose "
              "jointly with the rest")
    chosen = [f for f in build.fallbacks if f["chosen_without_restriction"]]
    print(f"lowered {len(build.fallbacks)} splits the partitioner could choose cannot be lowered"
          f"; {len(chosen)} of them the unrestricted plan chose"
          + (f" (it would send {format_size(build.unrestricted['bytes_per_device'])} per device"
             f", {build.unrestricted['iteration_time_s'] * 1e6:.1f} us)"
             if build.unrestricted else ""))
    for f in chosen:
        ops = ", ".join(f["chosen_without_restriction"])
        print(f"  fallback {f['kernel']} split on {f['dim']} ({ops}): {f['reason']}")
    if build.swap_plan is not None:
        sp = build.swap_plan
        report["swap"] = sp.summary()
        print(f"swap    per device: budget {format_size(sp.budget)}, {sp.planner} plans "
              f"{format_size(sp.predicted_peak)}, swaps {format_size(sp.bytes_swapped)}")


def _report_run(args, report: dict, build, result, k: int) -> int:
    predicted, what = build.predicted_peak, "plan"
    measured = result.peak_bytes
    if build.swap_plan is not None:
        # Against what the swap plan predicts for each device (constants included, as the
        # budget counts them), not the partition's unswapped peak.
        constants = build.worker_graph.bytes_of_kind("constant")
        measured = [m + constants for m in measured]
        predicted, what = build.swap_plan.predicted_peak, "swap plan"
    run = {"latency_ms_median": float(np.median(result.latencies_ms)) if result.latencies_ms
           else None, "latencies_ms": result.latencies_ms,
           "measured_peak_bytes_per_worker": measured,
           "argument_bytes_per_worker": result.argument_bytes,
           "predicted_peak_bytes_per_device": predicted,
           "host_peak_bytes_per_worker": result.host_peak_bytes}
    report["run"] = run
    ratios = ", ".join(f"{m / max(predicted, 1):.3f}" for m in measured)
    if result.latencies_ms:
        print(f"run     {run['latency_ms_median']:.3f} ms (median of {args.repeat}) on {k} cpu "
              "workers")
    print(f"memory  measured peak per worker {', '.join(format_size(m) for m in measured)}; "
          f"{what} {format_size(predicted)} (measured / predicted: {ratios})")
    status = 0
    if build.swap_plan is not None:
        budget = build.swap_plan.budget
        over = [i for i, m in enumerate(measured) if m > budget]
        run["budget_bytes"] = budget
        print(f"memory  per-device budget {format_size(budget)}: "
              + ("every worker fits" if not over else f"workers {over} exceed it"))
        if over and args.check:
            status = 1
    return status


def _run_training(args, report: dict, build, step, gradient_model, target, k: int) -> int:
    """--steps steps of a partitioned optimizer step on k workers (each holding its pieces of
    the parameters and state throughout), every step's per-worker peak against the plan (and
    the budget, when swapped); --check: against the single-device build (losses, parameters
    and state within 1e-5) and against torch.optim."""
    batch = step.random_inputs(args.seed)
    with distributed.Session(k) as sess:
        session = driver.PartitionedTrainingSession(sess, build, step, seed=args.seed)
        results, trail = run_steps(session, batch, args)
        params, state = session.parameters(), session.state()
    print_steps(results, " per worker")
    worst = [max(r.peak_bytes[w] for r in results) for w in range(k)]
    report["training"] = {**step_report(results),
                          "predicted_peak_bytes_per_device": build.predicted_peak}
    print(f"memory  measured peak per worker {', '.join(format_size(m) for m in worst)} in the "
          f"worst step; plan {format_size(build.predicted_peak)}")
    problems = []
    if build.swap_plan is not None:
        budget = build.swap_plan.budget
        if any(m > budget for m in worst):
            problems.append(f"a worker's peak exceeds the per-device budget {budget}")
        if len({tuple(r.host_bytes) for r in results}) != 1:
            problems.append("host memory changes from step to step")
    if not args.check:
        return 0
    single = driver.TrainingSession(driver.build(step, target, library=args.library), step,
                                    tvm.cpu(0), seed=args.seed)
    expected = single.run([batch] * args.steps)
    reference = reference_of(args, step, gradient_model, target, batch, args.steps)
    stepwise = False
    try:
        if args.dtype == "fp32":
            # The single-device steps as a reference, with torch's rounding-noise gradients
            # marked.
            stepwise = match_build(args, results, params, state, expected, single, reference,
                                   1e-5, 1e-5, gradient_model, batch, target,
                                   trail).step_by_step
        else:  # low precision: the partitioned sums round otherwise; the curves must agree
            rtol, atol = LOW_PRECISION_BOUND[args.dtype]
            driver.compare([np.array([r.loss for r in results])],
                           [np.array([r.loss for r in expected])], rtol, atol,
                           names=["the losses"])
    except CheckError as err:
        problems.append(f"{err} (against the single-device build)")
    if problems:
        return failed_check(report, "the single-device TVM build", problems)
    what = "losses, parameters, state within 1e-5" if args.dtype == "fp32" else \
        f"losses within the {args.dtype} bound"
    swapped = ", every worker within the budget, host memory constant" \
        if build.swap_plan is not None else ""
    if stepwise:
        print(parted_line(len(results), "single-device", swapped))
    else:
        print(f"check   OK: {len(results)} steps match the single-device build ({what})"
              f"{swapped}")
    return check_training(args, report, step, gradient_model, target, batch, results, params,
                          state, reference, trail)
