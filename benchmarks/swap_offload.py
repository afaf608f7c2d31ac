"""SwapOffload measured on this machine: the CPU stand-in for GPU + host (cpu:0 the device,
cpu:1 the host, the runtime library's copy streams in between).

For each zoo model (inference and training step) and each model of the third-party corpus
(tests/corpus, tiny, exported with torch.export), and each budget (a fraction of the no-swap
peak; 8.33% is 1/12), plan with the tvm_ext planner (swaps, recompute, splits in time), compile
with the tvm_ext pipeline, run the swapped and the unswapped module side by side in one process,
and report: the budget, the planned peak, the measured device peak (VM allocations + arguments
kept on the device + module constants), whether the outputs are bit-identical (`yes`; `tol`:
within the dtype's float tolerance where the plan runs ops in chunks that may round
differently: kernels that reduce (a GEMM, a convolution, a norm), whose library or schedule may
order the sum differently at the chunk's shape, split along the dim they reduce or another;
the JSON names those ops), bytes swapped,
tensors recomputed, ops split, and the median time of each build. A
budget below what the finest split of some op needs is refused with the smallest feasible
budget, and the row says so.

    python benchmarks/swap_offload.py [--size small] [--budgets 50% 25% 12.5% 8.33% min]
        [--corpus | --no-corpus]

Writes benchmarks/results/swap_offload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import tvm

from tvm_ext import driver
from tvm_ext.ir.targets import vm_devices
from tvm_ext.models import get_model, load_model
from tvm_ext.models.reference import tolerance
from tvm_ext.swap import InfeasibleBudgetError
from tvm_ext.units import format_size

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Deeper than the zoo's "small" presets, so that one op's working set is a small part of the
# no-swap peak and the lower budgets are feasible.
DEPTH = {"mlp": {"layers": 16}, "gpt": {"layers": 8}, "resnet": {"blocks": (4, 4, 4)}}


def run_model(name: str, size: str, training: bool, budgets, repeat: int, search_s: float,
              model=None):
    target = tvm.target.Target("llvm")
    model = model or get_model(name, size, training=training, **DEPTH.get(name, {}))
    args = model.random_arguments(0)
    device, host = vm_devices(target)
    plain = driver.run(driver.build(model, target), args, device, repeat=repeat)
    rows = []
    for budget in budgets:
        row = {"model": name, "size": size, "overrides": DEPTH.get(name, {}),
               "training": training, "budget_arg": budget, "plain_ms": plain.median_ms}
        try:
            # Kernels no split fits run as their parts (`fissioned`): the graph is of those.
            planning = driver.plan_swap(model, target, budget, hardware="cpu",
                                        time_budget_s=search_s, seed=0)
        except InfeasibleBudgetError as err:
            row.update(budget=err.budget, no_swap_peak=err.no_swap_peak,
                       infeasible=str(err), min_budget=err.minimum)
            rows.append(row)
            continue
        graph, problem, plan = planning.graph, planning.problem, planning.plan
        constants = graph.bytes_of_kind("constant")
        row.update(budget=problem.budget, no_swap_peak=problem.no_swap_peak(),
                   plain_measured_peak=plain.peak_bytes + constants,
                   fissioned=planning.fissioned, plan_s=plan.planning_time)
        ex = driver.build(model, target, swap_plan=plan)
        out = driver.run(ex, args, device, repeat=repeat, host=host,
                           arg_devices=planning.argument_devices)
        exact = all(np.array_equal(a, b) for a, b in zip(out.outputs, plain.outputs,
                                                          strict=True))
        inexact = planning.inexact_splits
        within = all(np.allclose(a, b, *tolerance(a.dtype))
                     for a, b in zip(out.outputs, plain.outputs, strict=True))
        row.update(planned_peak=plan.predicted_peak, measured_peak=out.peak_bytes + constants,
                   host_peak=out.host_peak_bytes, exact=exact, inexact_splits=inexact,
                   within_tolerance=within, swapped_bytes=plan.bytes_swapped,
                   recomputed=plan.info.get("recomputed", 0), split_ops=len(plan.splits),
                   swap_ms=out.median_ms, slowdown=out.median_ms / plain.median_ms)
        rows.append(row)
    return rows


def corpus_rows(args) -> list[dict]:
    """The corpus models (tests/corpus), inference and (where they train) the training step."""
    import sys
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "tests"))
    import corpus

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cm in corpus.MODELS:
            if cm.kind == "op":
                continue
            path, _ = corpus.export(cm, tmp)
            for training in (False, True) if cm.training else (False,):
                model = load_model(path, training=training)
                rows += run_model(cm.name, "tiny", training, args.budgets, args.repeat,
                                  args.search_s, model)
    return rows


def _agreement(row) -> str:
    """yes: bit for bit; tol: within the dtype's float tolerance, where the plan runs ops in
    chunks that may round differently (`swap.exactness`); NO: neither."""
    if row["exact"]:
        return "yes"
    return "tol" if row["inexact_splits"] and row["within_tolerance"] else "NO"


def _ok(row) -> bool:
    return "infeasible" in row or (_agreement(row) != "NO"
                                   and row["measured_peak"] <= row["budget"])


def print_table(rows) -> None:
    head = (f"{'model':12} {'step':9} {'arg':>6} {'budget':>10} {'planned':>10} "
            f"{'measured':>10} {'fits':>4} {'exact':>5} {'swapped':>10} {'rc':>4} {'split':>5} "
            f"{'no-swap ms':>10} {'swap ms':>9} {'x':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        step = "training" if r["training"] else "inference"
        if "infeasible" in r:
            print(f"{r['model']:12} {step:9} {r['budget_arg']:>6} "
                  f"{format_size(r['budget'], 2):>10}  refused: smallest feasible "
                  f"{format_size(r['min_budget'], 2)} "
                  f"({100 * r['min_budget'] / r['no_swap_peak']:.1f}% of the no-swap peak)")
            continue
        print(f"{r['model']:12} {step:9} {r['budget_arg']:>6} "
              f"{format_size(r['budget'], 2):>10} "
              f"{format_size(r['planned_peak'], 2):>10} {format_size(r['measured_peak'], 2):>10} "
              f"{'yes' if r['measured_peak'] <= r['budget'] else 'NO':>4} "
              f"{_agreement(r):>5} {format_size(r['swapped_bytes'], 2):>10} "
              f"{r['recomputed']:4d} {r['split_ops']:5d} "
              f"{r['plain_ms']:10.2f} {r['swap_ms']:9.2f} {r['slowdown']:6.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mlp", "gpt", "resnet"])
    p.add_argument("--size", default="small")
    p.add_argument("--budgets", nargs="+", default=["50%", "25%", "12.5%", "8.33%", "min"],
                   help="fractions of the no-swap peak, sizes, or min (smallest feasible)")
    p.add_argument("--corpus", action=argparse.BooleanOptionalAction, default=True,
                   help="also the third-party corpus models (tests/corpus, tiny)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--search-s", type=float, default=10.0)
    args = p.parse_args(argv)
    rows = []
    start = time.perf_counter()
    for name in args.models:
        for training in (False, True):
            rows += run_model(name, args.size, training, args.budgets, args.repeat,
                              args.search_s)
    if args.corpus:
        rows += corpus_rows(args)
    print_table(rows)
    wall = time.perf_counter() - start
    print(f"wall {wall:.0f} s on {platform.node()} ({os.cpu_count()} cores), load average "
          f"{os.getloadavg()[0]:.1f}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "swap_offload.json"), "w") as f:
        json.dump({"rows": rows, "wall_s": wall, "host": platform.node(),
                   "load_average": os.getloadavg()[0]}, f, indent=1)
    ok = all(_ok(r) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
