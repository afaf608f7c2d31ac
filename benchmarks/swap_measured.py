"""Swapping measured on the CPU stand-in with an emulated host link, beside the simulator.

On the stand-in (cpu:0 the device, cpu:1 the host) a copy is a memcpy within one memory, far
faster relative to the kernels than PCIe is relative to a GPU: no measurement would tell a good
plan from a bad one. Here the runtime library paces every device<->host copy to an emulated
link (src/swap/link_emulation.h): by default the H100 preset's PCIe 5 link slowed by the factor
this CPU is slower than the H100 preset on the same graph (`tvm_ext.cost.emulation`), so that
the ratio of copy to compute time is an H100's. Per model:

1. kernels timed alone (`measure_kernels`), the unswapped build timed (pooled allocator), the
   VM's per-kernel dispatch overhead from the difference, or, where the run was faster than the
   kernels timed alone (resnet: their inputs in cache in the run), the kernels scaled down to
   it (`cost.calibration.fit_to_iteration`);
2. the link scaled from the preset, and the swap runtime's own costs measured with it (issuing
   a copy to a stream idle for a given time, a stalled caller's resume delay, pacing overshoot:
   `driver.measure_runtime_costs`); the planners plan with all of these (`driver.stand_in`);
3. for each memory pressure (budget = no-swap peak / ratio) and planner (swapadvisor with
   recompute and splitting, swap_only: the first phase of the same search, checkpoint, vdnn,
   lru): plan, build, run with the link
   on: measured time (median of --repeat), the simulated time of the same plan, the error,
   the unswapped build timed beside it, call for call in alternation (`base ms`), and the
   error against the
   plan simulated with the compute at the speed that run measured, the link unchanged (`err*`;
   this machine's speed drifts by 10-50% within minutes), measured and simulated % of ideal (ideal:
   the unswapped run beside it, or the simulator's no-swap iteration), the fraction of copy
   time hidden under compute (measured: the runtime's count; simulated: copy time outside
   compute stalls), and whether the outputs equal the
   unswapped build's (exactly, or within the float tolerance of their dtype where the plan runs
   ops in chunks that may round differently, kernels that reduce: `swap.exactness`). `ovs us`
   is how late the run's paced copies ended on average: far above the calibrated overshoot,
   another process held the copy workers' core (a disturbed run, not a modelling error). The
   unswapped run's line says how much of its time its thread was on a core: well below 100%,
   other processes held it, and every figure calibrated from it (the dispatch overhead, so the
   simulated compute) is off.

Compute runs on one thread (TVM_NUM_THREADS=1, set here unless given), pinned to one core, and
the copy streams' workers are pinned to the other (`driver.dedicated_copy_cpu`), as a GPU's copy
engines are not its SMs; with two threads the BLAS and TVM thread pools and the copy workers
contend for two cores and single kernels stall for milliseconds (seen here: 16 ms for a 0.3 ms
GEMM).

What was found and fixed where simulated and measured disagreed (see benchmarks/README.md):
* the copy workers shared the cores with the compute: a worker woken while the caller ran a
  kernel (its copy's dependency done, or the caller resumed by the copy it had just finished)
  waited in that core's run queue until the kernel ended, up to 1.7 ms with its stream idle;
  18 of 49 back-to-back swap-ins of one mlp run at 12x started 0.2-1.2 ms late (15 ms of its
  98 ms, simulated 73 ms). The workers now have a CPU of their own and the compute the other
  (`driver.dedicated_copy_cpu`): the same plan measured 80 ms, simulated 79 ms;
* the pass made the compute wait for a swap-out before issuing a swap-in into the same memory;
  the runtime already orders such copies on their streams, so the wait is gone (the simulator
  always had only the swap-in wait): compute stalls on the d2h stream fell from 22 to 4 ms in
  one LRU run of mlp;
* the simulator had no cost for the runtime itself: issuing a copy to an idle stream takes
  ~25-45 us of the compute thread here (waking the stream's worker; a nested VM makes wake-ups
  expensive), a stalled stream resumes ~10-60 us after its event, and a paced copy ends
  ~25-60 us after its deadline; they are measured per run and simulated (0 on GPU presets);
* handing a copy to an idle stream costs more the longer the stream slept (6-12 us after
  10-100 us idle, 30-140 us after 0.5-4 ms: a halted core wakes slowly on this VM) and the
  copy starts before the hand-over returns; measuring it at one idle time (0.5 ms) and
  charging that to every copy made the tiny ViT's runs simulate 2-3x slower than measured. The
  hand-over is measured at several idle times and simulated by each stream's idle time;
* the naive allocator maps fresh pages at every call (a 1 MiB transpose took 0.25 ms in the VM,
  0.07 ms alone): timing runs use the pooled allocator, and the kernels' remaining dispatch
  overhead is calibrated from the unswapped run;
* kernel times measured with both cores in use were off by up to 70x (thread pools
  contending): one compute thread;
* on a loaded machine the unswapped baseline is slowed more than the swapped runs (its busy
  thread gets a fair share of a core, while a thread that sleeps in waits is favoured when it
  wakes): the unswapped run's share of a core is printed; far below 100% the row's figures are
  a loaded machine's, not the model's.

    python benchmarks/swap_measured.py [--quick] [--models mlp,gpt,gpt2_eager,...]
        [--ratios 2,4,8,12] [--planners swapadvisor,swap_only,checkpoint,vdnn,lru]
        [--preset h100] [--repeat 7]

Prints a table; writes benchmarks/results/swap_measured.json and, for the first model, the
planned timeline and the simulated vs measured timelines of SwapAdvisor at 4x as PNGs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))

PLANNERS = ("swapadvisor", "swap_only", "checkpoint", "vdnn", "lru")
# Zoo models (training steps, deepened as in benchmarks/swap_offload.py so that the lower
# budgets are feasible: one op's working set is a small part of the no-swap peak) and
# third-party models of tests/corpus (training steps of their tiny configs).
ZOO = {"mlp": ("mlp", "small", {"layers": 16}), "gpt": ("gpt", "small", {"layers": 8}),
       "resnet": ("resnet", "small", {"blocks": (4, 4, 4)})}
# Third-party models of tests/corpus at a benchmark's size (their tiny configs run each
# kernel in microseconds, as fast as the runtime hands a copy to its worker, and faster than
# the H100 preset's launch overheads: the scaled link is then faster than PCIe and the
# runtime's own costs are all there is to measure): corpus builder and its arguments.
CORPUS = {"gpt2_small": ("gpt2", {"attn": "eager", "hidden": 256, "layers": 4, "seq": 64}),
          "bert_small": ("bert", {"attn": "eager", "hidden": 256, "layers": 4, "seq": 64}),
          "vit_small": ("vit", {"hidden": 256, "layers": 4, "image": 32}),
          "resnet_small": ("resnet", {"widths": (32, 64, 128), "depth": 2, "image": 64})}
QUICK = {"models": "mlp,gpt2_small", "ratios": "2,8"}


def load(name: str, workdir: str):
    from tvm_ext.models import get_model, load_model

    if name in ZOO:
        zoo, size, overrides = ZOO[name]
        return get_model(zoo, size, training=True, **overrides)
    import corpus

    base, sizes = CORPUS[name]
    kind = corpus.BY_NAME[f"{base}_eager" if "attn" in sizes else base].kind
    entry = corpus.CorpusModel(name, getattr(corpus, base)(**sizes), kind)
    path, _ = corpus.export(entry, workdir)
    return load_model(path, training=True)


def calibrate(model, graph, target, preset: str, repeat: int):
    """Kernel times, a call of the unswapped build (timed beside every swapped run), its
    measured run, and the stand-in (link, runtime costs) of one model."""
    from tvm_ext import driver
    from tvm_ext.ir.targets import vm_devices

    device, _ = vm_devices(target)
    timings = driver.measure_kernels(model, target, graph, number=5, repeat=5)
    plain_exe = driver.build(model, target)
    plain = driver.measure_run(plain_exe, model.random_arguments(0), device, repeat=repeat)
    stand = driver.stand_in(graph, timings, preset=preset, iteration_s=plain.median_ms * 1e-3)
    return driver.unswapped_call(plain_exe, model.random_arguments(0), device), plain, stand


def run_plan(model, graph, target, problem, plan, plain, plain_call, repeat: int) -> dict:
    """Build and run one plan with the link on; the simulated and measured figures."""
    from tvm_ext import driver
    from tvm_ext.ir.targets import vm_devices
    from tvm_ext.models.reference import tolerance
    from tvm_ext.swap import simulate
    from tvm_ext.swap.exactness import inexact_splits
    from tvm_ext.swap.measured import compare
    from tvm_ext.swap.placement import argument_devices

    device, host = vm_devices(target)
    executable = driver.build(model, target, swap_plan=plan)
    run = driver.measure_run(executable, model.random_arguments(0), device, host=host,
                             arg_devices=argument_devices(graph, plan), repeat=repeat,
                             beside=plain_call)
    sim = simulate(problem, plan)
    timeline = driver.timeline_of(run, graph, plan)
    cmp = compare(problem, plan, sim, timeline)
    inexact = inexact_splits(graph, plan)
    same = len(run.outputs) == len(plain.outputs)
    exact = same and all(np.array_equal(a, b)
                         for a, b in zip(run.outputs, plain.outputs, strict=True))
    # Kernels that reduce, run in chunks, may round differently (`swap.exactness`).
    agrees = exact or (bool(inexact) and same and all(
        np.allclose(a, b, *tolerance(a.dtype))
        for a, b in zip(run.outputs, plain.outputs, strict=True)))
    return {"simulated_ms": sim.makespan * 1e3, "measured_ms": run.median_ms,
            "error": run.median_ms / (sim.makespan * 1e3) - 1.0, "exact": exact,
            "agrees": agrees, "inexact_splits": inexact,
            "hidden_measured": run.hidden_fraction, "hidden_simulated": cmp["simulated_hidden"],
            "swap_outs": len(plan.swap_outs), "swap_ins": len(plan.swap_ins),
            "bytes_swapped": plan.bytes_swapped, "base_ms": run.beside_median_ms,
            "run": run.summary(), "lanes": cmp,
            "_sim": sim, "_timeline": timeline}


def run_model(name: str, args, workdir: str) -> tuple[dict, list[dict]]:
    import tvm

    from tvm_ext import driver
    from tvm_ext.runtime import swap_streams

    target = tvm.target.Target("llvm")
    model = load(name, workdir)
    graph = driver.fused_graph(model, target)
    plain_call, plain, stand = calibrate(model, graph, target, args.preset, args.repeat)

    def planned(budget, planner: str) -> driver.SwapPlanning:
        """The plan for the kernel times measured here (so of the fused kernels)."""
        return driver.plan_swap(model, target, budget, hardware=stand.hardware,
                                op_times=stand.op_times, planner=planner, seed=0,
                                time_budget_s=args.search_s, graph=graph)

    base = planned("100%", "ideal").problem
    ideal_ms = float(np.sum(stand.op_times)) * 1e3
    info = {"model": name, "ops": graph.num_ops, "plain_ms": plain.median_ms,
            "plain_cpu_share": plain.cpu_share,
            "ideal_simulated_ms": ideal_ms, "no_swap_peak": base.no_swap_peak(),
            "min_budget": base.min_budget()[0], **stand.summary()}
    fit = (f"dispatch {stand.dispatch_overhead * 1e6:.0f} us per kernel"
           if stand.kernel_scale == 1.0 else f"kernels x{stand.kernel_scale:.2f}")
    print(f"# {name}: {graph.num_ops} ops, unswapped {plain.median_ms:.2f} ms measured (on a "
          f"core {plain.cpu_share:.0%} of it), {ideal_ms:.2f} ms simulated ({fit}); link "
          f"{stand.link.bandwidth / 1e9:.3g} GB/s, "
          f"{stand.link.latency * 1e6:.0f} us ({args.preset} / {stand.scale:.1f}); hand-over "
          f"to a stream idle for {_wake_text(stand.costs.wake)}; resume "
          f"{stand.costs.sync * 1e6:.0f} us, overshoot {stand.costs.overshoot * 1e6:.0f} us",
          flush=True)
    rows = []
    swap_streams.set_emulated_link(stand.link.bandwidth, stand.link.latency)
    try:
        for ratio in args.ratios:
            budget = int(base.no_swap_peak() / ratio)
            if budget < base.min_budget()[0]:
                rows.append({"model": name, "ratio": ratio, "budget": budget,
                             "infeasible": True})
                print(format_row(rows[-1]), flush=True)
                continue
            searched: dict = {}  # both phases of one search: swap-only, then recompute
            for planner in args.planners:
                if planner in ("swapadvisor", "swap_only") and not searched:
                    planning = planned(budget, "swapadvisor")
                    searched = dict(zip(("swap_only", "swapadvisor"), planning.phases,
                                        strict=True))
                if planner not in searched:
                    planning = planned(budget, planner)
                problem, plan = planning.problem, searched.get(planner) or planning.plan
                row = {"model": name, "ratio": ratio, "budget": problem.budget,
                       "planner": planner,
                       **run_plan(model, graph, target, problem, plan, plain, plain_call,
                                  args.repeat)}
                beside(row, plain.median_ms, ideal_ms,
                       at_speed(problem, plan, row["base_ms"] / plain.median_ms))
                rows.append(row)
                print(format_row(row), flush=True)
                if args.plots and planner == "swapadvisor" and ratio == args.plot_ratio:
                    plot(name, problem, plan, row)
    finally:
        swap_streams.set_emulated_link(0.0)
    args.plots = False  # one model's pictures
    return info, rows


def _wake_text(wake) -> str:
    """'5 us: 7 us (copy from 9 us), ...' from (idle, issue, start) points in seconds."""
    return ", ".join(f"{i * 1e6:.0f} us: {c * 1e6:.0f} us (copy from {s * 1e6:.0f} us)"
                     for i, c, s in wake)


def at_speed(problem, plan, speed: float) -> float:
    """The plan simulated (ms) with the compute `speed` times as slow as at the calibration;
    the link and the runtime's costs as they were (the copies are paced in wall time)."""
    import dataclasses

    from tvm_ext.swap import simulate

    slowed = dataclasses.replace(problem, durations=problem.durations * speed)
    return simulate(slowed, plan).makespan * 1e3


