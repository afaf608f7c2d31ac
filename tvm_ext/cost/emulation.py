"""The CPU stand-in with an emulated host link: what the planners are told about it.

On the stand-in (cpu:0 as the device, cpu:1 as the host) the runtime library can pace every
device<->host copy to `latency + bytes / bandwidth` of wall time (src/swap/link_emulation.h).
Two ways to pick that link:

* fixed: a bandwidth (and a per-copy latency) given as such (`--link-gbps`);
* scaled from a preset: the stand-in's compute-to-link ratio made that of a real accelerator.
  With `T_here` the iteration's compute on this CPU (the sum of the measured op durations the
  simulator uses) and `T_preset` the same graph on the preset (the sum of its roofline op
  durations), the scale is `s = T_here / T_preset` (how many times slower this CPU runs the
  graph), and the emulated link is the preset's link slowed by the same factor: bandwidth
  `B / s`, latency `L * s`. Every copy then takes `s` times as long as on the preset, as every
  kernel does (in total), so a plan overlaps, prefetches and stalls as it would there.

`stand_in_hardware` is the `Hardware` a swap plan for the stand-in is made with: the `cpu`
preset's compute, the emulated link both ways, and the swap runtime's own costs measured on this
machine (`tvm_ext.driver.measure_runtime_costs`): the compute-stream time to hand a copy to an
idle copy stream and the copy's start after it (both by how long the stream was idle), the delay
before a stalled stream resumes, and how late a paced copy ends (added to the link latency).
No TVM here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .hardware import GB, Hardware, Link, get_hardware


def time_scale(here_s: float | Sequence[float], preset_s: float | Sequence[float]) -> float:
    """How many times slower this machine computes: sum(here) / sum(preset) (per-op seconds of
    the same graph, or their totals)."""
    here = float(np.sum(here_s))
    preset = float(np.sum(preset_s))
    if here <= 0 or preset <= 0:
        raise ValueError(f"time_scale needs positive compute times, got {here} s here and "
                         f"{preset} s on the preset")
    return here / preset


def scaled_link(link: Link, scale: float) -> Link:
    """`link` slowed `scale` times: bandwidth / scale, latency * scale."""
    if not scale > 0:
        raise ValueError(f"the scale must be > 0, got {scale}")
    return Link(f"{link.name}/{scale:.3g}", link.bandwidth / scale, link.latency * scale)


def fixed_link(gbps: float, latency_us: float = 0.0) -> Link:
    """A link of `gbps` GB/s (1e9 bytes/s) per direction and `latency_us` per copy."""
    if not gbps > 0 or latency_us < 0:
        raise ValueError(f"an emulated link needs GB/s > 0 and a latency >= 0, got {gbps} GB/s "
                         f"and {latency_us} us")
    return Link(f"emulated {gbps:g} GB/s", gbps * GB, latency_us * 1e-6)


@dataclasses.dataclass(frozen=True)
class RuntimeCosts:
    """The swap runtime's own costs on this machine, in seconds (medians of a micro-benchmark):
    issuing a copy to a stream idle for the shortest time measured (compute-stream time: waking
    its worker), a stalled
    stream's resume delay, how far past its deadline a paced copy ends, and `wake`: the
    hand-over by how long the stream was idle, (idle, issue, the copy's start after the
    hand-over began) points (`Hardware.copy_wake`; empty: `copy_issue` whatever the idle
    time, the copy starting `sync` after it)."""

    copy_issue: float = 0.0
    sync: float = 0.0
    overshoot: float = 0.0
    wake: tuple[tuple[float, float, float], ...] = ()


def stand_in_hardware(
    h2d: Link,
    d2h: Link | None = None,
    *,
    costs: RuntimeCosts | None = None,
    base: str | Hardware = "cpu",
) -> Hardware:
    """The stand-in as the planners see it: `base`'s compute, the emulated link (its latency
    plus the measured overshoot) and the runtime's measured costs."""
    hw = get_hardware(base)
    costs = costs or RuntimeCosts()
    d2h = d2h or h2d

    def effective(link: Link) -> Link:
        return dataclasses.replace(link, latency=link.latency + costs.overshoot)

    return dataclasses.replace(
        hw, name=f"{hw.name}+{h2d.name}", host_to_device=effective(h2d),
        device_to_host=effective(d2h), copy_issue_overhead=costs.copy_issue,
        sync_overhead=costs.sync, copy_wake=costs.wake)
