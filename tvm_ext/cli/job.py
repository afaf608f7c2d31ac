"""The compile job behind scripts/compile.py once its arguments are valid: load the model, read
its graph, tune, plan, build, export, run and check, and report each step."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time

from tvm_ext import driver, interrupts, pipeline, schedules
from tvm_ext.errors import InputError
from tvm_ext.graph import GraphBuildError
from tvm_ext.ir.kernel_graphs import graph_coverage
from tvm_ext.ir.targets import is_cpu
from tvm_ext.models import ZOO, ModelLoadError, load_model
from tvm_ext.models.autocast import autocast_inference
from tvm_ext.runtime.cuda import DEFAULT_ARCH, CudaUnavailableError
from tvm_ext.units import format_size

from .args import MAX_CPU_WORKERS, model_load_message, read_overrides
from .check import check_against_reference
from .partitioned import load_plan, main_partitioned
from .presets import default_hardware
from .report import remove_stale_sidecars, replacing, write_report
from .swapped import plan_swaps_for, run_swapped, write_swap_sidecar
from .training import run_training, with_optimizer


def compile_model(args) -> int:
    """Load, plan, build, export, run and check the model the arguments name; the exit status."""
    report: dict = {"model": args.model, "target": args.target, "host": platform.node()}
    interrupts.enter("loading")
    loaded = _load(args, report)
    if loaded is None:
        return 2
    model, target, gradient_model = loaded
    try:
        graph, live = _read_graph(model, target, report, budgeted=bool(args.device_memory))
    except GraphBuildError as err:
        print(f"error: {args.model}: {err}", file=sys.stderr)
        return 2
    if args.devices is not None:
        problem = device_count_problem(args, graph, target)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2

    failed, tune_db = _tune(args, model, target, report)
    if failed:
        return failed
    if args.devices is not None:
        return main_partitioned(args, report, model, target, tune_db, gradient_model)

    planning = None
    if args.device_memory:
        interrupts.enter("planning")
        planning, swap_info = plan_swaps_for(args, model, graph, target)
        if planning is None:
            return 2
        report["swap"] = swap_info
        if swap_info["budget"] >= swap_info["no_swap_peak"]:
            swap_info["note"] = (f"the budget is at or above the no-swap peak "
                                 f"({format_size(swap_info['no_swap_peak'])}): the model fits "
                                 "as it is, nothing needs to leave the device")
            print(f"swap    {swap_info['note']}")
    start = time.perf_counter()
    interrupts.enter("build")  # "codegen" once the pipeline's passes are done
    finalized: list = []
    executable = driver.build(model, target, dump_dir=args.dump_dir, tune_db=tune_db,
                              swap_plan=None if planning is None else planning.plan,
                              library=args.library, cuda_graph=args.cuda_graph,
                              on_finalized=finalized.append)
    report["compile_seconds"] = time.perf_counter() - start
    print(f"compile {report['compile_seconds']:.2f} s for {target.kind.name}")
    if target.kind.name == "cuda" and finalized:
        launches = graph_coverage(finalized[0])
        report["kernel_launches"] = dataclasses.asdict(launches) | {
            "per_call": launches.launches}
        print(f"launch  {launches.describe()}")
    if args.output:
        _export(args, report, executable, planning)
    status = 0
    if args.run or args.check:
        interrupts.enter("running")
        status = _run(args, report, model, planning, executable, target, tune_db, live,
                      gradient_model)
    write_report(args, report)
    return status


def _load(args, report: dict):
    """The model, the target and (with --optimizer, where the model is the optimizer step) the
    training step it was made from, or None after printing why they cannot be had."""
    if args.model not in ZOO and os.path.isdir(args.model):
        print(f"error: MODEL {args.model} is a directory; give a zoo model "
              f"({', '.join(ZOO)}) or a .pt2, .onnx or .py file", file=sys.stderr)
        return None
    overrides, problem = read_overrides(args, ZOO)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return None
    try:
        model = load_model(args.model, args.size, args.training, **overrides)
        target = driver.resolve_target(args.target, args.arch or DEFAULT_ARCH)
    except ModelLoadError as err:
        print(f"error: {model_load_message(err, args.model)}", file=sys.stderr)
        return None
    except (CudaUnavailableError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    kind = "training step" if model.training else "inference"
    print(f"model   {model.name} ({kind}), {len(model.params)} parameters, "
          f"{format_size(model.param_bytes)}")
    if "import_note" in model.config:
        print(f"model   {model.config['import_note']}")
    if "returns" in model.config:
        outputs = model.config["outputs"]
        if model.training:
            said = f"the loss is computed over its first tensor, {outputs[0]}"
        else:
            first = " (the logits first)" if outputs[0] == "logits" and len(outputs) > 1 else ""
            said = f"its tensors are the outputs{first}: {', '.join(outputs)}"
        print(f"model   the program returns a {model.config['returns']}: {said}")
    gradient_model = None
    if not model.training and args.dtype != "fp32":
        try:
            model = autocast_inference(model, args.dtype)
        except InputError as err:
            print(f"error: --dtype {args.dtype}: {err}", file=sys.stderr)
            return None
        print(f"model   autocast to {model.config['compute_dtype']}: GEMMs and convolutions "
              "in it with float32 accumulation; softmax, norms, reductions and losses in "
              "float32")
    if args.optimizer:
        built = with_optimizer(args, model, lambda: load_model(
            args.model, args.size, True, loss_scale=True, **overrides))
        if built is None:
            return None
        model, gradient_model = built
    report["model_summary"] = model.summary()
    return model, target, gradient_model


def _read_graph(model, target, report: dict, budgeted: bool):
    """The fused graph (`budgeted`: as a build with a device budget fuses it) and its liveness
    peak without kernel scratch (what the allocators see of an unplanned build)."""
    graph = driver.fused_graph(model, target, budgeted=budgeted)
    gsum = graph.summary()
    report["graph"] = gsum
    live = graph.peak_memory(kinds=("parameter", "state", "input", "constant", "activation",
                                    "gradient"))
    print(f"graph   {gsum['ops']} ops ({gsum['kernels']} kernels), {gsum['gflops']:.3f} GFLOP, "
          f"liveness peak {format_size(live)} without kernel scratch "
          f"({format_size(gsum['peak_bytes'])} with)")
    return graph, live


def _export(args, report: dict, executable, planning) -> None:
    """--output: the module, and the swap plan's sidecar when there is a plan."""
    side = args.output + ".swap.json"
    files = (args.output, side) if planning is not None else (args.output,)
    with replacing(*files) as temps:
        driver.export(executable, temps[0])
        if planning is not None:
            write_swap_sidecar(temps[1], planning, report.get("swap", {}).get("emulated_link"))
    remove_stale_sidecars(args.output, keep=(".swap.json",) if planning is not None else ())
    report["output"] = args.output
    print(f"export  {args.output}")
    if planning is not None:
        print(f"export  {side} (the plan, and which arguments go to the host)")


