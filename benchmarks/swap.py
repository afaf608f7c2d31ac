"""Swap planning benchmark: tvm_ext's planner against swap-only SwapAdvisor, sqrt(n) recompute,
vDNN and LRU, and ideal, in the same simulator.

Cases: training steps of gpt (xl: hidden 4096, 24 layers), a wide resnet (WRN-74-10) and a
deep mlp, plus gpt-xl inference (weights above the budget from 2x on), and whole AdamW
iterations of gpt-xl and the wide resnet (`*-adamw`: forward, backward and the update in place,
parameters and the optimizer state as arguments; `*-adamw-bf16`: GEMMs and convolutions from
bfloat16 copies of the float32 master weights); budgets of the no-swap
peak divided by 1, 2, 4, 8, 12; the gtx1080ti (PCIe 3) and h100 (PCIe 5) presets with roofline
op times. Planners: `SA` (`swapadvisor`: the search over schedule, layout, swaps and recompute),
`swap` (`swap_only`: the same search without recompute, SwapAdvisor as published: the first
phase of the `SA` search, which the second starts from; two searches stopped by the clock differ
run to run), `ckpt`
(`checkpoint`: sqrt(n) recompute, the rest swapped), vDNN, LRU. For each case: simulated
iteration time of each planner and its % of ideal (`cls %`: the best plan the search found with
SwapAdvisor's size-class layout, 0 when that layout cannot fit the budget; the plan returned is
the best of both layouts), what the device bytes saved came from (`rc %`: recompute's share,
`sp %`: splitting in time's, the rest swap), bytes swapped, planning time, and lower bounds.
Transfer bound: the bytes above the budget at the no-swap peak must leave the device and come
back, so time >= excess / link bandwidth. Phase bound (training): the bytes live across the
forward/backward boundary beyond the budget must have left by the end of the forward pass
(`phase_bound`). With recompute (`rc bound`) a byte may instead be dropped and made again, at
the least its producer's time per byte (`recompute_bounds`): the bound falls where recomputing
is cheaper than the link. `of lim %` is how close SA comes to the largest of ideal and the
recompute bounds.

Targets (issue 13), printed PASS or MISS: SA never slower than swap-only; h100 at 12x: resnet
>= 75% and gpt >= 93% of ideal; planning within 60 s for the 2k-op graphs.

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
PLANNERS = ("ideal", "lru", "vdnn", "checkpoint", "swap_only", "swapadvisor")


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
    forward, backward, leave, _ = _phases(problem)
    return max(forward, leave / problem.d2h_bandwidth) + backward


def _recompute_rates(problem, tensors) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, seconds per byte) of the recomputable `tensors`, cheapest per byte first: a byte
    made again costs at least its producer's time over the tensor's size."""
    from tvm_ext.swap.recompute import recomputable

    ok = recomputable(problem)
    tensors = [t for t in tensors if problem.producers[t] >= 0 and ok[problem.producers[t]]
               and problem.sizes[t] > 0]
    nbytes = np.array([problem.sizes[t] for t in tensors], dtype=np.float64)
    rate = np.array([problem.durations[problem.producers[t]] for t in tensors]) / \
        np.maximum(nbytes, 1.0)
    order = np.argsort(rate, kind="stable")
    return nbytes[order], rate[order]


def _cheapest_split(leave: float, bw: float, nbytes, rate, cost) -> float:
    """min over y (bytes recomputed, cheapest first) of cost(link seconds of leave - y,
    recompute seconds of y): convex and piecewise linear in y, so a breakpoint attains it."""
    cum_bytes = np.concatenate([[0.0], np.cumsum(nbytes)])
    cum_secs = np.concatenate([[0.0], np.cumsum(nbytes * rate)])
    points = set(np.minimum(cum_bytes, leave).tolist()) | {0.0, float(min(leave,
                                                                          cum_bytes[-1]))}
    best = float("inf")
    for y in points:
        k = int(np.searchsorted(cum_bytes, y, side="right")) - 1
        secs = cum_secs[k] + (y - cum_bytes[k]) * (rate[k] if k < len(rate) else 0.0)
        best = min(best, cost((leave - y) / bw, secs))
    return best


def recompute_bounds(problem, excess: int) -> tuple[float, float]:
    """The transfer and phase bounds when bytes may be recomputed instead of moved: (min over
    y of max(ideal + R(y), (excess - y) / bw), the phase bound's max(forward, (leave - y) /
    bw) + backward + R(y)), R(y) the least time to make y bytes again (every tensor's one
    re-run at its producer's rate: chains and re-reads only add to it, so these stay lower
    bounds)."""
    ideal = float(problem.durations.sum())
    bw = min(problem.h2d_bandwidth, problem.d2h_bandwidth)
    all_bytes, all_rate = _recompute_rates(problem, range(problem.num_tensors))
    transfer = _cheapest_split(excess, bw, all_bytes, all_rate,
                               lambda link, secs: max(ideal + secs, link))
    forward, backward, leave, spanning = _phases(problem)
    if spanning is None:
        return transfer, ideal
    nbytes, rate = _recompute_rates(problem, spanning)
    phase = _cheapest_split(leave, problem.d2h_bandwidth, nbytes, rate,
                            lambda link, secs: max(forward, link) + backward + secs)
    return transfer, phase


