"""`scripts/compile.py` (also installed as `tvm-ext-compile`): compile a model with the tvm_ext
pipeline, export it, run it here, check it against a plain TVM build, and report."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback

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
    p.add_argument("--size", default=None,
                   help="zoo model size (tiny, small, medium, ...; default tiny)")
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
                   help="compare outputs with a plain tvm.compile on random inputs, and for a "
                        ".pt2 model with PyTorch eager on the same inputs and weights")
    p.add_argument("--report", metavar="PATH", help="write a JSON report")
    p.add_argument("--repeat", type=int, default=5, help="timed runs for --run")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of --check (default 1e-5 against TVM; per dtype "
                        "against PyTorch, see tvm_ext.models.reference)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance of --check")
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
                      help="device memory budget: bytes with units (512MiB, 4GB), a "
                           "percentage of the no-swap peak (25%%), or min (the smallest "
                           "feasible budget)")
    swap.add_argument("--planner", default=None, choices=["swapadvisor", "vdnn", "lru"],
                      help="swap planner (default swapadvisor)")
    swap.add_argument("--hardware", default=None,
                      help="cost-model preset for planning (default: cpu for llvm, h100 for "
                           "cuda; see tvm_ext.cost.HARDWARE)")
    swap.add_argument("--swap-time-budget", type=float, default=None, metavar="SECONDS",
                      help="time budget of the SwapAdvisor search (default 10)")
    swap.add_argument("--plot", metavar="PATH",
                      help="write the plan's device-memory and stream timeline as a PNG")
    part = p.add_argument_group("partitioning over devices (PartitionOperators)")
    part.add_argument("--devices", type=int, metavar="K",
                      help="partition over K devices (Tofu plan, explicit collectives); --run "
                           "runs it on K cpu workers (Disco) and --check compares with the "
                           "single-device module; with --device-memory the budget is per device")
    part.add_argument("--strategy", default=None,
                      choices=["tofu", "data_parallel", "megatron", "exact"],
                      help="partitioning strategy (default tofu)")
    part.add_argument("--link", default=None,
                      help="link between devices for planning (nvlink, pcie, ...; default "
                           "nvlink)")
    part.add_argument("--partition-plan", metavar="PATH",
                      help="apply a saved plan (JSON, e.g. the plan of a --report or of the "
                           "sidecar of --output) instead of planning")
    return p


DEFAULTS = {"size": "tiny", "planner": "swapadvisor", "swap_time_budget": 10.0,
            "strategy": "tofu", "link": "nvlink"}
# Worker threads --run starts for --devices K on this machine: beyond this, a run only
# oversubscribes the cores.
MAX_CPU_WORKERS = 64


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def refuse_idle_options(parser: argparse.ArgumentParser, args) -> None:
    """Options that would do nothing in this combination are an error (argparse's exit 2), so
    that a mistyped command is not mistaken for a run that honoured them. Fills the defaults
    left unset to tell a given option from a default one."""
    def given(name: str) -> bool:
        return getattr(args, name) is not None

    if given("size") and _is_file_spec(args.model):
        parser.error(f"--size picks a zoo model size; {args.model} is a model file")
    if given("plot") and not args.device_memory:
        parser.error("--plot draws the swap plan: it needs --device-memory")
    if given("plot") and given("devices"):
        parser.error("--plot draws a single-device swap plan: not with --devices")
    if given("arch") and args.target != "cuda":
        parser.error(f"--arch applies to --target cuda only, not {args.target}")
    if not given("devices"):
        for name in ("strategy", "link", "partition_plan"):
            if given(name):
                parser.error(f"--{name.replace('_', '-')} applies to a partitioned build: it "
                             "needs --devices K")
    elif given("partition_plan"):
        for name in ("strategy", "link"):
            if given(name):
                parser.error(f"--{name} does nothing with --partition-plan (the saved plan is "
                             "applied as it is)")
    if not args.device_memory:
        for name in ("planner", "swap_time_budget"):
            if given(name):
                parser.error(f"--{name.replace('_', '-')} applies to swap planning: it needs "
                             "--device-memory")
        if given("hardware") and not given("devices"):
            parser.error("--hardware is the cost model of swap and partition planning: it "
                         "needs --device-memory or --devices")
    elif given("swap_time_budget") and args.planner not in (None, "swapadvisor"):
        parser.error(f"--swap-time-budget bounds the SwapAdvisor search; --planner "
                     f"{args.planner} does not search")
    if given("swap_time_budget") and args.swap_time_budget <= 0:
        parser.error("--swap-time-budget takes a number of seconds > 0")
    if args.repeat < 0:
        parser.error("--repeat takes a number of runs >= 0")
    if args.tune_trials < 0:
        parser.error("--tune-trials takes a number of trials >= 0")
    for name in ("rtol", "atol"):
        if given(name) and not args.check:
            parser.error(f"--{name} is a tolerance of --check: it needs --check")
        if given(name) and getattr(args, name) < 0:
            parser.error(f"--{name} takes a tolerance >= 0")
    if args.target == "cuda" and given("arch"):
        problem = arch_problem(args.arch)
        if problem:
            parser.error(problem)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.target == "cuda" and not (args.output or args.run or args.check):
        print("warning: --target cuda without --output or --run compiles the module and "
              "discards it", file=sys.stderr)


def _is_file_spec(spec: str) -> bool:
    """Whether MODEL names a file rather than a zoo model (as load_model decides)."""
    return spec.lower().endswith((".pt2", ".onnx", ".py")) or os.path.sep in spec


def arch_problem(arch: str) -> str | None:
    """Why `--arch` is not one nvcc compiles for (None if it is)."""
    match = re.fullmatch(r"sm_(\d+)([af]?)", arch)
    if match is None or int(match.group(1)) < 50:
        return f"--arch {arch}: expected sm_NN (a compute capability, e.g. sm_80, sm_90)"
    nvcc = shutil.which("nvcc")
    if nvcc is None or os.environ.get("TVM_CUDA_COMPILE_MODE", "nvcc") != "nvcc":
        return None
    try:
        codes = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True,
                               timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    if codes and f"sm_{match.group(1)}" not in codes:
        return (f"--arch {arch}: this nvcc does not compile for it; it takes "
                f"{', '.join(c for c in codes if c.startswith('sm_'))}")
    return None


def output_paths(args) -> list[tuple[str, str]]:
    """(option, path) of every file this command writes, sidecars included."""
    paths = []
    if args.output:
        paths.append(("--output", args.output))
        if args.devices is not None:
            paths.append(("--output", args.output + ".partition.json"))
        elif args.device_memory:
            paths.append(("--output", args.output + ".swap.json"))
    paths += [(f"--{name}", getattr(args, name)) for name in ("report", "plot")
              if getattr(args, name)]
    return paths


def output_path_problem(args) -> str | None:
    """Why an output cannot be written (None if all can): checked before compiling, so that
    minutes of compilation are not lost to a typo in a path."""
    seen: dict[str, str] = {}
    for option, path in output_paths(args):
        real = os.path.realpath(path)
        if real in seen:
            return f"{option} {path} is also the file of {seen[real]}"
        seen[real] = option
        if os.path.isdir(path):
            return f"{option} {path} is a directory; give a file name"
        if os.path.exists(path) and not os.path.isfile(path):
            return f"{option} {path} exists and is not a regular file"
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return f"{option} {path}: directory {parent} does not exist"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"{option} {path}: directory {parent} is not writable"
    return None


@contextlib.contextmanager
def replacing(*paths: str):
    """Temporary names beside `paths` to write to: on success each replaces its path at once
    (os.replace), on failure they are removed, so an existing file is never lost or left half
    written."""
    temps = []
    for path in paths:
        head, tail = os.path.split(os.path.abspath(path))
        # Keep the suffix: export_library and savefig pick the format from it.
        temps.append(os.path.join(head, f".{tail}.{os.getpid()}.tmp{os.path.splitext(tail)[1]}"))
    try:
        yield temps
        for temp, path in zip(temps, paths, strict=True):
            os.replace(temp, path)
    finally:
        for temp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)


def remove_stale_sidecars(output: str, keep: tuple[str, ...]) -> None:
    """Sidecars of an earlier export to the same path that this module does not have: left
    there, they would describe another module."""
    for suffix in (".swap.json", ".partition.json"):
        path = output + suffix
        if suffix not in keep and os.path.isfile(path):
            os.remove(path)
            print(f"export  removed {path} (it described an earlier export)")


def read_overrides(args, zoo: dict) -> tuple[dict, str | None]:
    """`--set` as {field: value}, checked against the zoo size it overrides; an error message
    instead where a value does not fit."""
    overrides = {}
    for item in args.set:
        field, sep, text = item.partition("=")
        if not sep or not field.strip():
            return {}, f"--set takes FIELD=VALUE, got {item!r}"
        overrides[field.strip()] = text.strip()
    if not overrides:
        return {}, None
    if args.model not in zoo:
        if args.model.lower().endswith(".py"):
            return {k: _parse_value(v) for k, v in overrides.items()}, None
        return {}, (f"--set applies to zoo models and to .py files (fields of their "
                    f"get_model); {args.model} takes none")
    sizes = zoo[args.model].SIZES
    defaults = sizes.get(args.size, {})
    out = {}
    for field, text in overrides.items():
        default = defaults.get(field)
        if default is None:  # unknown size or field: load_model names the known ones
            out[field] = _parse_value(text)
            continue
        if isinstance(default, int):
            value = _positive_int(text)
            if value is None:
                return {}, f"--set {field}={text}: {field} takes an integer >= 1"
            out[field] = value
        elif isinstance(default, (tuple, list)):
            values = [_positive_int(t) for t in text.split(",")]
            if not text or None in values:
                example = ",".join(str(v) for v in default)
                return {}, (f"--set {field}={text}: {field} takes integers >= 1 separated by "
                            f"commas, e.g. {field}={example}")
            out[field] = tuple(values)
        else:
            out[field] = _parse_value(text)
    return out, None


def _positive_int(text: str) -> int | None:
    text = text.strip()
    if not re.fullmatch(r"\+?\d+", text):
        return None
    value = int(text)
    return value if value >= 1 else None


def model_load_message(err: Exception, spec: str) -> str:
    """A load error; for a .py file whose code raised, the line of the user's file it came
    from and the exception."""
    cause = err.__cause__
    if cause is None or not spec.lower().endswith(".py"):
        return str(err)
    if isinstance(cause, SyntaxError) and cause.filename:
        return (f"{spec}: {cause.filename}:{cause.lineno}: SyntaxError: {cause.msg}")
    user = os.path.realpath(spec)
    frames = [f for f in traceback.extract_tb(cause.__traceback__)
              if os.path.realpath(f.filename) == user]
    if not frames:
        return str(err)
    last = frames[-1]
    code = f" ({last.line.strip()})" if last.line else ""
    return (f"{spec} raised {type(cause).__name__}: {cause} at {last.filename}:{last.lineno} "
            f"in {last.name}{code}")


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
    if (args.run or args.check) and target.kind.name in ("llvm", "c") and k > MAX_CPU_WORKERS:
        return (f"--devices {k} with --run/--check runs {k} worker threads on this machine's "
                f"{os.cpu_count()} cores; at most {MAX_CPU_WORKERS} (plan or --output without "
                "--run for more)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_idle_options(parser, args)
    problem = output_path_problem(args)
    if problem is None and args.tune_db and os.path.exists(args.tune_db) \
            and not os.path.isdir(args.tune_db):
        problem = f"--tune-db {args.tune_db} is a file; it takes a directory (MetaSchedule's " \
                  "work dir)"
    if problem is None and args.dump_dir and os.path.exists(args.dump_dir) \
            and not os.path.isdir(args.dump_dir):
        problem = f"--dump-dir {args.dump_dir} is a file; it takes a directory"
    if problem is None and args.devices is not None and args.devices < 1:
        problem = f"--devices takes a number of devices >= 1, got {args.devices}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # Heavy imports after argument parsing, so --help is instant.
    import tvm_ext  # noqa: F401  (loads the runtime library, registers the pipeline)
    from tvm_ext import compiler
    from tvm_ext.cuda_support import DEFAULT_ARCH, CudaUnavailableError
    from tvm_ext.models import ZOO, ModelLoadError, load_model

    report: dict = {"model": args.model, "target": args.target, "host": platform.node()}
    if args.model not in ZOO:
        if os.path.isdir(args.model):
            print(f"error: MODEL {args.model} is a directory; give a zoo model "
                  f"({', '.join(ZOO)}) or a .pt2, .onnx or .py file", file=sys.stderr)
            return 2
    overrides, problem = read_overrides(args, ZOO)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        model = load_model(args.model, args.size, args.training, **overrides)
        target = compiler.resolve_target(args.target, args.arch or DEFAULT_ARCH)
    except ModelLoadError as err:
        print(f"error: {model_load_message(err, args.model)}", file=sys.stderr)
        return 2
    except (CudaUnavailableError, ValueError) as err:
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
    if args.devices is not None:
        problem = device_count_problem(args, graph, target)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2

    failed, tune_db = _tune(args, model, target, report)
    if failed:
        return failed
    if args.devices is not None:
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
        side = args.output + ".swap.json"
        files = (args.output, side) if plan is not None else (args.output,)
        with replacing(*files) as temps:
            compiler.export(executable, temps[0])
            if plan is not None:
                _write_swap_sidecar(temps[1], graph, plan, target)
        remove_stale_sidecars(args.output, keep=(".swap.json",) if plan is not None else ())
        report["output"] = args.output
        print(f"export  {args.output}")
        if plan is not None:
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
    same `arguments`, and against PyTorch eager for a .pt2 model; the verdict goes into
    `report["check"]`. Returns the exit status."""
    from tvm_ext import compiler
    from tvm_ext.models.reference import tolerance

    # Two TVM builds may round a float16 / bfloat16 result differently by one step.
    low = [tolerance(o.dtype) for o in outputs if str(o.dtype) in ("float16", "bfloat16")]
    rtol = max([1e-5, *(t[0] for t in low)]) if args.rtol is None else args.rtol
    atol = max([1e-5, *(t[1] for t in low)]) if args.atol is None else args.atol
    reference = compiler.build_reference(model, target)
    ref = compiler.run(reference, arguments, device, repeat=0)
    try:
        check = compiler.compare(outputs, ref.outputs, rtol, atol)
    except compiler.CheckError as err:
        report["check"] = {"ok": False, "reference": what, "rtol": rtol, "atol": atol,
                           "error": str(err)}
        print(f"check   FAILED against {what} (rtol {rtol:g}, atol {atol:g}): {err}",
              file=sys.stderr)
        status = 1
    else:
        report["check"] = {"ok": True, "reference": what, "rtol": rtol, "atol": atol,
                           **vars(check)}
        print(f"check   OK: {check.outputs} outputs match {what} (max abs error "
              f"{check.max_abs_error:.2e}, max rel error {check.max_rel_error:.2e}; rtol "
              f"{rtol:g}, atol {atol:g})")
        status = 0
    return max(status, check_against_torch(args, report, model, arguments, outputs))


def torch_file(model, spec: str) -> str | None:
    """The .pt2 file `model` was loaded from: PyTorch eager is then a second reference."""
    path = model.config.get("file") or spec
    return path if str(path).lower().endswith(".pt2") and os.path.isfile(path) else None


def check_against_torch(args, report: dict, model, arguments, outputs) -> int:
    """--check of a .pt2 model: `outputs` against the exported program run by PyTorch eager on
    the same inputs and weights, at the tolerance of each output's dtype (or --rtol/--atol).
    Returns the exit status; 0 where there is nothing to compare with."""
    path = torch_file(model, args.model)
    if path is None:
        return 0
    from tvm_ext import compiler
    from tvm_ext.models import reference

    name = os.path.basename(path)
    what = f"PyTorch eager ({name})"
    entry = report.setdefault("check", {}).setdefault("torch", {"reference": what})
    n = model.num_input
    names = [p.name for p in model.params]
    inputs, params = arguments[:n], arguments[n:]
    try:
        skipped = None
        if reference.random_ops(path):
            skipped = (f"PyTorch draws random numbers in {', '.join(reference.random_ops(path))}"
                       ", the compiled module does not")
        elif model.training and "training_semantics" not in model.config \
                and reference.has_batch_norm(path):
            skipped = ("the training step normalizes with batch statistics whatever mode the "
                       "program was exported in")
        if skipped:
            entry.update(ok=None, skipped=skipped)
            print(f"check   not compared with {what}: {skipped}")
            return 0
        if model.training:
            expected = reference.torch_training_step(
                path, inputs[:-1], inputs[-1], params, names, model.config["gradients"],
                model.config.get("loss", "mse"))
        else:
            expected = reference.torch_reference(path, inputs, params, names)
        stale = reference.file_weight_mismatches(path, params, names) \
            if model.weights is not None else []
    except Exception as err:  # any failure of torch itself is a failed check, with its reason
        entry.update(ok=False, error=f"{type(err).__name__}: {err}")
        report["check"]["ok"] = False
        print(f"check   FAILED: {what} did not run: {type(err).__name__}: {err}",
              file=sys.stderr)
        return 1
    tolerances = {}
    try:
        if stale:
            raise compiler.CheckError(
                f"the weights given to the module differ from {name}'s for "
                f"{', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}")
        if len(outputs) != len(expected):
            raise compiler.CheckError(f"{len(outputs)} outputs, {what} has {len(expected)}")
        max_abs = max_rel = 0.0
        for i, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
            rtol, atol = reference.tolerance(out.dtype)
            rtol = rtol if args.rtol is None else args.rtol
            atol = atol if args.atol is None else args.atol
            tolerances[str(out.dtype)] = (rtol, atol)
            try:
                one = compiler.compare([out], [exp], rtol, atol)
            except compiler.CheckError as err:
                raise compiler.CheckError(f"output {i}{str(err).removeprefix('output 0')}") \
                    from None
            max_abs, max_rel = max(max_abs, one.max_abs_error), max(max_rel, one.max_rel_error)
    except compiler.CheckError as err:
        entry.update(ok=False, error=str(err), tolerances=tolerances)
        report["check"]["ok"] = False
        print(f"check   FAILED against {what} ({_fmt_tolerances(tolerances)}): {err}",
              file=sys.stderr)
        return 1
    entry.update(ok=True, outputs=len(outputs), max_abs_error=max_abs, max_rel_error=max_rel,
                 tolerances=tolerances)
    print(f"check   OK: {len(outputs)} outputs match {what} (max abs error {max_abs:.2e}, "
          f"max rel error {max_rel:.2e}; {_fmt_tolerances(tolerances)})")
    return 0


def _fmt_tolerances(tolerances: dict) -> str:
    return "; ".join(f"{dtype} rtol {r:g}, atol {a:g}" for dtype, (r, a) in tolerances.items()) \
        or "no outputs"


def write_report(args, report: dict) -> None:
    if args.report:
        with replacing(args.report) as (temp,), open(temp, "w") as f:
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
    from tvm_ext import schedules

    work_dir = args.tune_db or schedules.DEFAULT_WORK_DIR
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
        with replacing(args.plot) as (temp,):
            plot_plan(problem, plan, temp)
        info["plot"] = args.plot
        print(f"plot    {args.plot}")
    return plan, info


def _write_swap_sidecar(path: str, graph, plan, target) -> None:
    from tvm_ext.passes.swap_offload import argument_devices

    with open(path, "w") as f:
        json.dump({"plan": plan.to_dict(), "argument_devices": argument_devices(graph, plan),
                   "devices": ["device", "host"], "target": str(target.kind.name)}, f)


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
        report["check"] = {"ok": status == 0, "reference": "the unswapped TVM build",
                           "exact": True, "rtol": 0, "atol": 0,
                           "within_budget": measured <= budget}
        if status == 0:
            print(f"check   OK: {len(swapped.outputs)} outputs equal the unswapped build exactly "
                  "(rtol 0, atol 0), and the measured peak fits the budget")
        status = max(status, check_against_torch(args, report, model, arguments,
                                                 swapped.outputs))
    return status


def _json_default(obj):
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    return str(obj)


if __name__ == "__main__":
    sys.exit(main())