def beside(row: dict, calibrated_ms: float, ideal_ms: float,
           simulated_at_speed_ms: float) -> None:
    """Add to `row` the figures against the unswapped run timed beside it (`base_ms`: its calls
    alternate with the swapped run's): this machine's speed drifts by 10-50% within minutes
    (other tenants of its host), and the simulator's durations are those of the calibration
    (`calibrated_ms`). `error_rescaled` is the error against the plan simulated with the
    compute at the speed the run beside it measured (`at_speed`); measured % of ideal is
    against the unswapped run beside it."""
    base_ms = row["base_ms"]
    row["speed"] = base_ms / calibrated_ms
    row["simulated_at_speed_ms"] = simulated_at_speed_ms
    row["error_rescaled"] = row["measured_ms"] / simulated_at_speed_ms - 1.0
    row["measured_pct_ideal"] = 100.0 * base_ms / row["measured_ms"]
    row["simulated_pct_ideal"] = 100.0 * ideal_ms / row["simulated_ms"]


def plot(name: str, problem, plan, row: dict) -> None:
    import dataclasses

    from tvm_ext.swap.measured import simulated_lanes
    from tvm_ext.swap.timeline_plot import plot_plan, plot_timelines

    stem = RESULTS / f"swap_measured_{name}"
    plot_plan(dataclasses.replace(problem, name=name), plan, f"{stem}_planned.png")
    plot_timelines(f"{stem}_timelines.png", [
        (f"simulated: {row['simulated_ms']:.2f} ms", simulated_lanes(problem, plan, row["_sim"])),
        (f"measured: {row['measured_ms']:.2f} ms (median; the traced call "
         f"{row['run']['traced_ms']:.2f} ms)", row["_timeline"].lanes)],
        title=f"{name}, swapadvisor, budget = no-swap peak / {row['ratio']:g}, emulated link")


