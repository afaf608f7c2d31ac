"""Benchmark: MetaSchedule tuning (XGBoost cost model) of zoo models, untuned vs tuned on llvm.

For each model (inference): tune its kernels with a trial budget into a fresh work dir, build it
untuned (what `compile.py MODEL --target llvm` builds: the tvm_ext pipeline, which fuses but
does not schedule on CPUs, i.e. TVM's plain single-threaded lowering) and tuned (the same
pipeline with `tune_db`), check both compute the same outputs, and time them side by side in one
process: rounds alternate between the two builds so load from other processes hits both alike.

    python benchmarks/tuning.py [--models mlp,gpt,resnet] [--trials 200] [--size small]

Prints a table and writes benchmarks/results/tuning.json. Targets: tuned >= 3x faster
than untuned for mlp and gpt, tuning under 10 minutes each.

`--gpu` adds the GPU part: gpt's GEMM kernels tuned for CUDA against torch.matmul (cuBLAS) on
the same shapes. Without a GPU it tunes build-only (candidates compiled by nvcc, none timed)
and says so; the cuBLAS comparison needs a GPU and torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np
import tvm
from tvm import relax

import tvm_ext  # noqa: F401  (runtime library, pipeline)
from tvm_ext import driver, pipeline, runtime, schedules
from tvm_ext.models import get_model

TARGET_SPEEDUP = 3.0
TARGET_TUNE_SECONDS = 600
TARGET_CUBLAS_FRACTION = 0.7
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tuning.json")


def time_side_by_side(executables: list, arguments, device, rounds: int, min_round_s: float
                      ) -> list[list[float]]:
    """Per-call latencies (ms) of each executable, measured in alternating rounds."""
    vms = [relax.VirtualMachine(ex, device) for ex in executables]
    args = [runtime.to_device(a, device) for a in arguments]
    calls = []
    for vm in vms:  # warm up, and size the rounds so each lasts about min_round_s
        start = time.perf_counter()
        vm["main"](*args)
        device.sync()
        calls.append(max(1, int(min_round_s / max(time.perf_counter() - start, 1e-6))))
    latencies: list[list[float]] = [[] for _ in vms]
    for _ in range(rounds):
        for vm, n, out in zip(vms, calls, latencies, strict=True):
            for _ in range(n):
                start = time.perf_counter()
                vm["main"](*args)
                device.sync()
                out.append((time.perf_counter() - start) * 1e3)
    return latencies


def bench_model(name: str, size: str, trials: int, work_dir: str,
                rounds: int, quiet: bool) -> dict:
    model = get_model(name, size)
    target = driver.resolve_target("llvm")
    load_before = os.getloadavg()
    start = time.perf_counter()
    report = driver.tune(model.mod, target, work_dir, trials,
                            log=(lambda line: None) if quiet else None)
    tune_s = time.perf_counter() - start
    untuned = driver.build(model, target)
    tuned = driver.build(model, target, tune_db=work_dir)
    arguments = model.random_arguments(0)
    ref = driver.run(untuned, arguments, tvm.cpu(), repeat=0)
    out = driver.run(tuned, arguments, tvm.cpu(), repeat=0)
    check = driver.compare(out.outputs, ref.outputs, rtol=1e-4, atol=1e-4)
    base_ms, tuned_ms = time_side_by_side([untuned, tuned], arguments, tvm.cpu(), rounds, 0.5)
    staged = pipeline.module_at_schedule_phase(model.mod, target)
    covered, default = schedules.coverage(staged, target, work_dir)
    row = {
        "model": name,
        "size": size,
        "config": {k: v for k, v in model.config.items() if k != "size"},
        "kernels": len(report.tasks),
        "kernels_tuned": len(covered),
        "kernels_default": default,
        "trials": report.trials_before + report.trials_run,
        "tune_seconds": tune_s,
        "untuned_ms": float(np.median(base_ms)),
        "tuned_ms": float(np.median(tuned_ms)),
        "untuned_calls": len(base_ms),
        "tuned_calls": len(tuned_ms),
        "max_abs_error": check.max_abs_error,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "tuning": _without_location(report.to_json(), work_dir),
    }
    row["speedup"] = row["untuned_ms"] / row["tuned_ms"]
    return row


def _without_location(tuning: dict, work_dir: str) -> dict:
    """A tuning report with its database as a folder of the work dir (a temporary one unless
    --work-dir), not a path of this machine."""
    return {**tuning, "database": os.path.relpath(tuning["database"], work_dir)}


def gpu_gemms(trials: int, work_dir: str, size: str) -> dict:
    """gpt's GEMM kernels tuned for CUDA; against torch.matmul where a GPU can time them."""
    from tvm_ext.runtime.cuda import has_gpu

    model = get_model("gpt", size)
    target = driver.resolve_target("cuda")
    staged = pipeline.module_at_schedule_phase(model.mod, target)
    gemms = [t for t in schedules.extract_tasks(staged, target) if "matmul" in t.name]
    gpu = has_gpu()
    report = schedules.tune_tasks(gemms, target, work_dir, trials, measure=gpu)
    result = {"device": None, "timed": gpu, "kernels": [],
              "tuning": _without_location(report.to_json(), work_dir)}
    if not gpu:
        result["note"] = ("no GPU here: GEMM candidates were built with nvcc, none timed; the "
                          "cuBLAS comparison needs a GPU")
        return result
    import torch

    result["device"] = torch.cuda.get_device_name(0)
    for task, progress in zip(gemms, report.tasks, strict=True):
        a_shape, b_shape = _gemm_operands(task)
        a = torch.randn(*a_shape, device="cuda")
        b = torch.randn(*b_shape, device="cuda")
        cublas_s = _torch_time(lambda a=a, b=b: torch.matmul(a, b))
        result["kernels"].append({
            "kernel": task.name, "a": a_shape, "b": b_shape, "calls": task.weight,
            "tuned_ms": None if progress.best_s is None else progress.best_s * 1e3,
            "cublas_ms": cublas_s * 1e3,
            "fraction_of_cublas": (None if progress.best_s is None
                                   else cublas_s / progress.best_s),
        })
    return result


