"""`scripts/compile.py` (also installed as `tvm-ext-compile`): compile a model with the tvm_ext
pipeline, export it, run it here, check it against a plain TVM build, and report."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np


def _parse_value(text: str):
    """`--set` values: ints, floats, comma lists of ints, or strings."""
    if "," in text:
        return tuple(_parse_value(t) for t in text.split(",") if t)
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compile.py",
        description="Compile a model with the tvm_ext pipeline; optionally run, check, export.",
    )
    p.add_argument("model", nargs="?", default="gpt",
                   help="zoo model (mlp, gpt, resnet) or a .pt2 / .onnx / .py file "
                        "(default: gpt)")
    p.add_argument("--size", default="tiny", help="zoo model size (tiny, small, medium, ...)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a zoo size field, e.g. --set layers=4 (repeatable)")
    p.add_argument("--training", action="store_true",
                   help="compile the training step (forward + backward) instead of inference")
    p.add_argument("--target", default="llvm", help="llvm, cuda, or a TVM target string")
    p.add_argument("--arch", default=None, help="CUDA arch (default sm_90, Hopper)")
    p.add_argument("--output", "-o", help="export the compiled module to this .so")
    p.add_argument("--run", action="store_true", help="run the module here; print latency "
                                                      "and measured peak device memory")
    p.add_argument("--check", action="store_true",
                   help="compare outputs with a plain tvm.compile on random inputs")
    p.add_argument("--report", metavar="PATH", help="write a JSON report")
    p.add_argument("--repeat", type=int, default=5, help="timed runs for --run")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--dump-dir", help="write the module after each pipeline phase there")
    p.add_argument("--tune-trials", type=int, default=0, metavar="N",
                   help="tune the kernels with MetaSchedule (XGBoost cost model), N trials in "
                        "all, into --tune-db, then build with the records; trials already in "
                        "the database count, so a second call tunes nothing")
    p.add_argument("--tune-db", metavar="DIR",
                   help="tuning work dir to build with (and tune into with --tune-trials; "
                        "default there: ./tvm_ext_tune_db)")
    swap = p.add_argument_group("swapping (SwapOffload)")
    swap.add_argument("--device-memory", metavar="SIZE",
                      help="device memory budget: bytes with units (512MiB, 4GB) or a "
                           "percentage of the no-swap peak (25%%)")
    swap.add_argument("--planner", default="swapadvisor",
                      choices=["swapadvisor", "vdnn", "lru"], help="swap planner")
    swap.add_argument("--hardware", default=None,
                      help="cost-model preset for planning (default: cpu for llvm, h100 for "
                           "cuda; see tvm_ext.cost.HARDWARE)")
    swap.add_argument("--swap-time-budget", type=float, default=10.0, metavar="SECONDS",
                      help="time budget of the SwapAdvisor search")
    swap.add_argument("--plot", metavar="PATH",
                      help="write the plan's device-memory and stream timeline as a PNG")
    part = p.add_argument_group("partitioning over devices (PartitionOperators)")
    part.add_argument("--devices", type=int, metavar="K",
                      help="partition over K devices (Tofu plan, explicit collectives); --run "
                           "runs it on K cpu workers (Disco) and --check compares with the "
                           "single-device module; with --device-memory the budget is per device")
    part.add_argument("--strategy", default="tofu",
                      choices=["tofu", "data_parallel", "megatron", "exact"],
                      help="partitioning strategy (default tofu)")
    part.add_argument("--link", default="nvlink",
                      help="link between devices for planning (nvlink, pcie, ...)")
    part.add_argument("--partition-plan", metavar="PATH",
                      help="apply a saved plan (JSON, e.g. the plan of a --report or of the "
                           "sidecar of --output) instead of planning")
    return p


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Heavy imports after argument parsing, so --help is instant.
    import tvm_ext  # noqa: F401  (loads the runtime library, registers the pipeline)
    from tvm_ext import compiler
    from tvm_ext.cuda_support import DEFAULT_ARCH, CudaUnavailableError
    from tvm_ext.models import ModelLoadError, load_model

    report: dict = {"model": args.model, "target": args.target, "host": platform.node()}
    try:
        overrides = dict(kv.split("=", 1) for kv in args.set)
    except ValueError:
        print("error: --set takes FIELD=VALUE", file=sys.stderr)
        return 2
    overrides = {k: _parse_value(v) for k, v in overrides.items()}
    try:
        model = load_model(args.model, args.size, args.training, **overrides)
        target = compiler.resolve_target(args.target, args.arch or DEFAULT_ARCH)
    except (ModelLoadError, CudaUnavailableError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report["model_summary"] = model.summary()
    kind = "training step" if model.training else "inference"
    print(f"model   {model.name} ({kind}), {len(model.params)} parameters, "
          f"{_fmt_bytes(model.param_bytes)}")

    graph = compiler.analyze(model, target)
    gsum = graph.summary()
    report["graph"] = gsum
    live = graph.peak_memory(kinds=("parameter", "input", "constant", "activation", "gradient"))
    print(f"graph   {gsum['ops']} ops ({gsum['kernels']} kernels), {gsum['gflops']:.3f} GFLOP, "
          f"liveness peak {_fmt_bytes(live)} without kernel scratch "
          f"({_fmt_bytes(gsum['peak_bytes'])} with)")

    failed, tune_db = _tune(args, model, target, report)
    if failed:
        return failed
    if args.devices is not None or args.partition_plan:
        from tvm_ext.cli_partition import main_partitioned

        return main_partitioned(args, report, model, target, tune_db)

    plan = None
    if args.device_memory:
        plan, swap_info = _plan_swaps(args, graph, target)
        if plan is None:
            return 2
        report["swap"] = swap_info
    start = time.perf_counter()
    executable = compiler.build(model, target, dump_dir=args.dump_dir, tune_db=tune_db,
                                swap_plan=plan)
    report["compile_seconds"] = time.perf_counter() - start
    print(f"compile {report['compile_seconds']:.2f} s for {target.kind.name}")

    if args.output:
        compiler.export(executable, args.output)
        report["output"] = args.output
        print(f"export  {args.output}")
        if plan is not None:
            side = _write_swap_sidecar(args.output, graph, plan, target)
            print(f"export  {side} (the plan, and which arguments go to the host)")

    status = 0
    if args.run or args.check:
        device = compiler.device_of(target)
        if not device.exist:
            print(f"error: no {target.kind.name} device here to run on; --output exports a "
                  "module for a machine that has one", file=sys.stderr)
            return 2
        arguments = model.random_arguments(args.seed)
        if plan is not None:
            status = _run_swapped(args, report, model, graph, plan, executable, target,
                                  arguments, tune_db)
            write_report(args, report)
            return status
        result = compiler.run(executable, arguments, device, repeat=args.repeat)
        report["run"] = {
            "latency_ms_median": result.median_ms,
            "latencies_ms": result.latencies_ms,
            "measured_peak_bytes": result.peak_bytes,
            "argument_bytes": result.argument_bytes,
            "predicted_unplanned_peak_bytes": live,
        }
        print(f"run     {result.median_ms:.3f} ms (median of {args.repeat}), measured peak "
              f"{_fmt_bytes(result.peak_bytes)} on {device} (arguments "
              f"{_fmt_bytes(result.argument_bytes)})")
        if args.check:
            status = check_against_reference(args, report, model, target, device, arguments,
                                             result.outputs, "the plain TVM build")
    write_report(args, report)
    return status


def check_against_reference(args, report: dict, model, target, device, arguments, outputs,
                            what: str) -> int:
    """--check: `outputs` against a plain `tvm.compile` of the model run on `device` with the
    same `arguments`; the verdict goes into `report["check"]`. Returns the exit status."""
    from tvm_ext import compiler

    reference = compiler.build_reference(model, target)
    ref = compiler.run(reference, arguments, device, repeat=0)
    try:
        check = compiler.compare(outputs, ref.outputs, args.rtol, args.atol)
    except compiler.CheckError as err:
        report["check"] = {"ok": False, "error": str(err)}
        print(f"check   FAILED: {err}", file=sys.stderr)
        return 1
    report["check"] = {"ok": True, **vars(check)}
    print(f"check   OK: {check.outputs} outputs match {what} (max abs error "
          f"{check.max_abs_error:.2e}, max rel error {check.max_rel_error:.2e}, rtol {args.rtol})")
    return 0


def write_report(args, report: dict) -> None:
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2, default=_json_default)
        print(f"report  {args.report}")


def default_hardware(args, target) -> str:
    """--hardware, else the preset of the target's kind (cpu for CPU targets, h100 for GPUs)."""
    return args.hardware or ("cpu" if target.kind.name in ("llvm", "c") else "h100")


