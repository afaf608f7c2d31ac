"""Partitioning benchmark: Tofu search vs data parallel, Megatron and the exact optimum.

For training graphs of gpt, resnet and mlp at several sizes and k in {2, 3, 4, 8}, on the NVLink
and PCIe presets (and, for k = 8, two nodes of four GPUs: PCIe between, NVLink inside): bytes
each device sends per iteration, per-device peak memory (k * peak / single-device peak, and the
ratio to single-device peak / k + what the plan replicates), predicted compute, communication
and iteration time, search time.
Batch sizes are multiples of 24 so that every k here divides them. Checks the targets:

* ours communicates no more than the best baseline (data parallel, Megatron) in every case
  (bytes per device on one link type; communication time on the two-level PCIe/NVLink
  topology);
* ours equals the exact optimum (same objective) wherever the exact solver can run;
* per-device peak at most 1/k of the single-device peak plus what the plan replicates at its
  peak (replicated tensors, gathered copies);
* search for k=8 on the 24-layer gpt "large" training graph in at most 10 s.

ZeRO (`--zero`, also run by default): AdamW optimizer steps (the update in the graph, the
optimizer state as arguments) at k = 2, 4, 8 on NVLink: the bytes each device sends and its
peak for ours, data parallelism and ZeRO stages 1-3 (each planned in the same cost model, the
updates' splits chosen under the stage's layouts; and each stage's closed form), written to
benchmarks/results/partition_zero.json. Ours must send no more than the best of them.

Usage: python benchmarks/partition.py [--quick] [--zero] [--out benchmarks/results/partition.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from tvm_ext.driver import partition_problem
from tvm_ext.models import get_model
from tvm_ext.models.optimizer import Optimizer, make_optimizer_step
from tvm_ext.partition import NotApplicable, TableTooLarge, plan_partition, zero_bytes

STRATEGIES = ("tofu", "data_parallel", "megatron", "exact")
BASELINES = ("data_parallel", "megatron")
KS = (2, 3, 4, 8)
LINKS = ("nvlink", "pcie")
# Two nodes of four GPUs: PCIe between the nodes (the first cut), NVLink inside.
TOPOLOGIES = {"2pcie*4nv": [(2, "pcie"), (4, "nvlink")]}

# (model, size, overrides): a small-weight large-batch MLP (data parallel regime), a
# large-weight small-batch MLP (Megatron regime), transformers and CNNs of growing size.
CONFIGS = [
    ("mlp", "small", dict(batch=1536)),
    ("mlp", "large", dict(batch=24, layers=4)),
    ("gpt", "small", dict(batch=24)),
    ("gpt", "medium", dict(batch=24)),
    ("gpt", "large", dict(batch=24)),
    ("resnet", "small", dict(batch=24)),
    ("resnet", "medium", dict(batch=24)),
]
QUICK = [CONFIGS[0], CONFIGS[1], CONFIGS[2], CONFIGS[5]]
TIME_TARGET_S = 10.0


def run_config(name: str, size: str, overrides: dict, ks=KS, links=LINKS) -> list[dict]:
    start = time.perf_counter()
    problem = partition_problem(get_model(name, size, training=True, **overrides))
    analyze_s = time.perf_counter() - start
    label = f"{name}-{size}" + "".join(f" {k}={v}" for k, v in overrides.items())
    rows = []
    for k in ks:
        cases = [(link, dict(link=link)) for link in links]
        cases += [(name, dict(topology=topo)) for name, topo in TOPOLOGIES.items()
                  if _devices(topo) == k]
        for link, where in cases:
            row = {"model": label, "ops": len(problem.graph.ops), "k": k, "link": link,
                   "analyze_s": analyze_s}
            for strategy in STRATEGIES:
                try:
                    plan = plan_partition(problem, k, strategy=strategy, **where)
                except (NotApplicable, TableTooLarge) as err:
                    row[strategy] = {"error": str(err)}
                    continue
                s = plan.summary()
                row[strategy] = {
                    "bytes_per_device": plan.bytes_per_device,
                    "comm_time_s": plan.comm_time,
                    "latency_time_s": plan.latency_time,
                    "compute_time_s": plan.compute_time,
                    "iteration_time_s": plan.iteration_time,
                    "objective": plan.objective,
                    "peak_bytes_per_device": plan.peak_bytes_per_device,
                    "single_device_peak": plan.single_device_peak,
                    "replicated_at_peak": plan.replicated_at_peak,
                    "memory_bound": plan.memory_bound,
                    "memory_ratio": plan.memory_ratio,
                    "peak_fraction": plan.peak_bytes_per_device / plan.single_device_peak,
                    "replicated_ops": s["replicated_ops"],
                    "search_s": plan.search_seconds,
                    "collectives": plan.collectives,
                }
            rows.append(check_row(row))
            print(format_row(row), flush=True)
    return rows


def _devices(topology) -> int:
    n = 1
    for parts, _ in topology:
        n *= parts
    return n


def check_row(row: dict) -> dict:
    """Ours against the best baseline: by bytes on one link type, by communication time on a
    mixed topology (where fewer bytes over the slow link can be worth more in total); against
    the exact optimum by the objective both minimise."""
    ours = row["tofu"]
    metric = "bytes_per_device" if row["link"] in LINKS else "comm_time_s"
    base = [row[b][metric] for b in BASELINES if "error" not in row[b]]
    best = min(base) if base else None
    row["compared_by"] = metric
    row["best_baseline"] = best
    row["ours_le_best"] = best is None or ours[metric] <= best * (1 + 1e-9) + 1e-12
    exact = row["exact"]
    if "error" in exact:
        row["equals_exact"] = None
    else:
        a, b = ours["objective"], exact["objective"]
        row["equals_exact"] = abs(a - b) <= 1e-9 * max(abs(a), abs(b)) + 1e-18
    row["memory_ok"] = ours["memory_ratio"] <= 1.0 + 1e-9
    return row


def _mb(x: float) -> str:
    return f"{x / 1e6:10.2f}"


def format_row(row: dict) -> str:
    cells = [f"{row['model']:<24s}", f"{row['k']:>2d}", f"{row['link']:<9s}"]
    for s in STRATEGIES:
        r = row[s]
        cells.append(f"{'n/a':>10s}" if "error" in r else _mb(r["bytes_per_device"]))
    ours = row["tofu"]
    cells += [
        f"{ours['iteration_time_s'] * 1e3:9.3f}",
        f"{ours['peak_bytes_per_device'] / 1e9:8.3f}",
        f"{ours['peak_fraction'] * row['k']:6.2f}",
        f"{ours['memory_ratio']:5.2f}",
        f"{ours['search_s']:6.2f}",
        "yes" if row["ours_le_best"] else "NO",
        {None: "-", True: "yes", False: "NO"}[row["equals_exact"]],
    ]
    return " | ".join(cells)


HEADER = " | ".join([f"{'model':<24s}", " k", f"{'link':<9s}", "  tofu MB", "    DP MB",
                     "  Megt MB", " exact MB", " iter ms", " peak GB", " k*pk/1",
                     "ratio", "search", "<=base", "=exact"])


def time_target() -> dict:
    """Search time for k=8 on the 24-layer gpt large training graph (default batch)."""
    model = get_model("gpt", "large", training=True)
    start = time.perf_counter()
    problem = partition_problem(model)
    analyze_s = time.perf_counter() - start
    plan = plan_partition(problem, 8, link="nvlink")
    return {"model": "gpt-large (24 layers, batch 8)", "ops": len(problem.graph.ops),
            "analyze_s": analyze_s, "search_s": plan.search_seconds,
            "bytes_per_device": plan.bytes_per_device, "target_s": TIME_TARGET_S,
            "ok": plan.search_seconds <= TIME_TARGET_S}


ZERO_STRATEGIES = ("tofu", "data_parallel", "zero1", "zero2", "zero3")
ZERO_CONFIGS = [CONFIGS[0], CONFIGS[1], CONFIGS[2], CONFIGS[3], CONFIGS[5]]
ZERO_KS = (2, 4, 8)


def zero_rows(configs=ZERO_CONFIGS, ks=ZERO_KS) -> list[dict]:
    """Ours against data parallelism and ZeRO 1-3 on AdamW optimizer steps (see the module
    docstring)."""
    rows = []
    for name, size, overrides in configs:
        step = make_optimizer_step(get_model(name, size, training=True, **overrides),
                                   Optimizer("adamw"))
        problem = partition_problem(step)
        g = problem.graph
        trained = sum(g.tensors[g.base(t.id)].nbytes for t in g.tensors
                      if t.overwrites is not None and g.tensors[g.base(t.id)].kind == "parameter")
        label = f"{name}-{size}" + "".join(f" {k}={v}" for k, v in overrides.items())
        for k in ks:
            row = {"model": label, "k": k, "trained_bytes": trained,
                   "state_bytes": g.bytes_of_kind("state")}
            for strategy in ZERO_STRATEGIES:
                try:
                    plan = plan_partition(problem, k, strategy=strategy, link="nvlink")
                except NotApplicable as err:
                    row[strategy] = {"error": str(err)}
                    continue
                stage = 0 if strategy == "data_parallel" else int(strategy[-1]) \
                    if strategy.startswith("zero") else None
                row[strategy] = {
                    "bytes_per_device": plan.bytes_per_device,
                    "closed_form_bytes": None if stage is None else zero_bytes(trained, k,
                                                                               stage),
                    "peak_bytes_per_device": plan.peak_bytes_per_device,
                    "comm_time_s": plan.comm_time}
            base = [row[s]["bytes_per_device"] for s in ZERO_STRATEGIES[1:]
                    if "error" not in row[s]]
            row["ours_le_best"] = not base or row["tofu"]["bytes_per_device"] <= \
                min(base) * (1 + 1e-9) + 1e-12
            rows.append(row)
            print(format_zero_row(row), flush=True)
    return rows


ZERO_HEADER = " | ".join([f"{'model (AdamW step)':<28s}", " k", "  tofu MB", "    DP MB",
                          "    Z1 MB", "    Z2 MB", "    Z3 MB", "DP/Z1/Z2/Z3 closed MB",
                          "tofu pk GB", " DP pk GB", " Z3 pk GB", "<=base"])


def format_zero_row(row: dict) -> str:
    def mb(s, key="bytes_per_device"):
        r = row[s]
        return f"{'n/a':>9s}" if "error" in r else f"{r[key] / 1e6:9.2f}"

    closed = "/".join("n/a" if "error" in row[s] else f"{row[s]['closed_form_bytes'] / 1e6:.2f}"
                      for s in ZERO_STRATEGIES[1:])
    gb = {s: ("n/a" if "error" in row[s] else f"{row[s]['peak_bytes_per_device'] / 1e9:.3f}")
          for s in ("tofu", "data_parallel", "zero3")}
    return " | ".join([f"{row['model']:<28s}", f"{row['k']:>2d}",
                       *(mb(s) for s in ZERO_STRATEGIES), f"{closed:>21s}",
                       f"{gb['tofu']:>10s}", f"{gb['data_parallel']:>9s}",
                       f"{gb['zero3']:>9s}", "yes" if row["ours_le_best"] else "NO"])


def main_zero(out: Path, quick: bool) -> int:
    print("AdamW optimizer steps: bytes sent per device per step (MB), planned in the cost "
          "model and ZeRO's closed form; peak per device")
    print(ZERO_HEADER)
    rows = zero_rows(ZERO_CONFIGS[:2] + ZERO_CONFIGS[2:3] if quick else ZERO_CONFIGS)
    summary = {"cases": len(rows), "ours_le_best": sum(r["ours_le_best"] for r in rows)}
    print(f"ours <= best of data parallel and ZeRO 1-3: {summary['ours_le_best']}/"
          f"{summary['cases']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0 if summary["ours_le_best"] == summary["cases"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small configurations only")
    parser.add_argument("--zero", action="store_true",
                        help="only the ZeRO comparison on AdamW optimizer steps")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "partition.json"))
    args = parser.parse_args(argv)
    zero_out = Path(args.out).with_name("partition_zero.json")
    if args.zero:
        return main_zero(zero_out, args.quick)
    print("bytes sent per device per iteration (MB); iter = predicted compute + communication "
          "of ours; k*pk/1 = k * peak per device / single-device peak; ratio = peak / bound")
    print(HEADER)
    rows = []
    for name, size, overrides in (QUICK if args.quick else CONFIGS):
        rows += run_config(name, size, overrides)
    target = None if args.quick else time_target()
    if target:
        print(f"\nsearch time, k=8, {target['model']}, {target['ops']} ops: "
              f"{target['search_s']:.2f} s (target <= {TIME_TARGET_S} s; analysis "
              f"{target['analyze_s']:.2f} s)")
    summary = {
        "cases": len(rows),
        "ours_le_best_baseline": sum(r["ours_le_best"] for r in rows),
        "exact_computed": sum(r["equals_exact"] is not None for r in rows),
        "equals_exact": sum(bool(r["equals_exact"]) for r in rows),
        "memory_ok": sum(r["memory_ok"] for r in rows),
        "time_target": target,
    }
    print(f"ours <= best baseline: {summary['ours_le_best_baseline']}/{summary['cases']}; "
          f"equal to exact: {summary['equals_exact']}/{summary['exact_computed']}; "
          f"peak <= bound: {summary['memory_ok']}/{summary['cases']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"platform": platform.platform(), "python": sys.version,
                               "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {out}")
    print()
    return main_zero(zero_out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