def _gemm_operands(task: schedules.TuningTask) -> tuple[list[int], list[int]]:
    """The two matmul inputs of a (fused) matmul kernel: its first two parameters."""
    func = task.mod["main"]
    shapes = [[int(d) for d in p.shape] for p in func.params[:2]]
    return shapes[0], shapes[1]


def _torch_time(fn, repeat: int = 50) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat / 1e3


def print_table(rows: list[dict]) -> None:
    head = (f"{'model':<8} {'size':<6} {'kernels':>7} {'tuned':>5} {'trials':>6} "
            f"{'tune s':>7} {'untuned ms':>11} {'tuned ms':>9} {'speed-up':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<8} {r['size']:<6} {r['kernels']:>7} {r['kernels_tuned']:>5} "
              f"{r['trials']:>6} {r['tune_seconds']:>7.0f} {r['untuned_ms']:>11.3f} "
              f"{r['tuned_ms']:>9.3f} {r['speedup']:>7.1f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,gpt,resnet")
    p.add_argument("--size", default="small", help="zoo size for every model")
    p.add_argument("--trials", type=int, default=200, help="trial budget per model")
    p.add_argument("--rounds", type=int, default=6, help="alternating timing rounds")
    p.add_argument("--work-dir", help="tuning work dir to use (default: a fresh temporary one, "
                                      "so the tuning time is measured)")
    p.add_argument("--gpu", action="store_true", help="also tune gpt's GEMMs for CUDA and "
                   "compare them with cuBLAS (build-only without a GPU)")
    p.add_argument("--quiet", action="store_true", help="no per-batch tuning progress")
    p.add_argument("--output", default=RESULTS)
    args = p.parse_args(argv)

    fresh = args.work_dir is None
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="tvm_ext_tuning_bench_")
    wall = time.perf_counter()
    rows = []
    try:
        for name in args.models.split(","):
            print(f"== {name} ({args.size}), {args.trials} trials", flush=True)
            rows.append(bench_model(name, args.size, args.trials, work_dir, args.rounds,
                                    args.quiet))
        gpu = gpu_gemms(args.trials, work_dir, args.size) if args.gpu else None
    finally:
        if fresh:
            shutil.rmtree(work_dir, ignore_errors=True)
    wall = time.perf_counter() - wall

    print()
    print_table(rows)
    checks = []
    for r in rows:
        if r["model"] in ("mlp", "gpt"):
            ok = r["speedup"] >= TARGET_SPEEDUP and r["tune_seconds"] < TARGET_TUNE_SECONDS
            checks.append({"model": r["model"], "ok": ok, "target": f">= {TARGET_SPEEDUP}x "
                           f"speed-up, tuning < {TARGET_TUNE_SECONDS} s"})
            print(f"target {r['model']}: speed-up {r['speedup']:.1f}x (>= {TARGET_SPEEDUP}x), "
                  f"tuning {r['tune_seconds']:.0f} s (< {TARGET_TUNE_SECONDS} s): "
                  f"{'PASS' if ok else 'FAIL'}")
    if gpu is not None:
        print(f"gpu: {gpu.get('note') or gpu['device']}")
        for k in gpu["kernels"]:
            frac = k["fraction_of_cublas"]
            print(f"  {k['kernel']:<32} tuned {k['tuned_ms']} ms, cuBLAS {k['cublas_ms']:.4f} "
                  f"ms: {'n/a' if frac is None else f'{frac:.0%}'} of cuBLAS")
    loads = [r["loadavg_before"][0] for r in rows] + [r["loadavg_after"][0] for r in rows]
    print(f"wall {wall:.0f} s; 1-min load average during the runs {min(loads):.1f}-"
          f"{max(loads):.1f} on {os.cpu_count()} cores")
    result = {
        "benchmark": "tuning",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "target": "llvm",
        "baseline": "compile.py without tuning: the tvm_ext pipeline (fused, unscheduled: "
                    "TVM's plain lowering, one thread)",
        "trials_per_model": args.trials,
        "wall_seconds": wall,
        "rows": rows,
        "targets": checks,
        "gpu": gpu,
        "argv": sys.argv[1:],
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"wrote {args.output}")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