def _phases(problem):
    """(forward seconds, backward seconds, bytes live across the boundary beyond the budget,
    those tensors) of a training step's IR order; spanning None without a backward pass."""
    order = problem.order
    phases = [problem.op_phases[op] for op in order]
    if "backward" not in phases:
        return float(problem.durations.sum()), 0.0, 0, None
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
    return forward, backward, leave, np.nonzero(spanning)[0]


def freed_shares(plan, problem) -> dict:
    """Device bytes saved, by how: swap (freed between two uses by a copy out, or an argument
    fetched again), recompute (dropped and made again) and splitting in time (each split op's
    streamed inputs and outputs, less its chunk buffers, need not be resident while it runs).
    A tensor may count under two (swapped out before the split op that streams it in)."""
    fetched: dict[int, int] = {}
    refetched = 0
    for s in plan.swap_ins:
        fetched[s.tensor] = fetched.get(s.tensor, 0) + 1
        if problem.host_start[s.tensor] and fetched[s.tensor] > 1:
            refetched += s.nbytes
    swapped = plan.bytes_swapped_out + refetched
    recomputed = int(plan.info.get("bytes_recomputed", 0))
    split = sum(max(0, int(problem.sizes[[*sp.cut_inputs, *sp.cut_outputs]].sum()) - sp.nbytes)
                for sp in plan.splits)
    total = swapped + recomputed + split
    return {"swap_bytes": swapped, "recompute_bytes": recomputed, "split_bytes": split,
            "recompute_share": recomputed / total if total else 0.0,
            "split_share": split / total if total else 0.0}


