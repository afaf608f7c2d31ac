"""scripts/gpu_bundle.py: build a GPU bundle here, and bring what it measured there back.

    python scripts/gpu_bundle.py OUT_DIR [--quick] [--arch sm_90] [--tune-trials N]
                                 [--tune-db DIR] [--swap-time-budget S] [--python X.Y ...]
                                 [--no-nccl]
    python scripts/gpu_bundle.py OUT_DIR --finish RESULTS.json
    python scripts/gpu_bundle.py OUT_DIR --import-tuning RESULTS.json [--tune-db DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

# What only a build reads: refused with --finish / --import-tuning.
_BUILD_OPTIONS = ("quick", "arch", "tune_trials", "swap_time_budget", "python", "no_nccl")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu_bundle.py",
        description="Compile here everything the GPU checks need and pack it with TVM's "
                    "runtime (no compiler) into OUT_DIR, to run there with "
                    "`python3 OUT_DIR/run_gpu_checks.py`.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the bundle's folder")
    parser.add_argument("--quick", action="store_true",
                        help="the GPU suite at tiny sizes (a first look; the tests use it)")
    parser.add_argument("--arch", default=None, help="CUDA architecture (default sm_90)")
    parser.add_argument("--tune-trials", type=int, default=None,
                        help="candidates of the offline tuning batch (default 64; 0: none)")
    parser.add_argument("--tune-db", default=None,
                        help="tuning work dir: build-only records, and where --import-tuning "
                             "puts the measured ones (default tvm_ext_tune_db)")
    parser.add_argument("--swap-time-budget", type=float, default=None, metavar="S",
                        help="seconds of swap planning per budget of the GPU suite (default 20)")
    parser.add_argument("--python", action="append", default=None, metavar="X.Y",
                        help="a Python version the bundle runs with (repeatable; default: "
                             "this one and 3.12)")
    parser.add_argument("--no-nccl", action="store_true",
                        help="leave the NCCL backend out (its Disco check is then skipped)")
    parser.add_argument("--finish", metavar="RESULTS", default=None,
                        help="simulate the swapped runs of RESULTS with this simulator (a GPU "
                             "run without numba, or a newer simulator)")
    parser.add_argument("--import-tuning", metavar="RESULTS", default=None,
                        help="bring the tuning batch's timings in RESULTS into --tune-db")
    return parser


def option_problem(args) -> str | None:
    """Why the options cannot be used together (None if they can)."""
    after = args.finish or args.import_tuning
    if args.finish and args.import_tuning:
        return "--finish and --import-tuning are two steps: give one at a time"
    if after:
        given = [f"--{o.replace('_', '-')}" for o in _BUILD_OPTIONS
                 if getattr(args, o) not in (None, False)]
        if given:
            return f"{', '.join(given)} only shape a build; not with --finish/--import-tuning"
    if args.swap_time_budget is not None and not args.swap_time_budget > 0:
        return f"--swap-time-budget takes seconds > 0, got {args.swap_time_budget}"
    if args.tune_trials is not None and args.tune_trials < 0:
        return f"--tune-trials takes a number >= 0, got {args.tune_trials}"
    for version in args.python or []:
        if not re.fullmatch(r"3\.\d+", version):
            return f"--python takes a version like 3.12, got {version!r}"
    if args.arch is not None and not re.fullmatch(r"sm_\d+[a-z]?", args.arch):
        return f"--arch takes a CUDA architecture like sm_90, got {args.arch!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = option_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # TVM loads only once the arguments are valid: --help and argument errors stay instant.
    from tvm_ext.driver import gpu_bundle
    from tvm_ext.errors import InputError, UnavailableError

    try:
        if args.finish:
            added = gpu_bundle.finish_results(args.out_dir, args.finish)
            print(f"finish  {added} swapped runs simulated in {args.finish}")
            return 0
        if args.import_tuning:
            done = gpu_bundle.import_tuning(args.out_dir, args.import_tuning,
                                            args.tune_db or gpu_bundle.DEFAULT_WORK_DIR)
            print(f"tuning  {_imported(done)}")
            return 0
        return _build(args, gpu_bundle)
    except (InputError, UnavailableError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _imported(done) -> str:
    if done.already_imported:
        return f"this batch was imported into {done.database} before: nothing to do"
    return (f"{done.imported} measured candidates imported into {done.database}"
            + (f" ({done.untimed} carried no time)" if done.untimed else "")
            + "; compile with --tune-db to build with the fastest")


def _build(args, gpu_bundle) -> int:
    cuda = gpu_bundle.QUICK if args.quick else gpu_bundle.GPU_SUITE
    if args.tune_trials is not None:
        cuda = dataclasses.replace(cuda, tune_trials=args.tune_trials)
    if args.swap_time_budget is not None:
        cuda = dataclasses.replace(cuda, swap_time_budget=args.swap_time_budget)
    config = gpu_bundle.BundleConfig(
        cuda=cuda, arch=args.arch or gpu_bundle.DEFAULT_ARCH,
        python_versions=tuple(args.python or ()), nccl=not args.no_nccl,
        tune_db=args.tune_db or gpu_bundle.DEFAULT_WORK_DIR)
    report = gpu_bundle.build_bundle(args.out_dir, config)
    checks = gpu_bundle.planned_checks(report.directory)
    nccl = "NCCL backend " + ("included" if report.nccl["built"] else "left out: ") + (
        "" if report.nccl["built"] else report.nccl["reason"])
    print(f"bundle  {report.directory}: {report.files} files, "
          f"{report.size_bytes / 2**20:.1f} MiB (limit {gpu_bundle.SIZE_LIMIT / 2**20:.0f} "
          f"MiB); Python {', '.join(report.python_versions)}; {nccl}")
    print(f"checks  {len(checks)}: {', '.join(checks)}")
    print(f"run     python3 {report.directory}/run_gpu_checks.py --out gpu_results.json")
    return 0
