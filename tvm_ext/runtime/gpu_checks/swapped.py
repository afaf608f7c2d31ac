"""Swapped builds (SwapOffload at several budgets) against the unswapped build of the same
model, run side by side on the device with arguments drawn here from the model's specs:

- the device peak the runtime library measured (plus the module's constants) within the budget;
- outputs bit-identical to the unswapped build's (same kernels, same order of arithmetic), or
  within the float tolerance of their dtype where the plan runs ops in chunks that may round
  differently (the budget's `inexact_splits`: kernels that reduce, run in chunks);
- time against the unswapped build, and the fraction of the copy time hidden behind compute:
  1 - (swapped - unswapped) / (the bytes the streams moved at the measured bandwidths); on the
  CPU stand-in the runtime also measures it directly (copy time while no caller waited);
- the module run again as a user runs it (`tvm_ext.runtime.load`), outputs bit for bit the same;
- the measured iteration against the swap simulator's, fed the kernel times measured here and
  the measured bandwidths; and the unswapped iteration call by call (each kernel timed in its
  place: in sequence against alone, and the time between calls). The simulator needs numba;
  where it is missing the figures it needs are kept and `scripts/gpu_bundle.py BUNDLE
  --finish RESULTS.json` adds the simulation.
"""

from __future__ import annotations

import dataclasses
import json
import statistics

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from ...errors import CheckError, InputError
from .. import swap_streams
from ..call_profile import profile_calls
from ..exported import load
from ..kernel_graphs import graph_stats, reset_graph_stats
from ..kernel_timing import kernel_arguments, time_kernel
from ..random_arrays import sample_all
from ..vm_run import compare, run
from .report import Failed, Skip
from .suite import SuiteRun

D2H, H2D = 0, 1  # SwapOffload's streams: swap-outs, swap-ins
# Timed calls run with the pooled allocator, as a deployment does (the first call, with the
# naive one, is the memory measurement): per-call cudaMalloc of every buffer is not the plan's.
TIME_WITH = "pooled"


def run_unswapped(suite: SuiteRun, spec: dict) -> dict:
    suite.swap_arguments = sample_all(spec["arguments"], spec["seed"])
    result = run(suite.module(spec["unswapped"]), suite.swap_arguments, suite.device,
                 repeat=spec["repeat"], time_with=TIME_WITH)
    suite.unswapped = result
    return {"model": spec["model"], "latency_ms": result.median_ms,
            "peak_bytes": result.peak_bytes + spec["constants_bytes"],
            "argument_bytes": result.argument_bytes, "no_swap_peak": spec["no_swap_peak"]}


def time_kernels(suite: SuiteRun, spec: dict) -> dict:
    """Every kernel of the model, alone on random arguments: what the simulator is fed."""
    module = suite.module(spec["unswapped"])
    rng = np.random.default_rng(0)
    missing = []
    for kernel in spec["kernels"]:
        args = kernel_arguments(kernel["params"], suite.device, rng)
        try:
            secs = time_kernel(module, kernel["name"], args, suite.device, number=1, repeat=3)
        except KeyError:
            missing.append(kernel["name"])
            continue
        suite.kernel_seconds[kernel["name"]] = statistics.median(secs)
    total = sum(suite.kernel_seconds.get(k["name"], 0.0) * k["calls"] for k in spec["kernels"])
    data = {"kernels": len(spec["kernels"]), "timed": len(suite.kernel_seconds),
            "sum_of_kernels_ms": total * 1e3, "seconds": dict(suite.kernel_seconds)}
    if suite.unswapped is not None:
        data["unswapped_iteration_ms"] = suite.unswapped.median_ms
        data["in_sequence"] = _in_sequence(suite, module)
        if spec.get("graphs"):
            data["with_graphs"] = _with_graphs(suite, spec)
    if missing:
        raise Failed(f"{len(missing)} kernels are not in the exported module: {missing[:5]}",
                     data)
    return data