HEADER = (f"{'model':14} {'ratio':>5} {'planner':12} {'sim ms':>8} {'meas ms':>8} {'err':>7} "
          f"{'base ms':>8} {'err*':>7} {'sim %id':>7} {'meas %id':>8} {'hid sim':>7} "
          f"{'hid meas':>8} {'copies':>6} {'ovs us':>6} exact")


def format_row(r: dict) -> str:
    if r.get("infeasible"):
        return f"{r['model']:14} {r['ratio']:5g} infeasible: budget below one op's working set"
    base = f"{r['base_ms']:8.2f} {r['error_rescaled']:+7.1%}" if "base_ms" in r else \
        f"{'-':>8} {'-':>7}"
    return (f"{r['model']:14} {r['ratio']:5g} {r['planner']:12} {r['simulated_ms']:8.2f} "
            f"{r['measured_ms']:8.2f} {r['error']:+7.1%} {base} {r['simulated_pct_ideal']:7.1f} "
            f"{r['measured_pct_ideal']:8.1f} {r['hidden_simulated']:7.2f} "
            f"{r['hidden_measured']:8.2f} {r['swap_outs'] + r['swap_ins']:6d} "
            f"{r['run']['mean_overshoot_us']:6.0f} {_agreement(r)}")


def _agreement(r: dict) -> str:
    """yes: bit-identical; tol: within float tolerance where library GEMMs ran in chunks."""
    return "yes" if r["exact"] else "tol" if r["agrees"] else "NO"