def _run(args, report: dict, model, planning, executable, target, tune_db, live,
         gradient_model=None) -> int:
    """--run / --check on this machine's device; the exit status."""
    device = driver.device_of(target)
    if not device.exist:
        print(f"error: no {target.kind.name} device here to run on; --output exports a "
              "module for a machine that has one", file=sys.stderr)
        return 2
    arguments = model.random_arguments(args.seed)
    if planning is not None:
        return run_swapped(args, report, model, planning, executable, target, arguments,
                           tune_db, gradient_model)
    if gradient_model is not None:
        session = driver.TrainingSession(executable, model, device, seed=args.seed)
        return run_training(args, report, model, gradient_model, session, target)
    result = driver.run(executable, arguments, device, repeat=args.repeat)
    report["run"] = {
        "latency_ms_median": result.median_ms,
        "latencies_ms": result.latencies_ms,
        "measured_peak_bytes": result.peak_bytes,
        "argument_bytes": result.argument_bytes,
        "predicted_unplanned_peak_bytes": live,
    }
    print(f"run     {result.median_ms:.3f} ms (median of {args.repeat}), measured peak "
          f"{format_size(result.peak_bytes)} on {device} (arguments "
          f"{format_size(result.argument_bytes)})")
    if not args.check:
        return 0
    return check_against_reference(args, report, model, target, device, arguments,
                                   result.outputs, "the plain TVM build")


