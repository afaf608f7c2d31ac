"""The checks a GPU bundle runs (`python3 BUNDLE/run_gpu_checks.py`), with TVM's runtime alone.

Two suites, the same code: "cuda" runs what was compiled for the GPU on `cuda:0` (skipped,
with the reason, where there is no CUDA device), "llvm" is the CPU self-check, the same checks on
the CPU stand-in (cpu:0 the device, cpu:1 the host) on small modules built for any x86-64. Per
suite, in order: the copy streams' bandwidth, the zoo modules against the CPU build's outputs,
swapped builds at each budget against the unswapped one, a partitioned module on a Disco
session (NCCL on the GPU), the zoo's largest GEMMs against `torch.matmul`, and the timing of an
offline tuning batch. Each check ends as pass, fail or skipped with its reason and figures, in
one JSON; a check that raises fails alone, and the time budget skips what it cannot reach.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import traceback
from collections.abc import Callable

import numpy as np
import tvm

from ..candidate_batch import measure_batch
from ..cuda import CudaUnavailableError, ensure_cuda_runtime
from .bundle import ARTIFACTS, SUITES, Bundle
from .conv import check_conv
from .copies import check_copies
from .disco import check_partitioned
from .gemm import check_gemm
from .report import Failed, Report, Skip, write_json
from .suite import SuiteRun
from .swapped import check_budget, run_unswapped, time_kernels
from .zoo import check_module

DEFAULT_TIME_BUDGET_S = 540.0  # checks not reached within it are skipped (--time-budget)
Step = tuple[str, Callable[..., dict | None], tuple]


def plan_suite(suite: SuiteRun, tuning: dict) -> list[Step]:
    """The checks of a suite, in the order they run (later ones use earlier figures)."""
    spec, p = suite.spec, suite.name + "/"
    steps: list[Step] = []
    if spec.get("copies"):
        steps.append((p + "copies", check_copies, (suite, spec["copies"])))
    steps += [(p + f"zoo/{e['name']}", check_module, (suite, e)) for e in spec.get("zoo", [])]
    swap = spec.get("swap")
    if swap:
        steps += [(p + "swap/unswapped", run_unswapped, (suite, swap)),
                  (p + "swap/kernels", time_kernels, (suite, swap))]
        steps += [(p + f"swap/{b['label']}", check_budget, (suite, swap, b))
                  for b in swap["budgets"]]
    steps += [(p + f"disco/{e['name']}", check_partitioned, (suite, e))
              for e in spec.get("partition", [])]
    steps += [(p + f"gemm/{e['name']}", check_gemm, (suite, e)) for e in spec.get("gemm", [])]
    steps += [(p + f"conv/{e['name']}", check_conv, (suite, e)) for e in spec.get("conv", [])]
    if spec.get("tuning"):
        steps.append((p + "tuning", measure_tuning, (suite, spec["tuning"], tuning)))
    return steps


def measure_tuning(suite: SuiteRun, spec: dict, tuning: dict, time_budget_s: float = 240
                   ) -> dict:
    """Time the offline tuning batch (`tvm_ext.runtime.candidate_batch`)."""
    measurements = measure_batch(suite.bundle.path(spec["batch"]), suite.device,
                                 time_budget_s=time_budget_s)
    tuning[suite.name] = measurements
    rows = measurements["candidates"]
    timed = [r for r in rows if r["seconds"]]
    data = {"batch": measurements["batch"], "candidates": len(rows), "timed": len(timed),
            "errors": [r["error"] for r in rows if not r["seconds"]][:5]}
    if rows and not timed:
        raise Failed("no candidate of the tuning batch ran", data)
    return data


def check_integrity(bundle: Bundle) -> dict:
    found = bundle.verify()
    if found["missing"] or found["changed"]:
        raise Failed(f"{len(found['missing'])} artefacts missing, {len(found['changed'])} "
                     "changed since the bundle was built", found)
    return {"files": len(bundle.manifest.get("files", {}))}


def check_runtime_only(bundle: Bundle) -> dict:
    """The bundle runs on its own TVM, without the compiler."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = (os.path.dirname(tvm.__file__), here)
    # Where each was found, relative to the bundle (not a path of the machine it runs on).
    data = {"tvm": os.path.relpath(found[0], bundle.root),
            "tvm_ext": os.path.relpath(found[1], bundle.root),
            "runtime_only": bool(tvm._RUNTIME_ONLY)}
    if not all(p.startswith(bundle.root + os.sep) for p in found):
        raise Failed("the checks run on a TVM or tvm_ext outside the bundle", data)
    if not data["runtime_only"]:
        raise Failed("TVM's compiler library was loaded: the bundle must not carry it", data)
    return data


def cuda_device() -> tuple[bool, str]:
    """(whether a CUDA device runs code here, why not)."""
    try:
        state = ensure_cuda_runtime()
    except CudaUnavailableError as err:
        return False, f"no CUDA device (TVM's CUDA runtime does not load: {err})"
    if not tvm.cuda(0).exist:
        return False, "no CUDA device" + (" (no driver here)" if state == "stub" else "")
    return True, ""


