"""Swap planning benchmark: SwapAdvisor against ideal, vDNN and LRU in the same simulator.

Cases: training steps of gpt (xl: hidden 4096, 24 layers), a wide resnet (WRN-74-10) and a
deep mlp, plus gpt-xl inference (weights above the budget from 2x on), and whole AdamW
iterations of gpt-xl and the wide resnet (`*-adamw`: forward, backward and the update in place,
parameters and the optimizer state as arguments; `*-adamw-bf16`: GEMMs and convolutions from
bfloat16 copies of the float32 master weights); budgets of the no-swap
peak divided by 1, 2, 4, 8, 12; the gtx1080ti (PCIe 3) and h100 (PCIe 5) presets with roofline
op times. For each case: simulated iteration time of each planner and its % of ideal (`cls %`:
the best plan the search found with SwapAdvisor's size-class layout, 0 when that layout cannot
fit the budget; the plan returned is the best of both layouts), bytes swapped, planning time,
and two lower bounds. Transfer bound: the bytes above the budget at the no-swap peak must leave
the device and come back, so time >= excess / link bandwidth. Phase bound (training): the bytes
live across the forward/backward boundary beyond the budget must have left by the end of the
forward pass (`phase_bound`). `of lim %` is how close SwapAdvisor comes to the largest of ideal
and the two bounds.

    python benchmarks/swap.py [--time-budget 20] [--models gpt,resnet,mlp,gpt-infer]
        [--presets gtx1080ti,h100] [--ratios 1,2,4,8,12]

Prints a table, writes benchmarks/results/swap.json and one PNG per model (device memory over
time of each planner against the budget, gtx1080ti, every ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = {
    # key: (zoo name, size, training[, optimizer, compute dtype])
    "gpt": ("gpt", "xl", True),
    "resnet": ("resnet", "wide", True),
    "mlp": ("mlp", "deep", True),
    "gpt-infer": ("gpt", "xl", False),
    "gpt-adamw": ("gpt", "xl", True, "adamw", "fp32"),
    "gpt-adamw-bf16": ("gpt", "xl", True, "adamw", "bf16"),
    "resnet-adamw": ("resnet", "wide", True, "adamw", "fp32"),
    "resnet-adamw-bf16": ("resnet", "wide", True, "adamw", "bf16"),
}
PLANNERS = ("ideal", "lru", "vdnn", "swapadvisor")


def build_graph(key: str):
    import tvm

    from tvm_ext.driver import fused_graph
    from tvm_ext.models import get_model

    name, size, training, *optimizer = MODELS[key]
    model = get_model(name, size, training=training)
    if optimizer:
        from tvm_ext.models.mixed_precision import low_precision_step
        from tvm_ext.models.optimizer import Optimizer, make_optimizer_step

        kind, dtype = optimizer
        model = make_optimizer_step(low_precision_step(model, dtype), Optimizer(kind))
    return fused_graph(model, tvm.target.Target("llvm"))


def phase_bound(problem) -> float:
    """A tighter lower bound for a training step: at the end of the forward pass at most the
    budget is on the device, so the bytes then live (made in forward, read in backward) beyond
    the budget have left over the device-to-host link by then; the backward pass comes after.
    Time >= max(forward compute, those bytes / bandwidth) + backward compute (IR phases)."""
    order = problem.order
    phases = [problem.op_phases[op] for op in order]
    if "backward" not in phases:
        return float(problem.durations.sum())
    split = phases.index("backward")
    first = np.full(problem.num_tensors, len(order))
    last = np.full(problem.num_tensors, -1)
    for i, op in enumerate(order):
        for t in problem.needs(op):
            first[t] = min(first[t], i)
            last[t] = max(last[t], i)
    spanning = (first < split) & (last >= split) & ~problem.host_start & ~problem.pinned
    leave = max(0, int(problem.sizes[spanning].sum()) - problem.budget)
    forward = float(problem.durations[np.asarray(order[:split])].sum())
    backward = float(problem.durations[np.asarray(order[split:])].sum())
    return max(forward, leave / problem.d2h_bandwidth) + backward


def run_case(base, ratio: float, time_budget: float, seed: int) -> tuple[dict, dict]:
    from tvm_ext.swap import plan_swaps, simulate, validate
    from tvm_ext.swap.search import memory_aware_order

    peak = base.no_swap_peak()
    budget = int(peak / ratio)
    problem = base.with_budget(budget)
    minimum, _ = problem.min_budget()
    row = {"ratio": ratio, "budget": budget, "no_swap_peak": peak, "min_budget": minimum,
           "ops": problem.num_ops, "planners": {}}
    plans = {}
    for name in PLANNERS:
        start = time.perf_counter()
        plan = plan_swaps(problem, name, time_budget_s=time_budget, seed=seed)
        elapsed = time.perf_counter() - start
        validate(problem, plan)
        plans[name] = plan
        row["planners"][name] = {
            "time_s": plan.predicted_time, "bytes_swapped": plan.bytes_swapped,
            "bytes_in": plan.bytes_swapped_in, "bytes_out": plan.bytes_swapped_out,
            "planning_s": elapsed, "predicted_peak": plan.predicted_peak,
            **({k: plan.info[k] for k in ("generations", "evaluations", "layout",
                                          "best_by_layout")}
               if name == "swapadvisor" else {})}
    ideal = row["planners"]["ideal"]["time_s"]
    for r in row["planners"].values():
        r["pct_ideal"] = 100.0 * ideal / r["time_s"]
    best_peak = min(peak, base.no_swap_peak(memory_aware_order(base)))
    excess = max(0, best_peak - budget)
    bw = min(problem.h2d_bandwidth, problem.d2h_bandwidth)
    row["transfer_bound_s"] = excess / bw
    row["phase_bound_s"] = phase_bound(problem)
    row["limit_s"] = max(ideal, row["transfer_bound_s"], row["phase_bound_s"])
    sa = row["planners"]["swapadvisor"]["time_s"]
    row["of_limit_pct"] = 100.0 * row["limit_s"] / sa
    classes = row["planners"]["swapadvisor"]["best_by_layout"].get("size_classes")
    # 0: the size-class layout cannot fit the budget.
    row["size_classes_pct_ideal"] = 100.0 * ideal / classes if classes else 0.0
    best_baseline = min(row["planners"][p]["time_s"] for p in ("lru", "vdnn"))
    row["speedup_vs_best_baseline"] = best_baseline / sa
    timelines = {name: simulate(problem, plan) for name, plan in plans.items()}
    return row, {name: (t.memory_times, t.memory_bytes) for name, t in timelines.items()}


def plot(model: str, rows: list[dict], curves: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.4 * len(rows)), squeeze=False)
    for ax, row, curve in zip(axes[:, 0], rows, curves, strict=True):
        for name in PLANNERS:
            t, b = curve[name]
            ax.step(t, np.asarray(b) / 2**30, where="post", label=name, lw=1)
        ax.axhline(row["budget"] / 2**30, color="k", ls="--", lw=1, label="budget")
        ax.set_title(f"{model}, budget = no-swap peak / {row['ratio']:g}", fontsize=9)
        ax.set_ylabel("device GiB")
    axes[-1, 0].set_xlabel("simulated time (s), gtx1080ti")
    axes[0, 0].legend(fontsize=7, ncol=5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-budget", type=float, default=20.0,
                    help="SwapAdvisor search budget per case (s)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--presets", default="gtx1080ti,h100")
    ap.add_argument("--ratios", default="1,2,4,8,12")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=os.path.join(RESULTS, "swap.json"))
    args = ap.parse_args(argv)

    from tvm_ext.swap import SwapProblem

    os.makedirs(RESULTS, exist_ok=True)
    ratios = [float(r) for r in args.ratios.split(",")]
    results = []
    header = (f"{'model':10} {'hw':9} {'ratio':>5} {'ops':>5} {'ideal s':>8} {'lru %':>6} "
              f"{'vdnn %':>6} {'SA %':>6} {'cls %':>6} {'SA/best':>7} {'SA GB':>7} {'plan s':>6} "
              f"{'bound s':>7} {'phase s':>7} {'of lim %':>8}")
    lines = [header, "-" * len(header)]
    print(header, flush=True)
    for model in args.models.split(","):
        start = time.perf_counter()
        graph = build_graph(model)
        print(f"# {model}: {graph.num_ops} ops, graph built in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        for preset in args.presets.split(","):
            base = SwapProblem.from_graph(graph, 1 << 62, preset, name=model)
            rows, curves = [], []
            for ratio in ratios:
                row, curve = run_case(base, ratio, args.time_budget, args.seed)
                row.update(model=model, preset=preset)
                results.append(row)
                rows.append(row)
                curves.append(curve)
                p = row["planners"]
                line = (f"{model:10} {preset:9} {ratio:5g} {row['ops']:5d} "
                        f"{p['ideal']['time_s']:8.3f} {p['lru']['pct_ideal']:6.1f} "
                        f"{p['vdnn']['pct_ideal']:6.1f} {p['swapadvisor']['pct_ideal']:6.1f} "
                        f"{row['size_classes_pct_ideal']:6.1f} "
                        f"{row['speedup_vs_best_baseline']:7.2f} "
                        f"{p['swapadvisor']['bytes_swapped'] / 1e9:7.1f} "
                        f"{p['swapadvisor']['planning_s']:6.1f} "
                        f"{row['transfer_bound_s']:7.3f} {row['phase_bound_s']:7.3f} "
                        f"{row['of_limit_pct']:8.1f}")
                lines.append(line)
                print(line, flush=True)
            if preset == "gtx1080ti":
                plot(model, rows, curves, os.path.join(RESULTS, f"swap_{model}.png"))
    with open(args.output, "w") as f:
        json.dump({"cases": results, "time_budget_s": args.time_budget, "seed": args.seed,
                   "table": lines}, f, indent=1)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
