"""Measured kernel times against the roofline: per-op durations, comparison, calibration.

Takes `KernelTiming`s (from `tvm_ext.driver.measure_kernels`) as plain numbers: `op_times_measured`
turns them into per-op durations for a `SwapProblem`; `compare` lines each kernel's roofline
estimate up against its measurement, and `calibrate` fits a preset's efficiencies to them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from ..graph import DataflowGraph
from .hardware import Hardware, get_hardware
from .roofline import op_time


@dataclasses.dataclass
class KernelTiming:
    name: str
    seconds: float  # median of the repeats
    flops: float
    bytes_moved: int
    calls: int  # ops of the graph that call it
    library: bool = False  # its GEMM/convolution ran in a vendor library


def op_times_measured(graph: DataflowGraph, timings: dict[str, KernelTiming]) -> np.ndarray:
    """Per-op seconds for `SwapProblem.from_graph(op_times=...)`: a kernel op takes its
    kernel's measured time, views and builtins nothing."""
    return op_times_of_kernels(op_kernels(graph), {k: t.seconds for k, t in timings.items()})


def op_kernels(graph: DataflowGraph) -> list[str | None]:
    """The kernel each op calls, None for views and builtins (plain data, to keep beside a
    swap problem)."""
    return [op.kernel if op.kind == "kernel" else None for op in graph.ops]


def op_times_of_kernels(kernels: Sequence[str | None], seconds: Mapping[str, float]
                        ) -> np.ndarray:
    """Per-op seconds from seconds per kernel: an op takes its kernel's time, others nothing."""
    out = np.zeros(len(kernels))
    for i, kernel in enumerate(kernels):
        if kernel is not None:
            if kernel not in seconds:
                raise KeyError(f"no measurement for kernel {kernel}")
            out[i] = seconds[kernel]
    return out


def compare(timings: dict[str, KernelTiming], hardware: str | Hardware = "cpu") -> list[dict]:
    """Roofline vs measured, kernel by kernel, slowest measured first."""
    hw = get_hardware(hardware)
    rows = []
    for k in sorted(timings.values(), key=lambda k: -k.seconds):
        est = op_time(k.flops, k.bytes_moved, hw, library=k.library)
        efficiency = hw.library_efficiency if k.library else hw.compute_efficiency
        compute = k.flops / (hw.peak_flops * efficiency)
        memory = k.bytes_moved / (hw.mem_bandwidth * hw.bandwidth_efficiency)
        rows.append({"kernel": k.name, "calls": k.calls, "gflops": k.flops / 1e9,
                     "mbytes": k.bytes_moved / 1e6, "library": k.library,
                     "measured_s": k.seconds, "roofline_s": est,
                     "bound": "compute" if compute >= memory else "memory",
                     "ratio": k.seconds / est if est > 0 else float("inf")})
    return rows


def calibrate(timings: dict[str, KernelTiming], hardware: str | Hardware = "cpu") -> Hardware:
    """The preset with efficiencies and launch overhead fitted to the measurements: each
    kernel's time is modelled as overhead + max(flops / F, bytes / B); F (one rate for
    generated kernels, one for those whose GEMM or convolution runs in a vendor library) and B
    are set so that each group of compute-bound kernels, and the memory-bound ones together,
    take the measured time in one iteration (a sum over the graph's calls, not a median: a
    swap plan cares about where the time goes). The overhead is half the fastest kernel's
    time."""
    hw = get_hardware(hardware)
    ks = [k for k in timings.values() if k.seconds > 0]
    if not ks:
        return hw
    overhead = float(min(k.seconds for k in ks)) * 0.5
    rates = {False: hw.compute_efficiency, True: hw.library_efficiency}
    be = hw.bandwidth_efficiency
    for _ in range(5):  # the bound of a kernel depends on the rates being fitted
        comp: dict[bool, list] = {False: [], True: []}
        mem = []
        for k in ks:
            c = k.flops / (hw.peak_flops * rates[k.library])
            m = k.bytes_moved / (hw.mem_bandwidth * be)
            work = max(k.seconds - overhead, 1e-9)
            # Weighted by how often the graph calls the kernel.
            (comp[k.library] if c >= m else mem).append((c * k.calls, m * k.calls,
                                                         work * k.calls))
        for library, group in comp.items():
            if group:
                rates[library] *= sum(c for c, _, _ in group) / sum(w for _, _, w in group)
        if mem:
            be *= sum(m for _, m, _ in mem) / sum(w for _, _, w in mem)
    return dataclasses.replace(hw, name=f"{hw.name}-calibrated", compute_efficiency=rates[False],
                               library_efficiency=rates[True], bandwidth_efficiency=be,
                               launch_overhead=overhead)


def dispatch_overhead(kernels: Sequence[str | None], op_times: np.ndarray,
                      iteration_s: float) -> float:
    """Seconds each kernel op takes in a whole run beyond its time measured alone (the VM's
    dispatch, inputs not in cache): the measured iteration less the ops' sum, spread over the
    kernel ops (0 if the run was not slower). `kernels`: each op's kernel, None for views and
    builtins (`op_kernels`, or the list a bundle keeps beside its swap problem)."""
    count = sum(1 for k in kernels if k is not None)
    if not count:
        return 0.0
    return max(0.0, (float(iteration_s) - float(np.sum(op_times))) / count)


def with_dispatch_overhead(kernels: Sequence[str | None], op_times: np.ndarray,
                           overhead: float) -> np.ndarray:
    """`op_times` with `overhead` added to every kernel op (`kernels` as `dispatch_overhead`)."""
    kernel = np.array([k is not None for k in kernels], dtype=np.float64)
    return np.asarray(op_times, dtype=np.float64) + overhead * kernel


def fit_to_iteration(kernels: Sequence[str | None], op_times: np.ndarray,
                     iteration_s: float) -> tuple[np.ndarray, float, float]:
    """Op durations that add up to a measured whole run: a run slower than the ops' sum adds
    the difference to the kernel ops as dispatch overhead (`dispatch_overhead`); a run faster
    (kernels timed alone, on their own buffers, ran slower than in the run, where a producer
    leaves its output in cache) scales the kernel ops down to it. Returns (durations, overhead
    s per kernel op, scale of the kernel ops); (`op_times`, 0, 1) without kernel ops."""
    overhead = dispatch_overhead(kernels, op_times, iteration_s)
    times = with_dispatch_overhead(kernels, op_times, overhead)
    kernel = np.array([k is not None for k in kernels], dtype=bool)
    in_kernels = float(np.sum(times[kernel])) if kernel.any() else 0.0
    if in_kernels <= 0 or float(np.sum(times)) <= float(iteration_s):
        return times, overhead, 1.0
    scale = max(0.0, (float(iteration_s) - float(np.sum(times[~kernel]))) / in_kernels)
    return np.where(kernel, times * scale, times), overhead, scale