def _tune(args, model, target, report: dict) -> tuple[int, str | None]:
    """--tune-trials / --tune-db: tune if asked. Returns (exit status if it failed, else 0;
    the work dir to build with, None without tuning)."""
    if not args.tune_trials and not args.tune_db:
        return 0, None
    import os

    from tvm_ext import schedules

    work_dir = args.tune_db or schedules.DEFAULT_WORK_DIR
    if args.tune_trials < 0:
        print("error: --tune-trials takes a number of trials >= 0", file=sys.stderr)
        return 2, None
    # With --devices, tune the kernels each device runs (the partitioned module's).
    popts = {}
    hardware = default_hardware(args, target)
    if args.partition_plan:
        from tvm_ext.cli_partition import load_plan

        try:
            popts = {"partition_plan": load_plan(args.partition_plan),
                     "partition_options": {"hardware": hardware}}
        except (OSError, ValueError):
            popts = {}  # reported when the plan is applied
    elif args.devices is not None and args.devices >= 1:
        popts = {"num_devices": args.devices, "partition_options": {
            "hardware": hardware, "strategy": args.strategy, "link": args.link}}
    if args.tune_trials:
        try:
            tuning = schedules.tune(model.mod, target, work_dir, args.tune_trials, **popts)
        except KeyboardInterrupt:
            print("tuning interrupted: the records so far are kept; run the same command "
                  "again to resume", file=sys.stderr)
            return 130, None
        report["tuning"] = tuning.to_json()
    elif not os.path.isdir(work_dir):
        print(f"error: no tuning work dir {work_dir}: create one with --tune-trials N",
              file=sys.stderr)
        return 2, None
    staged = schedules.module_at_schedule_phase(model.mod, target, **popts)
    tuned, default = schedules.coverage(staged, target, work_dir)
    report.setdefault("tuning", {}).update(kernels_tuned=tuned, kernels_default=default)
    print(f"tuning  {len(tuned)} of {len(tuned) + len(default)} kernels scheduled from "
          f"{schedules.database_dir(work_dir, target)}"
          + (f"; {len(default)} keep the default schedules" if default else ""))
    return 0, work_dir


