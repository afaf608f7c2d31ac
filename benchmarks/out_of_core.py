"""Out-of-core training at real scale, planned and simulated: the AdamW step of a decoder of
Llama-3.2-1B's shape (hidden 2048, 16 layers, GQA 32/8, SwiGLU 8192, vocabulary 128256, tied
head; 1.24B parameters), batch 4 x 1024, in float32 and in bf16 with float32 master weights,
parameters, gradients and optimizer state counted, under device budgets of 1/2, 1/4 and 1/8
of the step's no-swap peak.

The model is a `transformers` LlamaForCausalLM built from that config (random weights),
exported with `torch.export`, imported and turned into the whole AdamW iteration as
benchmarks/vs_torch_gpu.py prepares it (forward, cross-entropy, backward, the update in place),
fused for CUDA (sm_90) as the pipeline fuses it. Each budget is planned by every planner
(`swapadvisor`: the joint schedule / swap / recompute / split search, within the wall-clock
budget `--time-budget` for the whole search, 10 s by default; `swap_only`: its first phase;
`checkpoint`, `vdnn`, `lru`) and simulated on the h100 and h200 presets (roofline op times,
PCIe 5), beside the ideal (the unswapped step, unbudgeted) and the bounds of
benchmarks/swap.py: the link bound (the bytes above the budget out and back over the link) and
the phase bound, with and without recompute. `plan s` is the wall time of the search on this
machine. With `--long-budget S` the SwapAdvisor search is run a second time with S seconds, to
show what a longer search would find (`SA long %`).

The plans run on a GPU beside PyTorch's own offloading (activation checkpointing,
`save_on_cpu`, FSDP2 with `CPUOffloadPolicy`) in benchmarks/out_of_core_gpu.py.

    python benchmarks/out_of_core.py [--size real] [--dtypes fp32,bf16] [--ratios 2,4,8]
        [--presets h100,h200] [--time-budget 10] [--long-budget 0] [--graphs DIR]

The fused graphs are kept in `--graphs` (default ~/.cache/tvm_ext/out_of_core) so that a
second run plans without exporting again. Prints a table, writes
benchmarks/results/out_of_core.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

RESULTS = os.path.join(HERE, "results")
MODEL = "llama"  # benchmarks/vs_torch.py's builder
# (batch, sequence) per size of benchmarks/vs_torch.py: "real" is the case above; "quick" a
# tiny decoder of the same structure, for the tests.
SHAPES = {"real": (4, 1024), "quick": (2, 16)}
PLANNERS = ("ideal", "lru", "vdnn", "checkpoint", "swap_only", "swapadvisor")
# In the cached graphs' file names: raise it whenever the pipeline fuses the step differently,
# so that no run plans a graph today's code would not build.
GRAPH_VERSION = 7


def build_graph(dtype: str, size_name: str, budgeted: bool = True):
    """The fused DataflowGraph of the AdamW step (and its parameter count): as a build under
    a device budget fuses it, or (`budgeted=False`) as the unswapped build does."""
    import torch
    import vs_torch
    from vs_torch_gpu_measure import loss_of
    from vs_torch_gpu_prepare import import_program, training_model

    from tvm_ext.driver import fused_graph
    from tvm_ext.runtime.cuda import cuda_target

    batch, seq = SHAPES[size_name]
    size = dict(vs_torch.model_size(MODEL, size_name, training=True), batch=batch, seq=seq,
                positions=seq)
    module, inputs = vs_torch.BUILDERS[MODEL](size)
    count = sum(p.numel() for p in module.parameters())
    with torch.no_grad():
        program = torch.export.export(module, inputs)
    del module
    imported = import_program(MODEL, program)
    del program
    step = training_model(imported.model, loss_of(MODEL), dtype)
    return fused_graph(step, cuda_target("sm_90"), budgeted=budgeted), count


def cached_graph(directory: str, dtype: str, size_name: str, log, budgeted: bool = True):
    from tvm_ext.graph import DataflowGraph

    batch, seq = SHAPES[size_name]
    kind = "" if budgeted else "_unswapped"
    path = os.path.join(directory, f"{MODEL}_{size_name}_{batch}x{seq}_adamw_{dtype}{kind}"
                                   f"_v{GRAPH_VERSION}.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        return DataflowGraph.from_dict(data["graph"]), data["parameters"]
    start = time.perf_counter()
    graph, count = build_graph(dtype, size_name, budgeted)
    log(f"# {dtype}{kind}: {graph.num_ops} ops, {count / 1e9:.2f}B parameters, graph built in "
        f"{time.perf_counter() - start:.0f} s")
    os.makedirs(directory, exist_ok=True)
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "w") as f:
        json.dump({"graph": graph.to_dict(), "parameters": count}, f)
    os.replace(temp, path)
    return graph, count


def long_search(problem, budget: int, seconds: float, seed: int) -> dict:
    from tvm_ext.swap.search import swapadvisor_phases

    plan = swapadvisor_phases(problem.with_budget(budget), time_budget_s=seconds,
                              seed=seed)[-1]
    return {"time_s": plan.predicted_time, "planning_s": plan.planning_time,
            "evaluations": plan.info.get("evaluations")}


def _row_line(dtype, preset, ratio, row) -> str:
    p = row["planners"]
    long = row.get("swapadvisor_long")
    long_pct = f"{100 * row['ideal_s'] / long['time_s']:7.1f}" if long else f"{'-':>7}"
    return (f"{dtype:5} {preset:5} {ratio:5g} {row['budget'] / 2**30:7.2f} "
            f"{row['no_swap_peak'] / 2**30:7.2f} {row['ideal_s']:7.3f} "
            f"{p['lru']['pct_ideal']:6.1f} {p['vdnn']['pct_ideal']:6.1f} "
            f"{p['checkpoint']['pct_ideal']:6.1f} {p['swap_only']['pct_ideal']:6.1f} "
            f"{p['swapadvisor']['pct_ideal']:6.1f} {long_pct} "
            f"{100 * p['swapadvisor']['recompute_share']:5.1f} "
            f"{p['swapadvisor']['bytes_swapped'] / 1e9:6.1f} "
            f"{p['swapadvisor']['planning_s']:6.1f} {row['transfer_bound_s']:7.3f} "
            f"{row['limit_recompute_s']:7.3f} {row['of_limit_pct']:8.1f}")


HEADER = (f"{'dtype':5} {'hw':5} {'ratio':>5} {'bud GiB':>7} {'peakGiB':>7} {'ideal s':>7} "
          f"{'lru %':>6} {'vdnn %':>6} {'ckpt %':>6} {'swap %':>6} {'SA %':>6} {'SAlong%':>7} "
          f"{'rc %':>5} {'SA GB':>6} {'plan s':>6} {'link s':>7} {'limit s':>7} "
          f"{'of lim %':>8}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SHAPES), default="real")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--ratios", default="2,4,8")
    ap.add_argument("--presets", default="h100,h200")
    ap.add_argument("--time-budget", type=float, default=10.0,
                    help="SwapAdvisor search budget per case (s): the whole search, "
                    "both phases")
    ap.add_argument("--long-budget", type=float, default=0.0,
                    help="also search each case this long (s; 0: no)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--graphs", default=os.path.expanduser("~/.cache/tvm_ext/out_of_core"))
    ap.add_argument("--output", default=os.path.join(RESULTS, "out_of_core.json"))
    args = ap.parse_args(argv)

    import swap
    from tvm_ext.swap import SwapProblem, plan_swaps

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results, lines = [], [HEADER, "-" * len(HEADER)]
    print(HEADER, flush=True)
    for dtype in args.dtypes.split(","):
        graph, count = cached_graph(args.graphs, dtype, args.size, log)
        step, _ = cached_graph(args.graphs, dtype, args.size, log, budgeted=False)
        for preset in args.presets.split(","):
            base = SwapProblem.from_graph(graph, 1 << 62, preset, name=f"{MODEL}-{dtype}")
            plain = SwapProblem.from_graph(step, 1 << 62, preset)
            unswapped = (plan_swaps(plain, "ideal").predicted_time, plain.no_swap_peak())
            for ratio in (float(r) for r in args.ratios.split(",")):
                row, _ = swap.run_case(base, ratio, args.time_budget, args.seed, unswapped)
                row.update(model=MODEL, size=args.size, dtype=dtype, preset=preset,
                           parameters=count, batch=SHAPES[args.size][0],
                           seq=SHAPES[args.size][1])
                if args.long_budget > 0:
                    row["swapadvisor_long"] = long_search(base, row["budget"],
                                                          args.long_budget, args.seed)
                results.append(row)
                line = _row_line(dtype, preset, ratio, row)
                lines.append(line)
                print(line, flush=True)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    temp = f"{args.output}.{os.getpid()}.tmp"
    with open(temp, "w") as f:
        json.dump({"cases": results, "time_budget_s": args.time_budget,
                   "long_budget_s": args.long_budget, "seed": args.seed, "table": lines,
                   "gpu_runs": "benchmarks/out_of_core_gpu.py (needs a GPU machine)"},
                  f, indent=1)
    os.replace(temp, args.output)
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