def _with_graphs(suite: SuiteRun, spec: dict) -> dict:
    """The unswapped step built as a deployment is (no budget: each run of its kernels one CUDA
    graph) beside the twin the budgets are compared with (one launch per kernel); its outputs
    differ from the twin's by how an attention without a budget is fused."""
    reset_graph_stats()
    result = run(suite.module(spec["graphs"]), suite.swap_arguments, suite.device,
                 repeat=spec["repeat"], time_with=TIME_WITH)
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
               for a, b in zip(result.outputs, suite.unswapped.outputs, strict=True))
    return {"iteration_ms": result.median_ms, "max_abs_diff_from_twin": diff,
            "vs_twin": result.median_ms / suite.unswapped.median_ms, **graph_stats()}


def _in_sequence(suite: SuiteRun, module) -> dict:
    """The unswapped iteration call by call (`call_profile`): each kernel in its place, on its
    real arguments, against the sum of the kernels timed alone, and the time between calls."""
    vm = VirtualMachine(module, suite.device, memory_cfg=TIME_WITH)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), suite.device)
            for a in suite.swap_arguments]
    return profile_calls(vm, args, suite.device).summary()


def check_budget(suite: SuiteRun, spec: dict, entry: dict) -> dict:
    if suite.unswapped is None:
        raise Skip("the unswapped build did not run, so there is nothing to compare with")
    with open(suite.bundle.path(entry["sidecar"])) as f:
        sidecar = json.load(f)
    swap_streams.reset()
    result = run(suite.module(entry["module"]), suite.swap_arguments, suite.device,
                 repeat=spec["repeat"], host=suite.host,
                 arg_devices=sidecar["argument_devices"], time_with=TIME_WITH)
    calls = spec["repeat"] + 1
    base = suite.unswapped
    measured = result.peak_bytes + spec["constants_bytes"]
    data = {"budget_label": entry["label"], "budget": entry["budget"],
            "planned_peak": sidecar["plan"]["predicted_peak"], "measured_peak": measured,
            "host_peak": result.host_peak_bytes, "swapped_ms": result.median_ms,
            "unswapped_ms": base.median_ms, "slowdown": result.median_ms / base.median_ms,
            "predicted_ms": sidecar["plan"]["predicted_time"] * 1e3}
    plan = sidecar["plan"]
    data.update(planned_bytes_out=sum(c["nbytes"] for c in plan["swap_outs"]),
                planned_bytes_in=sum(c["nbytes"] for c in plan["swap_ins"]),
                planned_copies=len(plan["swap_outs"]) + len(plan["swap_ins"]))
    data.update(_overlap(suite, spec, calls, result.median_ms, base.median_ms))
    with open(suite.bundle.path(spec["problem"])) as f:
        problem = json.load(f)
    data.update(simulate_measured(problem, sidecar["plan"], suite.kernel_seconds,
                                  suite.bandwidth, base.median_ms / 1e3))
    if data["simulated_ms"]:
        data["measured_vs_simulated"] = result.median_ms / data["simulated_ms"]
    problems = []
    inexact = entry.get("inexact_splits") or []
    by_dtype = entry.get("tolerances", {})
    data["exact"] = not inexact
    data["inexact_splits"] = inexact
    try:
        compare(result.outputs, base.outputs,
                tolerances=[tuple(by_dtype.get(str(o.dtype), (0.0, 0.0))) if inexact
                            else (0.0, 0.0) for o in result.outputs])
    except CheckError as err:
        problems.append(f"outputs differ from the unswapped build: {err}")
    problems += _deployed(suite, entry, result.outputs, data)
    if measured > entry["budget"]:
        problems.append(f"measured peak {measured} bytes exceeds the budget {entry['budget']}")
    if problems:
        raise Failed("; ".join(problems), data)
    return data


def _deployed(suite: SuiteRun, entry: dict, outputs: list, data: dict) -> list[str]:
    """The module as a user runs it (`tvm_ext.runtime.load`: devices and argument placement
    from its sidecar) against the measured run's outputs, bit for bit."""
    try:
        module = load(suite.bundle.path(entry["module"]))
        if module.devices != [suite.device, suite.host]:
            return [f"tvm_ext.runtime.load runs it on {module.devices}, not "
                    f"{[suite.device, suite.host]}"]
        compare(module(*suite.swap_arguments), outputs, tolerances=[(0.0, 0.0)] * len(outputs))
    except (CheckError, InputError) as err:
        return [f"tvm_ext.runtime.load: {err}"]
    data["runtime_load"] = "outputs equal the measured run's"
    return []