def run_case(base, ratio: float, time_budget: float, seed: int,
             unswapped: tuple[float, int] | None = None) -> tuple[dict, dict]:
    """Every planner on `base` at 1/`ratio` of its no-swap peak. `unswapped`: (seconds, peak
    bytes) of the step as built without a budget, where the budgeted graph differs (a
    training step's attention made again for the backward): the budget is then 1/`ratio` of
    that peak and % of ideal is of that time."""
    from tvm_ext.swap import plan_swaps, simulate, validate
    from tvm_ext.swap.search import (
        late_backward_order,
        memory_aware_order,
        swapadvisor_phases,
    )

    peak = base.no_swap_peak() if unswapped is None else unswapped[1]
    budget = int(peak / ratio)
    problem = base.with_budget(budget)
    minimum, _ = problem.min_budget()
    row = {"ratio": ratio, "budget": budget, "no_swap_peak": peak, "min_budget": minimum,
           "ops": problem.num_ops, "planners": {}}
    plans, planning = {}, {}
    for name in PLANNERS:
        if name == "swap_only":
            continue  # the first phase of the swapadvisor search
        start = time.perf_counter()
        if name == "swapadvisor":
            plans["swap_only"], plans[name] = swapadvisor_phases(
                problem, time_budget_s=time_budget, seed=seed)
            planning["swap_only"] = plans["swap_only"].planning_time
        else:
            plans[name] = plan_swaps(problem, name, time_budget_s=time_budget, seed=seed)
        planning[name] = time.perf_counter() - start
    for name in PLANNERS:
        plan = plans[name]
        validate(problem, plan)
        row["planners"][name] = {
            "time_s": plan.predicted_time, "bytes_swapped": plan.bytes_swapped,
            "bytes_in": plan.bytes_swapped_in, "bytes_out": plan.bytes_swapped_out,
            "planning_s": planning[name], "predicted_peak": plan.predicted_peak,
            **(freed_shares(plan, problem) if name != "ideal" else {}),
            **({k: plan.info[k] for k in ("generations", "evaluations", "layout",
                                          "best_by_layout", "recomputed", "recompute_s")}
               if name in ("swapadvisor", "swap_only") else {})}
    ideal = row["planners"]["ideal"]["time_s"] if unswapped is None else unswapped[0]
    row["ideal_s"] = ideal
    for r in row["planners"].values():
        r["pct_ideal"] = 100.0 * ideal / r["time_s"]
    best_peak = min(base.no_swap_peak(order) for order in (
        None, memory_aware_order(base), late_backward_order(base, base.order)))
    excess = max(0, best_peak - budget)
    bw = min(problem.h2d_bandwidth, problem.d2h_bandwidth)
    row["transfer_bound_s"] = excess / bw
    row["phase_bound_s"] = phase_bound(problem)
    row["limit_s"] = max(ideal, row["transfer_bound_s"], row["phase_bound_s"])
    row["transfer_bound_recompute_s"], row["phase_bound_recompute_s"] = \
        recompute_bounds(problem, excess)
    row["limit_recompute_s"] = max(ideal, row["transfer_bound_recompute_s"],
                                   row["phase_bound_recompute_s"])
    sa = row["planners"]["swapadvisor"]["time_s"]
    row["of_limit_pct"] = 100.0 * row["limit_recompute_s"] / sa
    classes = row["planners"]["swapadvisor"]["best_by_layout"].get("size_classes")
    # 0: the size-class layout cannot fit the budget.
    row["size_classes_pct_ideal"] = 100.0 * ideal / classes if classes else 0.0
    best_baseline = min(row["planners"][p]["time_s"] for p in ("lru", "vdnn"))
    row["speedup_vs_best_baseline"] = best_baseline / sa
    timelines = {name: simulate(problem, plan) for name, plan in plans.items()}
    return row, {name: (t.memory_times, t.memory_bytes) for name, t in timelines.items()}


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """Issue 13's targets over the cases run (NOT MEASURED where a case was not run)."""
    def case(model, preset, ratio):
        return next((r for r in rows if (r["model"], r["preset"], r["ratio"]) ==
                     (model, preset, ratio)), None)

    slower = [f"{r['model']} {r['preset']} {r['ratio']:g}x" for r in rows
              if r["planners"]["swapadvisor"]["time_s"] >
              r["planners"]["swap_only"]["time_s"] * (1 + 1e-9)]
    out = [{"target": "SA never slower than swap-only", "status": "MISS" if slower else "PASS",
            "detail": ", ".join(slower)}]
    for model, want in (("resnet", 75.0), ("gpt", 93.0)):
        r = case(model, "h100", 12.0)
        got = None if r is None else r["planners"]["swapadvisor"]["pct_ideal"]
        out.append({"target": f"{model} h100 12x >= {want:g}% of ideal",
                    "status": "NOT MEASURED" if got is None else
                    ("PASS" if got >= want else "MISS"),
                    "detail": "" if got is None else f"{got:.1f}%"})
    big = [r for r in rows if r["ops"] >= 2000]
    worst = max((r["planners"]["swapadvisor"]["planning_s"] for r in big), default=None)
    out.append({"target": "planning <= 60 s for 2k-op graphs",
                "status": "NOT MEASURED" if worst is None else
                ("PASS" if worst <= 60.0 else "MISS"),
                "detail": "" if worst is None else f"longest {worst:.1f} s"})
    return out


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
              f"{'vdnn %':>6} {'ckpt %':>6} {'swap %':>6} {'SA %':>6} {'rc %':>5} {'sp %':>5} "
              f"{'cls %':>6} {'SA/best':>7} {'SA GB':>7} {'plan s':>6} {'bound s':>7} "
              f"{'phase s':>7} {'rc bnd':>7} {'of lim %':>8}")
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
                        f"{p['vdnn']['pct_ideal']:6.1f} {p['checkpoint']['pct_ideal']:6.1f} "
                        f"{p['swap_only']['pct_ideal']:6.1f} {p['swapadvisor']['pct_ideal']:6.1f} "
                        f"{100 * p['swapadvisor']['recompute_share']:5.1f} "
                        f"{100 * p['swapadvisor']['split_share']:5.1f} "
                        f"{row['size_classes_pct_ideal']:6.1f} "
                        f"{row['speedup_vs_best_baseline']:7.2f} "
                        f"{p['swapadvisor']['bytes_swapped'] / 1e9:7.1f} "
                        f"{p['swapadvisor']['planning_s']:6.1f} "
                        f"{row['transfer_bound_s']:7.3f} {row['phase_bound_s']:7.3f} "
                        f"{row['limit_recompute_s']:7.3f} {row['of_limit_pct']:8.1f}")
                lines.append(line)
                print(line, flush=True)
            if preset == "gtx1080ti":
                plot(model, rows, curves, os.path.join(RESULTS, f"swap_{model}.png"))
    targets = evaluate_targets(results)
    for t in targets:
        line = f"target {t['target']}: {t['status']}" + (f" ({t['detail']})" if t["detail"]
                                                          else "")
        lines.append(line)
        print(line, flush=True)
    with open(args.output, "w") as f:
        json.dump({"cases": results, "time_budget_s": args.time_budget, "seed": args.seed,
                   "targets": targets, "table": lines}, f, indent=1)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