def check_cuda_modules_load(bundle: Bundle) -> dict:
    """Without a GPU: every CUDA module loads (through the no-device driver stub) and holds
    device code for TVM's CUDA runtime (a GEMM compiled to call cuBLAS alone holds none, nor
    may a convolution calling cuDNN)."""
    try:
        ensure_cuda_runtime()
    except CudaUnavailableError as err:
        raise Skip(f"TVM's CUDA runtime does not load here: {err}") from None
    prefix = f"{ARTIFACTS}/cuda/"
    paths = [p for p in bundle.manifest.get("files", {}) if p.startswith(prefix)
             and p.endswith(".so")]
    host_only = {e["library"] for kind in ("gemm", "conv")
                 for e in bundle.suite("cuda").get(kind, []) if e.get("library")}
    for path in paths:
        module = tvm.runtime.load_module(bundle.path(path))
        kinds, stack = set(), [module]
        while stack:
            mod = stack.pop()
            kinds.add(mod.kind)
            stack.extend(mod.imports)
        if "cuda" not in kinds and path not in host_only:
            raise Failed(f"{path} holds no CUDA device code (modules: {sorted(kinds)})")
    return {"modules": len(paths)}


def describe_machine(gpu: bool) -> dict:
    info = {"host": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count(), "tvm": tvm.__version__}
    try:
        info["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        info["torch"] = None
    if gpu:
        dev = tvm.cuda(0)
        info["gpu"] = {"name": dev.device_name, "compute_version": dev.compute_version,
                       "memory_bytes": dev.total_global_memory,
                       "multiprocessors": dev.multi_processor_count}
    return info


def run_checks(bundle_dir: str, *, suites: tuple[str, ...] = SUITES,
               time_budget_s: float = DEFAULT_TIME_BUDGET_S, only: tuple[str, ...] = (),
               log: Callable[[str], None] = print) -> dict:
    """Run the bundle's checks; the results (as written to the JSON)."""
    bundle = Bundle(bundle_dir)
    report = Report(time_budget_s, log)
    report.run("bundle/integrity", check_integrity, bundle)
    report.run("bundle/runtime-only", check_runtime_only, bundle)
    gpu, why = cuda_device()
    tuning: dict = {}
    for name in suites:
        if bundle.suite(name) is None:
            report.skip(f"{name}/*", f"the bundle has no {name} suite")
            continue
        suite = SuiteRun.create(bundle, name)
        steps = [s for s in plan_suite(suite, tuning) if not only or any(o in s[0] for o in only)]
        if name == "cuda" and not gpu:
            report.run("cuda/load", check_cuda_modules_load, bundle)
            for step_name, _, _ in steps:
                report.skip(step_name, why)
            continue
        for step_name, func, args in steps:
            if func is measure_tuning:  # whatever time is left, within its own bound
                left = max(0.0, time_budget_s - report.elapsed())
                args = (*args, min(left, 240.0))
            report.run(step_name, func, *args)
    return {"bundle": _bundle_summary(bundle), "machine": describe_machine(gpu),
            **report.to_json(), "tuning_measurements": tuning}


def _bundle_summary(bundle: Bundle) -> dict:
    keys = ("created", "built_on", "tvm_ext_version", "tvm_version", "arch", "config")
    # The folder as given to the checks (relative to where they ran), not the machine's path.
    return {"root": os.path.relpath(bundle.root), **{k: bundle.manifest.get(k) for k in keys}}


def main(argv: list[str] | None = None, bundle_dir: str | None = None) -> int:
    """The entry script's command line; exit status 0 (no check failed), 1 (one did), 2 (the
    checks could not start)."""
    parser = argparse.ArgumentParser(description="Run the checks of a tvm_ext GPU bundle.")
    parser.add_argument("--out", default="gpu_results.json",
                        help="the results JSON (default: gpu_results.json here)")
    parser.add_argument("--suite", choices=("all", *SUITES), default="all",
                        help="cuda: the GPU checks; llvm: the CPU self-check (default: both)")
    parser.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S,
                        help="seconds; checks not reached by then are skipped (default 540)")
    parser.add_argument("--only", default="",
                        help="comma-separated parts of check names to run (e.g. zoo,swap)")
    args = parser.parse_args(argv)
    suites = SUITES if args.suite == "all" else (args.suite,)
    only = tuple(o for o in args.only.split(",") if o)
    try:
        results = run_checks(bundle_dir or os.getcwd(), suites=suites,
                             time_budget_s=args.time_budget, only=only)
    except Exception as err:  # the checks could not start: say why, in the JSON too
        write_json(args.out, {"error": f"{type(err).__name__}: {err}",
                              "traceback": traceback.format_exc().splitlines()[-12:]})
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_json(args.out, results)
    summary = results["summary"]
    print(f"{summary['pass']} passed, {summary['fail']} failed, {summary['skipped']} skipped in "
          f"{summary['seconds']:.1f} s; results in {os.path.abspath(args.out)}")
    return 1 if summary["fail"] else 0
