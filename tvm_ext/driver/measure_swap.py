"""Swapped runs measured, not only simulated: timed iterations, a traced one (when each kernel
and each copy ran), and the swap runtime's own costs on this machine.

* `measure_run` runs `main` of a module (swapped or not) `repeat` times for time, then once more
  with the runtime library's trace on and its VM instrument installed (a C++ hook: the kernels'
  times, the copies on their streams and the caller's waits, on one clock). Given `beside` (a
  call of another module, e.g. `unswapped_call`), each timed call follows one timed call of it:
  on a machine whose speed drifts within seconds, two modules compare fairly only in
  alternation. Timing runs use
  the pooled allocator: the naive one maps fresh pages at every call, whose first touch then
  costs the kernels time that neither a GPU's caching allocator nor the kernel measurements
  (`measure_kernels`) pay.
* `timeline_of(run, graph, plan)` gives the traced iteration as `tvm_ext.swap.measured` lanes.
* `measure_runtime_costs(link)` times what the simulator's stand-in hardware needs beyond the
  link (`tvm_ext.cost.emulation.RuntimeCosts`): handing a copy to a copy stream idle for a
  given time (compute time, and the copy's start after it: the stream's worker wakes slower
  the longer it slept), the delay before a caller stalled on a copy resumes, and how far past
  its deadline a paced copy ends.
* `stand_in(graph, timings, preset=... | link=...)` puts it together: the op durations, the
  emulated link (a preset's, scaled to this CPU, or a fixed one) and the `Hardware` a swap plan
  for the stand-in is made with.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from ..cost.calibration import KernelTiming, fit_to_iteration, op_kernels, op_times_measured
from ..cost.emulation import RuntimeCosts, scaled_link, stand_in_hardware, time_scale
from ..cost.hardware import Hardware, Link, get_hardware
from ..cost.roofline import op_times as roofline_op_times
from ..graph import DataflowGraph
from ..runtime import swap_streams
from ..runtime.timing import time_calls
from ..swap.measured import Event, MeasuredTimeline
from ..swap.plan import SwapPlan
from ..swap.split import chunk_kernel_name
from .run import flatten_outputs, place_argument


@dataclasses.dataclass
class MeasuredRun:
    """Timed calls of `main` and one traced call."""

    outputs: list[np.ndarray]
    latencies_ms: list[float]
    traced_ms: float  # the traced call (the instrument costs well under a us per VM call)
    events: list[Event]  # of the traced call
    streams: list[swap_streams.StreamStats]  # over the timed calls
    link: swap_streams.EmulatedLink | None  # the emulated link in force, if any
    # CPU time of the calling thread (which runs the kernels) over the wall time of the timed
    # calls: near 1 for an unswapped run on a quiet machine; well below, other processes held
    # the core (a loaded machine's scheduler also favours a thread that often sleeps in waits,
    # so a swapped run is slowed less than an unswapped one).
    cpu_share: float = float("nan")
    beside_ms: list[float] = dataclasses.field(default_factory=list)  # `beside`, alternated

    @property
    def beside_median_ms(self) -> float:
        return float(np.median(self.beside_ms)) if self.beside_ms else float("nan")

    @property
    def median_ms(self) -> float:
        return float(np.median(self.latencies_ms)) if self.latencies_ms else float("nan")

    @property
    def hidden_fraction(self) -> float:
        """Of the copy time of the timed calls, the part during which the caller was not
        blocked in a wait (the runtime's own count; 1.0 without copies)."""
        busy = sum(s.busy_ns for s in self.streams)
        return sum(s.overlap_ns for s in self.streams) / busy if busy else 1.0

    def summary(self) -> dict:
        paced = sum(s.paced for s in self.streams)
        return {
            "median_ms": self.median_ms, "latencies_ms": self.latencies_ms,
            "beside_ms": self.beside_ms,
            "traced_ms": self.traced_ms, "hidden_fraction": self.hidden_fraction,
            "cpu_share": self.cpu_share,
            "copies": sum(s.copies for s in self.streams),
            "bytes_copied": sum(s.bytes for s in self.streams),
            "paced_copies": paced, "late_copies": sum(s.late for s in self.streams),
            "mean_overshoot_us": (sum(s.overshoot_ns for s in self.streams) / paced / 1e3
                                  if paced else 0.0),
            "emulated_link": None if self.link is None else {
                "gbps": self.link.bandwidth / 1e9, "latency_us": self.link.latency * 1e6},
        }


def measure_run(
    executable: relax.VMExecutable,
    arguments: Sequence[np.ndarray],
    device: tvm.runtime.Device,
    *,
    host: tvm.runtime.Device | None = None,
    arg_devices: Sequence[int] | None = None,
    repeat: int = 5,
    warmup: int = 1,
    allocator: str = "pooled",
    beside: Callable[[], object] | None = None,
) -> MeasuredRun:
    """Time `main` (`warmup` untimed calls, then `repeat` timed ones, each after a timed call
    of `beside` if given), then trace one call. A swapped module runs on `[device, host]` with
    each argument where `arg_devices` says (0: device, 1: host)."""
    vm, args = _loaded(executable, arguments, device, host, arg_devices, allocator)
    main = vm["main"]
    outputs = flatten_outputs(main(*args))
    for _ in range(warmup):
        main(*args)
    device.sync()
    swap_streams.reset_stats()
    latencies, beside_ms, cpu_ms = [], [], 0.0
    for _ in range(repeat):
        if beside is not None:
            beside_ms += time_calls(beside, device.sync, 1)
        cpu0 = time.thread_time()
        latencies += time_calls(lambda: main(*args), device.sync, 1)
        cpu_ms += (time.thread_time() - cpu0) * 1e3
    cpu_share = cpu_ms / sum(latencies) if latencies else float("nan")
    streams = swap_streams.stream_stats()
    swap_streams.record_vm_calls(vm)
    swap_streams.reset_stats()
    swap_streams.set_tracing(True)
    try:
        traced = time_calls(lambda: vm["main"](*args), device.sync, 1)[0]
    finally:
        swap_streams.set_tracing(False)
    events = [_event(r) for r in swap_streams.trace()]
    swap_streams.reset_stats()
    return MeasuredRun(outputs, latencies, traced, events, streams,
                       swap_streams.emulated_link(), cpu_share, beside_ms)


def unswapped_call(executable: relax.VMExecutable, arguments: Sequence[np.ndarray],
                   device: tvm.runtime.Device, *, allocator: str = "pooled",
                   warmup: int = 1) -> Callable[[], object]:
    """One call of `main` of an unswapped module, its VM and arguments made (and warmed up)
    once: the `beside` of `measure_run`."""
    vm, args = _loaded(executable, arguments, device, None, None, allocator)
    main = vm["main"]
    for _ in range(warmup):
        main(*args)
    device.sync()
    return lambda: main(*args)


def _loaded(executable: relax.VMExecutable, arguments: Sequence[np.ndarray],
            device: tvm.runtime.Device, host: tvm.runtime.Device | None,
            arg_devices: Sequence[int] | None, allocator: str) -> tuple:
    """The VM of `executable` on `[device]` or `[device, host]`, and `arguments` placed where
    `arg_devices` says (0: device, 1: host; default: all on the device)."""
    devices = [device] if host is None else [device, host]
    arg_devices = list(arg_devices) if arg_devices is not None else [0] * len(arguments)
    if len(arg_devices) != len(arguments) or max(arg_devices, default=0) >= len(devices):
        raise ValueError("arg_devices must give a device index (into [device, host]) per "
                         "argument")
    vm = relax.VirtualMachine(executable, devices, memory_cfg=allocator)
    return vm, [place_argument(a, devices[d], device)
                for a, d in zip(arguments, arg_devices, strict=True)]


def _event(record) -> Event:
    if isinstance(record, swap_streams.CopyRecord):
        return Event("copy", record.name, record.start_ns, record.end_ns, record.stream,
                     record.nbytes, record.enqueued_ns)
    if isinstance(record, swap_streams.WaitRecord):
        return Event("wait", "", record.start_ns, record.end_ns, record.stream)
    return Event("call", record.name, record.start_ns, record.end_ns)


def timeline_of(run: MeasuredRun, graph: DataflowGraph,
                plan: SwapPlan | None = None) -> MeasuredTimeline:
    """The traced call of `run` as lanes; kernels are the calls of `graph`'s kernels and, for
    a run of `plan`, of the chunk kernels of its split ops (one call per chunk)."""
    kernels = {op.kernel for op in graph.ops if op.kind == "kernel"}
    if plan is not None:
        kernels |= {chunk_kernel_name(graph.ops[sp.op].kernel, sp.chunks, sp.dim, acc,
                                      outer_dim=sp.outer_dim)
                    for sp in plan.splits for acc in {False, sp.accumulate}}
        kernels |= {chunk_kernel_name(graph.ops[sp.op].kernel, sp.chunks, sp.dim,
                                      epilogue=True, outer_dim=sp.outer_dim)
                    for sp in plan.splits if sp.epilogue}
    return MeasuredTimeline.from_events(run.events, kernels)


# How long a copy stream sits idle before a copy is handed to it: a worker that slept longer
# wakes slower (on a VM its core may have been halted: tens of us, against a few us right after
# its last copy).
IDLE_GAPS = (0.0, 5e-5, 2e-4, 1e-3, 4e-3)


def measure_runtime_costs(link: Link | swap_streams.EmulatedLink, *, samples: int = 80,
                          nbytes: int = 1 << 16,
                          idle_gaps: Sequence[float] = IDLE_GAPS) -> RuntimeCosts:
    """The swap runtime's own costs with `link` emulated: for each idle time in `idle_gaps`,
    `samples` copies of `nbytes` from cpu:0 to cpu:1, each handed to a stream idle that long
    (the caller computes meanwhile) and then waited for; medians of the hand-over (compute
    time), of the copy's start after it, of the caller's resuming after a copy it blocked on,
    and of how far past its deadline a paced copy ends. The link in force before is
    restored."""
    if not samples > 0 or not idle_gaps or min(idle_gaps) < 0:
        raise ValueError(f"measure_runtime_costs needs samples > 0 and idle times >= 0, got "
                         f"{samples} and {tuple(idle_gaps)}")
    before = swap_streams.emulated_link()
    swap_streams.set_emulated_link(link.bandwidth, link.latency)
    dev, host = tvm.cpu(0), tvm.cpu(1)
    src = tvm.runtime.tensor(np.ones(nbytes // 4, "float32"), dev)
    dst = swap_streams.host_empty((nbytes // 4,), "float32", host, dev)
    wake, copies, waits = [], [], []
    try:
        for gap in sorted(idle_gaps):
            swap_streams.reset()
            swap_streams.set_tracing(True)
            issue = []
            for _ in range(samples):
                _compute_for(gap)  # the stream's worker idles meanwhile
                start = time.perf_counter_ns()
                swap_streams.copy_async(src, dst, 0, "calibration")
                issue.append(time.perf_counter_ns() - start)
                swap_streams.wait(dst, 0)
            records = swap_streams.trace()
            swap_streams.set_tracing(False)
            gap_copies = sorted((r for r in records if isinstance(r, swap_streams.CopyRecord)),
                                key=lambda c: c.enqueued_ns)
            copies += gap_copies
            waits += [r for r in records if isinstance(r, swap_streams.WaitRecord)]
            # The stream's idle time as it was (the caller's resuming adds to the gap); the
            # first copy of a gap follows the previous gap's, so it is left out.
            idle = [b.enqueued_ns - a.end_ns for a, b in itertools.pairwise(gap_copies)]
            wake.append((max(0.0, statistics.median(idle) * 1e-9) if idle else gap,
                         statistics.median(issue[1:] or issue) * 1e-9,
                         statistics.median(c.start_ns - c.enqueued_ns for c in gap_copies[1:]
                                           or gap_copies) * 1e-9))
    finally:
        swap_streams.set_tracing(False)
        swap_streams.reset()
        if before is None:
            swap_streams.set_emulated_link(0.0)
        else:
            swap_streams.set_emulated_link(before.bandwidth, before.latency)
    paced_ns = link.latency * 1e9 + nbytes / link.bandwidth * 1e9
    # The caller's wait on each copy, where it blocked (the one spanning the copy's end).
    resumes = [w.end_ns - c.end_ns for c in copies for w in waits
               if w.start_ns <= c.end_ns <= w.end_ns]
    return RuntimeCosts(
        copy_issue=wake[0][1], sync=statistics.median(resumes) * 1e-9 if resumes else 0.0,
        overshoot=max(0.0, statistics.median(c.end_ns - c.start_ns - paced_ns
                                             for c in copies)) * 1e-9,
        wake=tuple(wake))


def _compute_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclasses.dataclass
class StandIn:
    """What swap planning for the CPU stand-in with an emulated link uses: per-op durations
    measured here, the link (fixed, or a preset's scaled by `scale`), the runtime's measured
    costs, and the `Hardware` combining them (`tvm_ext.cost.emulation.stand_in_hardware`)."""

    op_times: np.ndarray
    link: Link
    costs: RuntimeCosts
    hardware: Hardware
    scale: float | None = None  # this CPU's compute time / the preset's (scaled links)
    preset: str | None = None
    dispatch_overhead: float = 0.0
    kernel_scale: float = 1.0  # < 1: the unswapped run was faster than its kernels timed alone

    def summary(self) -> dict:
        return {"link_gbps": self.link.bandwidth / 1e9, "link_latency_us": self.link.latency * 1e6,
                "scale": self.scale, "preset": self.preset,
                "compute_s": float(np.sum(self.op_times)),
                "dispatch_overhead_us": self.dispatch_overhead * 1e6,
                "kernel_scale": self.kernel_scale,
                "copy_issue_us": self.costs.copy_issue * 1e6, "sync_us": self.costs.sync * 1e6,
                "overshoot_us": self.costs.overshoot * 1e6,
                "wake_us": [[round(x * 1e6, 1) for x in p] for p in self.costs.wake]}


def stand_in(graph: DataflowGraph, timings: dict[str, KernelTiming], *,
             preset: str | Hardware | None = None, link: Link | None = None,
             iteration_s: float | None = None) -> StandIn:
    """The stand-in for `graph` with kernels timed as `timings` (`measure_kernels`): with
    `preset`, the preset's host link scaled by this CPU's compute time over the preset's
    (`tvm_ext.cost.emulation`); with `link`, that link as it is. `iteration_s`, a measured
    unswapped run, fits the op durations to it (`cost.calibration.fit_to_iteration`): the VM's
    per-kernel dispatch overhead added, or the kernels scaled down where the run was faster."""
    if (preset is None) == (link is None):
        raise ValueError("stand_in takes a preset to scale or a link, not both or neither")
    times = op_times_measured(graph, timings)
    kernels = op_kernels(graph)
    overhead, kernel_scale = 0.0, 1.0
    if iteration_s:
        times, overhead, kernel_scale = fit_to_iteration(kernels, times, iteration_s)
    scale = name = None
    if preset is not None:
        hw = get_hardware(preset)
        name = hw.name
        scale = time_scale(times, roofline_op_times(graph, hw))
        link = scaled_link(hw.host_to_device, scale)
    costs = measure_runtime_costs(link)
    return StandIn(times, link, costs, stand_in_hardware(link, costs=costs), scale, name,
                   overhead, kernel_scale)