def _slowdown(r: dict) -> float:
    """A run's measured time, over the unswapped run beside it where there is one."""
    return r["measured_ms"] / r["base_ms"] if "base_ms" in r else r["measured_ms"]


def summarize(rows: list[dict]) -> list[str]:
    """The targets: error within 15%, planners ranked alike, SwapAdvisor vs the baselines."""
    runs = [r for r in rows if not r.get("infeasible")]
    if not runs:
        return ["no feasible case"]
    within = sum(abs(r["error"]) <= 0.15 for r in runs)
    lines = [f"simulated vs measured within 15%: {within}/{len(runs)} "
             f"(largest error {max(abs(r['error']) for r in runs):.1%})"]
    if all("error_rescaled" in r for r in runs):
        lines.append(
            f"the same, simulated with the compute at the speed the unswapped run beside "
            f"each measured (err*): "
            f"{sum(abs(r['error_rescaled']) <= 0.15 for r in runs)}/{len(runs)} (largest "
            f"{max(abs(r['error_rescaled']) for r in runs):.1%}; speed "
            f"{min(r['speed'] for r in runs):.2f}-{max(r['speed'] for r in runs):.2f}x the "
            f"calibration's)")
    cases: dict[tuple, dict] = {}
    for r in runs:
        cases.setdefault((r["model"], r["ratio"]), {})[r["planner"]] = r
    # Pairs of planners the simulator tells apart (more than 5%; vDNN and LRU often make the
    # same plan): does the measurement order them the same way?
    pairs = agree = 0
    for case in cases.values():
        for a, b in itertools.combinations(sorted(case), 2):
            sa, sb = case[a]["simulated_ms"], case[b]["simulated_ms"]
            if abs(sa - sb) > 0.05 * min(sa, sb):
                pairs += 1
                agree += (sa < sb) == (_slowdown(case[a]) < _slowdown(case[b]))
    lines.append(f"planners ranked alike measured and simulated: {agree}/{pairs} pairs the "
                 f"simulator tells apart by more than 5%")
    for (model, ratio), case in cases.items():
        sa = case.get("swapadvisor")
        base = [_slowdown(case[p]) for p in ("vdnn", "lru") if p in case]
        if sa and base and ratio in (4, 8):
            lines.append(f"{model} at {ratio:g}x: swapadvisor {sa['measured_pct_ideal']:.1f}% of "
                         f"ideal measured ({sa['simulated_pct_ideal']:.1f}% simulated), "
                         f"{min(base) / _slowdown(sa):.2f}x the best baseline measured")
    tol = sum(r["agrees"] and not r["exact"] for r in runs)
    lines.append(f"outputs exact: {sum(r['exact'] for r in runs)}/{len(runs)}, within float "
                 f"tolerance (ops run in chunks that round differently): {tol}, differing: "
                 f"{sum(not r['agrees'] for r in runs)}")
    return lines