def _overlap(suite: SuiteRun, spec: dict, calls: int, swapped_ms: float,
             unswapped_ms: float) -> dict:
    out, inn = swap_streams.stats(D2H), swap_streams.stats(H2D)
    if suite.bandwidth:  # measured by the copies check
        d2h_bw, h2d_bw = suite.bandwidth["d2h"], suite.bandwidth["h2d"]
    else:  # the preset the plan assumed
        d2h_bw, h2d_bw = spec["link"]["d2h_bytes_per_s"], spec["link"]["h2d_bytes_per_s"]
    copy_s = out.bytes / calls / d2h_bw + inn.bytes / calls / h2d_bw
    exposed_s = max(0.0, swapped_ms - unswapped_ms) / 1e3
    data = {"bytes_out_per_call": out.bytes // calls, "bytes_in_per_call": inn.bytes // calls,
            "copy_ms": copy_s * 1e3, "bandwidth": "measured" if suite.bandwidth else "preset",
            "overlap": min(1.0, max(0.0, 1 - exposed_s / copy_s)) if copy_s > 0 else None}
    busy = out.busy_ns + inn.busy_ns
    if out.timed and inn.timed and busy:  # CPU streams time their copies themselves
        data["overlap_runtime"] = (out.overlap_ns + inn.overlap_ns) / busy
    return data


def simulate_measured(problem_doc: dict, plan: dict, kernel_seconds: dict[str, float],
                      bandwidth: dict[str, float], iteration_s: float | None = None) -> dict:
    """The simulator's iteration time for the plan, with each kernel's measured time (the
    roofline's where a kernel was not timed) and the measured copy bandwidths. With the
    unswapped build's measured `iteration_s`, every kernel op also takes the dispatch overhead
    calibrated from it (launches and the VM between kernels: the iteration less the kernels'
    sum, spread over the kernel ops; kernels scaled down where the run was faster than their
    sum: `cost.calibration.fit_to_iteration`), as `driver.stand_in` does on the CPU stand-in."""
    try:
        from ...cost.calibration import fit_to_iteration, op_times_of_kernels
        from ...swap.plan import SwapPlan
        from ...swap.problem import SwapProblem
        from ...swap.simulator import simulate
    except ImportError as err:
        return {"simulated_ms": None,
                "simulated": f"deferred: the swap simulator does not import here ({err}); "
                             "`python scripts/gpu_bundle.py BUNDLE --finish RESULTS.json` adds "
                             "it where tvm_ext is installed"}
    problem = SwapProblem.from_dict(problem_doc["problem"])
    kernels = problem_doc["op_kernels"]
    seconds = dict(kernel_seconds)
    untimed = sorted({k for k in kernels if k is not None and k not in seconds})
    for i, k in enumerate(kernels):  # the roofline's time for a kernel not timed
        if k in untimed:
            seconds.setdefault(k, float(problem.durations[i]))
    durations = op_times_of_kernels(kernels, seconds)
    overhead, scale = 0.0, 1.0
    if iteration_s:
        durations, overhead, scale = fit_to_iteration(kernels, durations, iteration_s)
    changes = {"durations": durations}
    if bandwidth:
        changes.update(h2d_bandwidth=bandwidth["h2d"], d2h_bandwidth=bandwidth["d2h"])
    problem = dataclasses.replace(problem, **changes)
    makespan = simulate(problem, SwapPlan.from_dict(plan)).makespan
    return {"simulated_ms": makespan * 1e3, "simulated_untimed_kernels": untimed,
            "simulated_bandwidth": "measured" if bandwidth else "preset",
            "dispatch_overhead_us": overhead * 1e6, "kernel_scale": scale}
