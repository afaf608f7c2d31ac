"""Roofline against measurement, kernel by kernel, on this machine's CPU.

Every kernel of a model's fused training step is compiled alone for llvm and timed on random
inputs (`tvm_ext.driver.measure_kernels`); the table lines that up against the roofline of the "cpu"
preset and of the preset calibrated to these measurements, and compares the iteration time
the swap simulator predicts (ideal, no swapping) from each.

    python benchmarks/cost_model.py [--model gpt] [--size small] [--top 25]

Writes benchmarks/results/cost_model.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--size", default="small")
    ap.add_argument("--inference", action="store_true")
    ap.add_argument("--top", type=int, default=25, help="kernels to print")
    ap.add_argument("--output", default=os.path.join(RESULTS, "cost_model.json"))
    args = ap.parse_args(argv)

    from tvm_ext.cost import op_times
    from tvm_ext.cost.calibration import calibrate, compare, op_times_measured
    from tvm_ext.driver import fused_graph, resolve_target
    from tvm_ext.driver.measure_kernels import measure_kernels
    from tvm_ext.models import get_model

    target = resolve_target("llvm")
    model = get_model(args.model, args.size, training=not args.inference)
    graph = fused_graph(model, target)
    start = time.perf_counter()
    timings = measure_kernels(model, target, graph)
    elapsed = time.perf_counter() - start
    fitted = calibrate(timings, "cpu")
    rows = compare(timings, "cpu")
    fitted_rows = {r["kernel"]: r for r in compare(timings, fitted)}
    for r in rows:
        r["calibrated_s"] = fitted_rows[r["kernel"]]["roofline_s"]
        r["calibrated_ratio"] = fitted_rows[r["kernel"]]["ratio"]

    def spread(key):
        logs = np.abs(np.log([r[key] for r in rows]))
        return float(np.exp(np.median(logs))), float(np.exp(logs.max()))

    measured = float(op_times_measured(graph, timings).sum())
    totals = {"measured_s": measured, "roofline_s": float(op_times(graph, "cpu").sum()),
              "calibrated_s": float(op_times(graph, fitted).sum())}
    print(f"{args.model} {args.size} {'inference' if args.inference else 'training'}: "
          f"{len(timings)} kernels, {graph.num_ops} ops, measured in {elapsed:.1f} s")
    header = (f"{'kernel':44} {'calls':>5} {'GFLOP':>8} {'MB':>8} {'bound':>7} "
              f"{'measured ms':>11} {'roofline ms':>11} {'x':>6} {'calib ms':>9} {'x':>6}")
    print(header)
    for r in rows[: args.top]:
        print(f"{r['kernel'][:44]:44} {r['calls']:5d} {r['gflops']:8.3f} {r['mbytes']:8.2f} "
              f"{r['bound']:>7} {r['measured_s'] * 1e3:11.3f} {r['roofline_s'] * 1e3:11.3f} "
              f"{r['ratio']:6.2f} {r['calibrated_s'] * 1e3:9.3f} {r['calibrated_ratio']:6.2f}")
    med, worst = spread("ratio")
    cmed, cworst = spread("calibrated_ratio")
    print(f"measured/roofline per kernel: median factor {med:.2f}, worst {worst:.1f} "
          f"(calibrated: {cmed:.2f}, worst {cworst:.1f})")
    print(f"iteration (sum of ops): measured {totals['measured_s'] * 1e3:.1f} ms, roofline "
          f"{totals['roofline_s'] * 1e3:.1f} ms, calibrated {totals['calibrated_s'] * 1e3:.1f} ms")
    print(f"calibrated cpu preset: compute_efficiency {fitted.compute_efficiency:.3f}, "
          f"bandwidth_efficiency {fitted.bandwidth_efficiency:.3f}, launch_overhead "
          f"{fitted.launch_overhead * 1e6:.1f} us")
    os.makedirs(RESULTS, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"model": args.model, "size": args.size, "kernels": rows, "totals": totals,
                   "calibrated": fitted.to_dict(),
                   "median_factor": med, "worst_factor": worst,
                   "calibrated_median_factor": cmed, "calibrated_worst_factor": cworst}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