def main(argv=None) -> int:
    # One compute thread (see the module docstring); TVM is imported after this, in the steps.
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"a small subset: models {QUICK['models']}, ratios {QUICK['ratios']}")
    p.add_argument("--models", default=None,
                   help=f"comma list of {', '.join([*ZOO, *CORPUS])}")
    p.add_argument("--ratios", default=None, help="memory pressures (default 2,4,8,12)")
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--preset", default="h100", help="hardware preset whose link is scaled")
    p.add_argument("--repeat", type=int, default=7, help="timed runs per build")
    p.add_argument("--search-s", type=float, default=5.0, help="SwapAdvisor search budget")
    p.add_argument("--plot-ratio", type=float, default=4.0)
    p.add_argument("--output", default=str(RESULTS / "swap_measured.json"))
    args = p.parse_args(argv)
    models = (args.models or (QUICK["models"] if args.quick
                              else ",".join([*ZOO, *CORPUS]))).split(",")
    unknown = [m for m in models if m not in ZOO and m not in CORPUS]
    if unknown:
        p.error(f"unknown models {unknown}; models: {', '.join([*ZOO, *CORPUS])}")
    args.ratios = [float(r) for r in (args.ratios or (QUICK["ratios"] if args.quick
                                                      else "2,4,8,12")).split(",")]
    args.planners = args.planners.split(",")
    args.plots = True
    RESULTS.mkdir(parents=True, exist_ok=True)
    from tvm_ext.driver import dedicated_copy_cpu

    start = time.perf_counter()
    infos, rows = [], []
    print(HEADER)
    # Calibration and runs alike: the copy workers on a CPU of their own (see the docstring).
    with dedicated_copy_cpu() as copy_cpu, tempfile.TemporaryDirectory() as workdir:
        for name in models:
            info, model_rows = run_model(name, args, workdir)
            infos.append(info)
            rows += model_rows
    lines = summarize(rows)
    table = [HEADER, *(format_row(r) for r in rows)]
    wall = time.perf_counter() - start
    load = os.getloadavg()[0]
    lines.append(f"wall {wall:.0f} s on {platform.node()} ({os.cpu_count()} cores, "
                 f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}, copy workers on CPU "
                 f"{copy_cpu if copy_cpu is not None else 'shared'}), load average {load:.1f}")
    print("\n".join(lines))
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    payload = {"models": infos, "rows": clean, "table": table, "summary": lines,
               "preset": args.preset, "quick": args.quick, "wall_s": wall,
               "load_average": load, "threads": os.environ["TVM_NUM_THREADS"],
               "copy_cpu": copy_cpu}
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, args.output)
    print(f"wrote {os.path.relpath(args.output, ROOT)}")
    return 0 if all(r.get("agrees", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