def device_count_problem(args, graph, target) -> str | None:
    """Why --devices K cannot be useful here (None if it can)."""
    k = args.devices
    # Kernel scratch buffers are flat bytes, not a dimension any split runs over.
    extent = max((int(d) for t in graph.tensors if t.kind != "workspace" for d in t.shape),
                 default=1)
    if k > extent:
        return (f"--devices {k}: no tensor of this model has a dimension longer than {extent}, "
                f"so a plan over {k} devices would mostly replicate; use --devices {extent} "
                "or fewer")
    if (args.run or args.check) and is_cpu(target) and k > MAX_CPU_WORKERS:
        return (f"--devices {k} with --run/--check runs {k} worker threads on this machine's "
                f"{os.cpu_count()} cores; at most {MAX_CPU_WORKERS} (plan or --output without "
                "--run for more)")
    return None


def _tune(args, model, target, report: dict) -> tuple[int, str | None]:
    """--tune-trials / --tune-db: tune if asked. Returns (exit status if it failed, else 0;
    the work dir to build with, None without tuning)."""
    if not args.tune_trials and not args.tune_db:
        return 0, None
    work_dir = args.tune_db or schedules.DEFAULT_WORK_DIR
    # With --devices, tune the kernels each device runs (the partitioned module's).
    popts = {"library": args.library}
    hardware = default_hardware(args, target)
    if args.partition_plan:
        try:
            popts.update(partition_plan=load_plan(args.partition_plan),
                         partition_options={"hardware": hardware})
        except (OSError, ValueError):
            pass  # reported when the plan is applied
    elif args.devices is not None and args.devices >= 1:
        popts.update(num_devices=args.devices, partition_options={
            "hardware": hardware, "strategy": args.strategy, "link": args.link})
    if args.tune_trials:
        try:
            with interrupts.phase("tuning", f"the tuning records so far are kept in "
                                            f"{work_dir}; the same command resumes",
                                  hooked=False):  # (the hook fires after a search step)
                tuning = driver.tune(model.mod, target, work_dir, args.tune_trials, **popts)
        except KeyboardInterrupt:
            print("tuning interrupted: the records so far are kept; run the same command "
                  "again to resume", file=sys.stderr)
            return 130, None
        report["tuning"] = tuning.to_json()
    elif not os.path.isdir(work_dir):
        print(f"error: no tuning work dir {work_dir}: create one with --tune-trials N",
              file=sys.stderr)
        return 2, None
    staged = pipeline.module_at_schedule_phase(model.mod, target, **popts)
    tuned, default = schedules.coverage(staged, target, work_dir)
    waiting = schedules.awaiting_comparison(staged, target, work_dir)
    report.setdefault("tuning", {}).update(kernels_tuned=tuned, kernels_default=default,
                                           kernels_awaiting_comparison=waiting)
    print(f"tuning  {len(tuned)} of {len(tuned) + len(default)} kernels scheduled from "
          f"{schedules.database_dir(work_dir, target)}"
          + (f"; {len(default)} keep the default schedules" if default else "")
          + (f" ({len(waiting)} until an interrupted tuning run compares their records with "
             "them: the same --tune-trials command finishes it)" if waiting else ""))
    return 0, work_dir
