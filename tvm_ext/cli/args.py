"""scripts/compile.py's arguments: the parser and every check that needs no model loaded."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback


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


def values_that_look_negative(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with a value that starts with "-" joined to its option (`--device-memory -5%` as
    `--device-memory=-5%`): argparse would take it for an option and say only "expected one
    argument", where the option's own check says what is wrong with the value."""
    takes_value = {s for a in parser._actions if a.option_strings and a.nargs is None
                   and a.const is None for s in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if arg in takes_value and value[:1] == "-" and value[1:2] in set("0123456789."):
            out.append(f"{arg}={value}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


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
    p.add_argument("--verbose", "-v", action="store_true",
                   help="show TVM's own log (its C++ warnings), kept out of the output otherwise")
    p.add_argument("--repeat", type=int, default=5, help="timed runs for --run")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of --check (default 1e-5 against TVM; per dtype "
                        "against PyTorch, see tvm_ext.models.reference)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance of --check")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="compute in bfloat16 or float16 (default fp32). Inference: torch."
                        "autocast's policy (GEMMs and convolutions in the dtype with float32 "
                        "accumulation; softmax, norms, reductions and losses in float32; "
                        "parameters stay float32); --check compares with PyTorch under "
                        "autocast. With --training --optimizer: mixed precision training "
                        "(GEMMs and convolutions in the dtype; master weights and optimizer "
                        "state float32; fp16 with dynamic loss scaling)")
    p.add_argument("--no-library", dest="library", action="store_false",
                   help="generate every kernel with TVM, GEMMs and convolutions included "
                        "(default: they call OpenBLAS on CPU, cuBLAS on CUDA)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_const", const=False,
                   default=None,
                   help="launch every kernel on its own (default on CUDA: each run of kernels "
                        "reading only weights and intermediates is captured once into a CUDA "
                        "graph and replayed as one launch; not in swapped or partitioned "
                        "builds)")
    p.add_argument("--dump-dir", help="write the module after each pipeline phase there")
    p.add_argument("--tune-trials", type=int, default=0, metavar="N",
                   help="tune the kernels with MetaSchedule (XGBoost cost model), N trials in "
                        "all, into --tune-db, then build with the records; trials already in "
                        "the database count, so a second call tunes nothing")
    p.add_argument("--tune-db", metavar="DIR",
                   help="tuning work dir to build with (and tune into with --tune-trials; "
                        "default there: ./tvm_ext_tune_db)")
    _add_training_options(p)
    _add_swap_options(p)
    part = p.add_argument_group("partitioning over devices (PartitionOperators)")
    part.add_argument("--devices", type=int, metavar="K",
                      help="partition over K devices (Tofu plan, explicit collectives); --run "
                           "runs it on K cpu workers (Disco) and --check compares with the "
                           "single-device module; with --device-memory the budget is per device")
    part.add_argument("--strategy", default=None,
                      choices=["tofu", "data_parallel", "megatron", "exact", "zero1", "zero2",
                               "zero3"],
                      help="partitioning strategy (default tofu)")
    part.add_argument("--link", default=None,
                      help="link between devices for planning (nvlink, pcie, ...; default "
                           "nvlink)")
    part.add_argument("--partition-plan", metavar="PATH",
                      help="apply a saved plan (JSON, e.g. the plan of a --report or of the "
                           "sidecar of --output) instead of planning")
    return p


def _add_swap_options(p: argparse.ArgumentParser) -> None:
    swap = p.add_argument_group("swapping (SwapOffload)")
    swap.add_argument("--device-memory", metavar="SIZE",
                      help="device memory budget: bytes with units (512MiB, 4GB), a "
                           "percentage of the no-swap peak (25%%), or min (the smallest "
                           "feasible budget)")
    swap.add_argument("--planner", default=None,
                      choices=["swapadvisor", "swap_only", "checkpoint", "vdnn", "lru"],
                      help="swap planner (default swapadvisor: swaps and recompute; "
                           "swap_only: swaps alone; checkpoint: sqrt(n) recompute)")
    swap.add_argument("--hardware", default=None,
                      help="cost-model preset for planning (default: cpu for llvm, h100 for "
                           "cuda; see tvm_ext.cost.HARDWARE)")
    swap.add_argument("--swap-time-budget", type=float, default=None, metavar="SECONDS",
                      help="wall-clock budget of the whole SwapAdvisor search, both of "
                           "its phases (default 10)")
    swap.add_argument("--plot", metavar="PATH",
                      help="write the plan's device-memory and stream timeline as a PNG")
    swap.add_argument("--link-gbps", metavar="GBPS|scaled",
                      help="on the CPU stand-in, emulate a host link of GBPS GB/s per direction "
                           "(each copy between device and host paced to latency + bytes / "
                           "bandwidth of wall time), or 'scaled': the --hardware preset's link "
                           "(default h100) slowed as much as this CPU is slower than the preset "
                           "on this model; kernels are measured and the plan made for the link")
    swap.add_argument("--link-latency-us", type=float, metavar="US",
                      help="per-copy latency of --link-gbps GBPS (default 0)")


def _add_training_options(p: argparse.ArgumentParser) -> None:
    train = p.add_argument_group("training with an optimizer (with --training)")
    train.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "adamw"],
                       help="compile one whole training iteration: forward, loss, backward and "
                            "this optimizer's update of the parameters and its state, in place "
                            "(torch.optim's semantics)")
    train.add_argument("--lr", type=float, help="learning rate (default: torch's; 0.01 for "
                                                "sgd and momentum)")
    train.add_argument("--momentum", type=float, help="momentum of --optimizer momentum "
                                                      "(default 0.9)")
    train.add_argument("--weight-decay", type=float,
                       help="weight decay (default 0; 0.01 for adamw, decoupled)")
    train.add_argument("--betas", metavar="B1,B2", help="Adam's betas (default 0.9,0.999)")
    train.add_argument("--eps", type=float, help="Adam's eps (default 1e-8)")
    train.add_argument("--steps", type=int, metavar="N",
                       help="with --run/--check: run N steps on a fixed synthetic batch and "
                            "print each step's loss, time and peak (default 5); --check "
                            "compares them with N steps of torch.optim")


