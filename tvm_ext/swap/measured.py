"""A measured iteration of a swapped module, beside the simulated one.

The runtime library records, on one clock, when each copy ran on its stream, when the caller
was blocked waiting for a stream, and when each call of the VM (kernels included) began and
ended (`tvm_ext.driver.measure_run`). `MeasuredTimeline.from_events` turns those records
(plain `Event`s) into the simulator's lanes: "compute" (the kernels, in call order), "d2h" and
"h2d" (the copies on the swap-out and swap-in streams), and "stall" (the caller blocked), with
times in seconds from the first event. `compare` lines a plan's simulated timeline up against
a measured one: iteration time, busy time per lane, compute stalls, and the fraction of copy
time hidden under compute (copy time during which the compute stream was not stalled).
No TVM here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from .plan import SwapPlan
from .problem import SwapProblem
from .simulator import SimResult

LANES = ("compute", "d2h", "h2d")
Span = tuple[str, float, float]  # (label, start s, end s)


@dataclasses.dataclass(frozen=True)
class Event:
    """One record of the runtime's trace, as plain data: `kind` is "copy" (on `stream`),
    "wait" (the caller blocked on `stream`) or "call" (a VM call of `name`); times in ns."""

    kind: str
    name: str
    start_ns: int
    end_ns: int
    stream: int = -1
    nbytes: int = 0
    enqueued_ns: int = 0  # a copy: when it was issued


@dataclasses.dataclass
class MeasuredTimeline:
    """Per lane ("compute", "d2h", "h2d", "stall", "other"), (label, start, end) in seconds
    from the iteration's first event; `other` holds the VM's calls that are not kernels."""

    lanes: dict[str, list[Span]]
    makespan: float

    @classmethod
    def from_events(cls, events: Iterable[Event], kernels: Iterable[str],
                    streams: dict[int, str] | None = None) -> MeasuredTimeline:
        """`kernels`: the names of the module's kernels (calls to anything else go to
        "other"); `streams`: lane of each copy stream (default 0 -> d2h, 1 -> h2d)."""
        streams = streams or {0: "d2h", 1: "h2d"}
        kernels = set(kernels)
        events = list(events)
        if not events:
            return cls({lane: [] for lane in (*LANES, "stall", "other")}, 0.0)
        t0 = min(e.start_ns for e in events)
        lanes: dict[str, list[Span]] = {lane: [] for lane in (*LANES, "stall", "other")}
        for e in sorted(events, key=lambda e: (e.start_ns, e.end_ns)):
            span = (e.name, (e.start_ns - t0) * 1e-9, (e.end_ns - t0) * 1e-9)
            if e.kind == "copy":
                lanes.setdefault(streams.get(e.stream, f"stream{e.stream}"), []).append(span)
            elif e.kind == "wait":
                lanes["stall"].append((streams.get(e.stream, str(e.stream)), span[1], span[2]))
            elif e.name in kernels:
                lanes["compute"].append(span)
            else:
                lanes["other"].append(span)
        makespan = (max(e.end_ns for e in events) - t0) * 1e-9
        return cls(lanes, makespan)

    def busy(self, lane: str) -> float:
        """Seconds the lane's spans take (summed; they do not overlap within a lane)."""
        return float(sum(e - s for _, s, e in self.lanes.get(lane, [])))

    def hidden_fraction(self) -> float:
        """Of the copy time, the part during which the compute stream was not stalled."""
        copies = [(s, e) for lane in ("d2h", "h2d") for _, s, e in self.lanes[lane]]
        return hidden_fraction(copies, [(s, e) for _, s, e in self.lanes["stall"]])


def hidden_fraction(copies: Sequence[tuple[float, float]],
                    stalls: Sequence[tuple[float, float]]) -> float:
    """1 - (copy time overlapping a stall) / (copy time); 1.0 without copies."""
    total = sum(e - s for s, e in copies)
    if total <= 0:
        return 1.0
    merged = _union(stalls)
    exposed = sum(_overlap(s, e, merged) for s, e in copies)
    return float(1.0 - exposed / total)


def simulated_lanes(problem: SwapProblem, plan: SwapPlan, sim: SimResult) -> dict[str, list[Span]]:
    """The simulated iteration as lanes of labelled spans (views and zero-time ops left out),
    with the compute stream's stalls."""
    tl = sim.timelines(plan)
    lanes = {
        "compute": [(problem.op_names[op], s, e) for op, s, e in tl["compute"] if e > s],
        "d2h": [(problem.tensor_names[t], s, e) for t, s, e in tl["d2h"]],
        "h2d": [(problem.tensor_names[t], s, e) for t, s, e in tl["h2d"]],
        "stall": [("", s, e) for s, e in sim.stalls],
    }
    return lanes


def compare(problem: SwapProblem, plan: SwapPlan, sim: SimResult,
            measured: MeasuredTimeline) -> dict:
    """The simulated and the measured iteration side by side (seconds; `error` is
    measured / simulated - 1)."""
    lanes = simulated_lanes(problem, plan, sim)
    copies = [(s, e) for lane in ("d2h", "h2d") for _, s, e in lanes[lane]]
    out = {
        "simulated_s": sim.makespan,
        "measured_s": measured.makespan,
        "error": measured.makespan / sim.makespan - 1.0 if sim.makespan > 0 else float("nan"),
        "simulated_hidden": hidden_fraction(copies, [(s, e) for _, s, e in lanes["stall"]]),
        "measured_hidden": measured.hidden_fraction(),
    }
    for lane in (*LANES, "stall"):
        out[f"simulated_{lane}_s"] = float(sum(e - s for _, s, e in lanes[lane]))
        out[f"measured_{lane}_s"] = measured.busy(lane)
    out["measured_other_s"] = measured.busy("other")
    return out


def _union(spans: Sequence[tuple[float, float]]) -> np.ndarray:
    """Disjoint, sorted spans covering the same time."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        elif e > s:
            out.append([s, e])
    return np.asarray(out, dtype=np.float64).reshape(-1, 2)


def _overlap(s: float, e: float, merged: np.ndarray) -> float:
    if not len(merged):
        return 0.0
    lo = np.maximum(merged[:, 0], s)
    hi = np.minimum(merged[:, 1], e)
    return float(np.clip(hi - lo, 0.0, None).sum())