def _plan_swaps(args, graph, target):
    """Plan before any compilation, so that a budget too small costs nothing."""
    from tvm_ext.passes.swap_offload import plan_problem
    from tvm_ext.swap import InfeasibleBudgetError, plan_swaps
    from tvm_ext.swap.timeline_plot import plot_plan

    hardware = default_hardware(args, target)
    try:
        problem = plan_problem(graph, args.device_memory, hardware)
        plan = plan_swaps(problem, args.planner, time_budget_s=args.swap_time_budget,
                          seed=args.seed)
    except (InfeasibleBudgetError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None, None
    ideal = plan_swaps(problem, "ideal")
    info = {**plan.summary(), "no_swap_peak": problem.no_swap_peak(),
            "ideal_time": ideal.predicted_time, "hardware": hardware}
    print(f"swap    budget {_fmt_bytes(problem.budget)} of no-swap peak "
          f"{_fmt_bytes(problem.no_swap_peak())}: {plan.planner} plans "
          f"{_fmt_bytes(plan.predicted_peak)}, swaps {_fmt_bytes(plan.bytes_swapped)}, "
          f"predicted {plan.predicted_time * 1e3:.3f} ms ({hardware}; ideal "
          f"{ideal.predicted_time * 1e3:.3f} ms), planned in {plan.planning_time:.1f} s")
    if args.plot:
        plot_plan(problem, plan, args.plot)
        info["plot"] = args.plot
        print(f"plot    {args.plot}")
    return plan, info


def _write_swap_sidecar(output: str, graph, plan, target) -> str:
    from tvm_ext.passes.swap_offload import argument_devices

    path = output + ".swap.json"
    with open(path, "w") as f:
        json.dump({"plan": plan.to_dict(), "argument_devices": argument_devices(graph, plan),
                   "devices": ["device", "host"], "target": str(target.kind.name)}, f)
    return path


def _run_swapped(args, report, model, graph, plan, executable, target, arguments,
                 tune_db=None) -> int:
    """Run the swapped module beside the unswapped one: outputs must match exactly (same
    kernels) and the measured device peak must fit the budget."""
    from tvm_ext import compiler
    from tvm_ext.passes.swap_offload import argument_devices, vm_devices

    device, host = vm_devices(target)
    swapped = compiler.run(executable, arguments, device, repeat=args.repeat, host=host,
                           arg_devices=argument_devices(graph, plan))
    plain = compiler.run(compiler.build(model, target, tune_db=tune_db), arguments, device,
                         repeat=args.repeat)
    constants = graph.bytes_of_kind("constant")  # loaded with the module, not by the VM
    measured = swapped.peak_bytes + constants
    budget = plan.budget
    report["run"] = {
        "latency_ms_median": swapped.median_ms, "no_swap_latency_ms_median": plain.median_ms,
        "measured_peak_bytes": measured, "planned_peak_bytes": plan.predicted_peak,
        "budget_bytes": budget, "no_swap_measured_peak_bytes": plain.peak_bytes,
        "host_peak_bytes": swapped.host_peak_bytes,
    }
    ratio = swapped.median_ms / plain.median_ms if plain.median_ms else float("nan")
    print(f"memory  planned peak {_fmt_bytes(plan.predicted_peak)}, measured peak "
          f"{_fmt_bytes(measured)} on {device} (budget {_fmt_bytes(budget)}; no-swap build "
          f"{_fmt_bytes(plain.peak_bytes)}); host {_fmt_bytes(swapped.host_peak_bytes)}")
    print(f"run     {swapped.median_ms:.3f} ms swapped vs {plain.median_ms:.3f} ms without "
          f"swapping ({ratio:.2f}x), median of {args.repeat}")
    status = 0
    if args.check:
        try:
            compiler.compare(swapped.outputs, plain.outputs, rtol=0, atol=0)
        except compiler.CheckError as err:
            print(f"check   FAILED: {err}", file=sys.stderr)
            status = 1
        if measured > budget:
            print(f"check   FAILED: measured peak {measured} bytes exceeds the budget {budget}",
                  file=sys.stderr)
            status = 1
        report["check"] = {"ok": status == 0, "exact": True, "within_budget": measured <= budget}
        if status == 0:
            print(f"check   OK: {len(swapped.outputs)} outputs equal the unswapped build "
                  "exactly, and the measured peak fits the budget")
    return status


def _json_default(obj):
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    return str(obj)


if __name__ == "__main__":
    sys.exit(main())