DEFAULTS = {"size": "tiny", "planner": "swapadvisor", "swap_time_budget": 10.0,
            "strategy": "tofu", "link": "nvlink"}


MAX_CPU_WORKERS = 64


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
    if given("cuda_graph"):
        if args.target != "cuda":
            parser.error(f"--no-cuda-graph applies to --target cuda only, not {args.target}")
        if args.device_memory or given("devices"):
            parser.error("--no-cuda-graph does nothing with --device-memory or --devices: "
                         "swapped and partitioned builds launch every kernel on its own")
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
    _refuse_idle_link_options(parser, args)
    if given("swap_time_budget") and args.swap_time_budget <= 0:
        parser.error("--swap-time-budget takes a number of seconds > 0")
    _refuse_idle_training_options(parser, args, given)
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


def link_gbps(args) -> float | None:
    """--link-gbps as a number (None: not given or 'scaled')."""
    try:
        return float(args.link_gbps)
    except (TypeError, ValueError):
        return None


def _refuse_idle_link_options(parser: argparse.ArgumentParser, args) -> None:
    """--link-gbps / --link-latency-us: the emulated link of the CPU stand-in's swap copies."""
    if args.link_latency_us is not None and link_gbps(args) is None:
        parser.error("--link-latency-us is the latency of --link-gbps GBPS: it needs a number "
                     "of GB/s (the 'scaled' link takes the preset's latency)")
    if args.link_gbps is None:
        return
    if args.link_gbps != "scaled" and not (link_gbps(args) or 0) > 0:
        parser.error(f"--link-gbps takes a number of GB/s > 0 or 'scaled', got "
                     f"{args.link_gbps!r}")
    if args.link_latency_us is not None and args.link_latency_us < 0:
        parser.error("--link-latency-us takes a number of microseconds >= 0")
    if not args.device_memory:
        parser.error("--link-gbps emulates the link of swap copies: it needs --device-memory")
    if args.devices is not None:
        parser.error("--link-gbps emulates the host link of a single-device swapped run: not "
                     "with --devices")
    if args.target != "llvm":
        parser.error(f"--link-gbps paces the CPU stand-in's copies (--target llvm); a "
                     f"{args.target} device has a real link")
    if args.hardware is not None and args.link_gbps != "scaled":
        parser.error("--hardware does nothing with --link-gbps GBPS (the plan is made for this "
                     "CPU with that link); with --link-gbps scaled it names the preset to scale")


_OPTIMIZER_OPTIONS = {"lr": None, "weight_decay": None, "momentum": ("momentum",),
                      "betas": ("adam", "adamw"), "eps": ("adam", "adamw"), "steps": None}


def _refuse_idle_training_options(parser: argparse.ArgumentParser, args, given) -> None:
    """--optimizer and its options, where they would do nothing."""
    if given("optimizer") and not args.training:
        parser.error("--optimizer adds the update to the training step: it needs --training")
    if given("dtype") and args.training and not given("optimizer"):
        parser.error("--dtype of a training step computes it in mixed precision for an "
                     "optimizer step: it needs --optimizer (or drop --training for inference "
                     "in the dtype)")
    for name, kinds in _OPTIMIZER_OPTIONS.items():
        flag = f"--{name.replace('_', '-')}"
        if given(name) and not given("optimizer"):
            parser.error(f"{flag} applies to an optimizer step: it needs --optimizer")
        if given(name) and kinds and args.optimizer not in kinds:
            parser.error(f"{flag} does nothing with --optimizer {args.optimizer} (it applies to "
                         f"{' and '.join(kinds)})")
    if given("steps") and not (args.run or args.check):
        parser.error("--steps runs the optimizer step N times: it needs --run or --check")
    if given("steps") and args.steps < 1:
        parser.error("--steps takes a number of steps >= 1")
    if given("betas"):
        betas = [_parse_value(b) for b in args.betas.split(",")]
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1
                                      for b in betas):
            parser.error(f"--betas {args.betas}: takes two numbers in [0, 1), e.g. 0.9,0.999")
        args.betas = tuple(float(b) for b in betas)
    for name in ("lr", "weight_decay", "momentum", "eps"):
        if given(name) and not getattr(args, name) >= 0:
            parser.error(f"--{name.replace('_', '-')} takes a number >= 0")
    if args.steps is None:
        args.steps = 5
    if args.dtype is None:
        args.dtype = "fp32"


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
        problem = _cannot_create_in(parent)
        if problem:
            return f"{option} {path}: cannot create a file in {parent} ({problem})"
    return None


def directory_problem(option: str, path: str, what: str) -> str | None:
    """Why `path` cannot serve as the directory `option` writes into (None if it can): it is a
    file, or no file can be made in it or, where it does not exist yet, in the nearest
    directory above it that does."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{option} {path} is a file; it takes a directory ({what})"
    existing = os.path.abspath(path)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    problem = _cannot_create_in(existing)
    return f"{option} {path}: cannot create files in {existing} ({problem})" if problem else None


def _cannot_create_in(directory: str) -> str | None:
    """Why no file can be made in `directory`, found by making one: `os.access` says yes to
    root for a read-only mount and for /proc, where the write after compiling would fail."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".tvm_ext_probe.", dir=directory)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.remove(probe)
    return None


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
