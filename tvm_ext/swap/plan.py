"""SwapPlan: what a swap planner decides, in the form the SwapOffload pass applies.

Positions index `schedule` (the op at position i runs i-th). The plan says:

* `schedule`: the op order (a topological order of the graph);
* `pools`: device storage to allocate, in bytes (256-aligned): with SwapAdvisor's layout one
  pool per size class (`size_classes[k]` = [object bytes, object count], pool k = their
  product, a tensor at offset j * object bytes occupies object j), otherwise one arena.
  Every planned tensor lives in a pool at a 256-aligned `offset` during each of its
  residency intervals; `pinned` tensors (module constants, small arguments kept on the
  device) live outside the pools for the whole call. The device memory the module uses is
  `sum(pools) + pinned bytes` = `predicted_peak`;
* `residencies`: (tensor, pool, offset, begin, end, source): the tensor occupies
  [offset, offset + nbytes) of its pool from position `begin` to position `end` (its last use
  there, or the last position if it stays to the end). `source` is "produced" (the op at
  `begin` writes it there) or "swap_in" (a host-to-device copy fills it). Before the window is
  written, swap-out `wait_swap_out` (if not -1) must have finished: the latest, in stream
  order, of the swap-outs of what the window held before (the d2h stream is FIFO, so the
  earlier ones have finished too);
* `swap_outs`: device-to-host copies on the "d2h" stream, in stream order, each issued after
  the op at position `after`, copying the tensor out of the residency that ends there;
* `swap_ins`: host-to-device copies on the "h2d" stream, in stream order, each issued after
  position `after` (-1: at the start of the call) into the residency `residency`, waiting
  for `wait_swap_out` (which covers the tensor's own earlier swap-out), and needed before
  the op at position `before` (the op waits for it; `op_waits()` lists every wait);
* `host_start`: tensors that start on the host (arguments the plan leaves there) and
  `outputs_on_host`: outputs returned from the host (copied out by a swap-out); the others
  stay in their pool window to the end.

A view takes no bytes: the pass re-derives it from its base's current residency at each use.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np

from ..errors import InternalError
from .problem import ALIGNMENT, SwapProblem


class PlanError(InternalError):
    """A plan breaks one of its invariants (see `simulator.validate`)."""


@dataclasses.dataclass
class Residency:
    tensor: int
    pool: int
    offset: int
    nbytes: int
    begin: int
    end: int
    source: str  # "produced" or "swap_in"
    swap_in: int = -1  # index into swap_ins for a swap-in residency
    wait_swap_out: int = -1  # swap-out that must finish before the window is written


@dataclasses.dataclass
class SwapOut:
    tensor: int
    after: int
    nbytes: int
    stream: str = "d2h"


@dataclasses.dataclass
class SwapIn:
    tensor: int
    after: int
    before: int
    nbytes: int
    residency: int
    wait_swap_out: int = -1
    stream: str = "h2d"


@dataclasses.dataclass
class SwapPlan:
    planner: str
    budget: int
    schedule: list[int]
    pools: list[int]
    size_classes: list[list[int]]  # [object bytes, object count] per pool; [] for an arena
    pinned: list[int]
    host_start: list[int]
    outputs_on_host: list[int]
    residencies: list[Residency]
    swap_outs: list[SwapOut]
    swap_ins: list[SwapIn]
    predicted_time: float
    predicted_peak: int
    planning_time: float = 0.0
    info: dict = dataclasses.field(default_factory=dict)

    # ---------------------------------------------------------------- figures
    @property
    def bytes_swapped_out(self) -> int:
        return int(sum(s.nbytes for s in self.swap_outs))

    @property
    def bytes_swapped_in(self) -> int:
        return int(sum(s.nbytes for s in self.swap_ins))

    @property
    def bytes_swapped(self) -> int:
        return self.bytes_swapped_in + self.bytes_swapped_out

    def op_waits(self) -> list[list[int]]:
        """Per position: the swap-ins and swap-outs (as ("h2d", i) / ("d2h", i)) the op there
        must wait for before it starts."""
        waits: list[list] = [[] for _ in self.schedule]
        for i, s in enumerate(self.swap_ins):
            waits[s.before].append(("h2d", i))
        for r in self.residencies:
            if r.source == "produced" and r.wait_swap_out >= 0:
                waits[r.begin].append(("d2h", r.wait_swap_out))
        return waits

    def summary(self) -> dict:
        return {
            "planner": self.planner,
            "budget": self.budget,
            "predicted_peak": self.predicted_peak,
            "predicted_time": self.predicted_time,
            "pools": list(self.pools),
            "size_classes": [list(c) for c in self.size_classes],
            "pinned_tensors": len(self.pinned),
            "host_start": len(self.host_start),
            "outputs_on_host": len(self.outputs_on_host),
            "swap_outs": len(self.swap_outs),
            "swap_ins": len(self.swap_ins),
            "bytes_swapped_out": self.bytes_swapped_out,
            "bytes_swapped_in": self.bytes_swapped_in,
            "planning_time": self.planning_time,
            **{k: v for k, v in self.info.items() if isinstance(v, (int, float, str, bool))},
        }

    # ---------------------------------------------------------------- invariants
    def check_structure(self, problem: SwapProblem) -> None:
        """Raise `PlanError` unless: the schedule is topological; pools plus pinned bytes fit
        the budget; windows are aligned and inside their pool; no two residencies share bytes
        at the same position; every op finds each tensor it needs resident (produced there or
        swapped in before it); a swap-in of a tensor made on the device comes after its
        swap-out; a region is written only after the swap-out of what it held.
        `simulator.validate` checks these and the simulated iteration."""
        if not problem.is_topological(self.schedule):
            raise PlanError("the schedule is not a topological order of the ops")
        if self.planner == "ideal":
            return
        self._check_memory(problem)
        self._check_windows(problem)
        swapped_out_at: dict[int, int] = {}
        for k, s in enumerate(self.swap_outs):
            if s.tensor in swapped_out_at:
                raise PlanError(f"tensor {s.tensor} is swapped out twice")
            swapped_out_at[s.tensor] = k
        self._check_needs(problem)
        self._check_copies(problem, swapped_out_at)
        self._check_writes(problem, swapped_out_at)
        for r in self.residencies:
            if r.source == "produced" and problem.producers[r.tensor] != self.schedule[r.begin]:
                raise PlanError(f"tensor {r.tensor} is produced at a position that does not "
                                f"make it")

    def _check_memory(self, problem: SwapProblem) -> None:
        """Pools and pinned tensors fit the budget; size-class pools hold whole objects."""
        sizes = problem.sizes
        pinned = set(self.pinned)
        if not set(np.nonzero(problem.pinned)[0].tolist()) <= pinned:
            raise PlanError("a tensor the problem pins is not pinned by the plan")
        used = sum(self.pools) + int(sum(sizes[t] for t in pinned))
        if used > problem.budget:
            raise PlanError(f"pools and pinned tensors take {used} bytes, budget "
                            f"{problem.budget}")
        if used != self.predicted_peak:
            raise PlanError(f"predicted peak {self.predicted_peak} != pools + pinned {used}")
        host_ok = set(np.nonzero(problem.host_start)[0].tolist())
        if not set(self.host_start) <= host_ok:
            raise PlanError("a tensor that has no host copy is said to start on the host")
        if self.size_classes:
            if [size * count for size, count in self.size_classes] != list(self.pools):
                raise PlanError("pools are not object size x object count of their classes")
            for r in self.residencies:
                size = self.size_classes[r.pool][0]
                if r.offset % size or r.nbytes > size:
                    raise PlanError(f"tensor {r.tensor} is not in one object of its class")

    def _check_windows(self, problem: SwapProblem) -> None:
        """Windows are aligned, inside their pool, and no two share bytes at once."""
        n = problem.num_ops
        for r in self.residencies:
            if r.offset % ALIGNMENT or r.offset < 0 or r.offset + r.nbytes > self.pools[r.pool]:
                raise PlanError(f"residency of tensor {r.tensor} at {r.offset} is outside "
                                f"pool {r.pool} or unaligned")
            if r.nbytes != problem.sizes[r.tensor] or not 0 <= r.begin <= r.end < n:
                raise PlanError(f"residency of tensor {r.tensor} is malformed: {r}")
        by_pool: dict[int, list[Residency]] = {}
        for r in self.residencies:
            by_pool.setdefault(r.pool, []).append(r)
        for rs in by_pool.values():
            rs = sorted(rs, key=lambda r: r.begin)
            active: list[Residency] = []
            for r in rs:
                active = [a for a in active if a.end >= r.begin]
                for a in active:
                    if a.offset < r.offset + r.nbytes and r.offset < a.offset + a.nbytes:
                        raise PlanError(f"tensors {a.tensor} and {r.tensor} share bytes at "
                                        f"position {r.begin}")
                active.append(r)

    def _check_needs(self, problem: SwapProblem) -> None:
        """Every need of an op not pinned is resident where the op runs."""
        pinned = set(self.pinned)
        position = {op: i for i, op in enumerate(self.schedule)}
        covering: dict[int, list[Residency]] = {}
        for r in self.residencies:
            covering.setdefault(r.tensor, []).append(r)
        for op in range(problem.num_ops):
            i = position[op]
            for t in problem.needs(op):
                if t in pinned:
                    continue
                rs = [r for r in covering.get(t, []) if r.begin <= i <= r.end]
                if not rs:
                    raise PlanError(f"op {problem.op_names[op]} at position {i} needs tensor "
                                    f"{problem.tensor_names[t]}, which is not resident")

    def _check_copies(self, problem: SwapProblem, swapped_out_at: dict[int, int]) -> None:
        """Streams are in issue order, copies match their residencies, and a swap-in of a
        tensor made on the device follows (and waits for) its swap-out."""
        for stream in (self.swap_ins, self.swap_outs):
            if any(a.after > b.after for a, b in itertools.pairwise(stream)):
                raise PlanError("a copy stream is not in issue order")
        ends = {(r.tensor, r.end) for r in self.residencies}
        for k, s in enumerate(self.swap_outs):
            if (s.tensor, s.after) not in ends:
                raise PlanError(f"swap-out {k} is not issued where a residency of its tensor "
                                f"ends")
        for k, s in enumerate(self.swap_ins):
            r = self.residencies[s.residency]
            if r.tensor != s.tensor or r.swap_in != k or r.begin != s.after + 1:
                raise PlanError(f"swap-in {k} does not match its residency")
            if not s.after < s.before <= r.end:
                raise PlanError(f"swap-in {k} is needed before it is issued")
            if not problem.host_start[s.tensor]:
                out = swapped_out_at.get(s.tensor)
                if out is None or self.swap_outs[out].after > s.after:
                    raise PlanError(f"swap-in {k} of tensor {s.tensor} comes before its "
                                    f"swap-out")
                if s.wait_swap_out < out:
                    raise PlanError(f"swap-in {k} does not wait for the swap-out of its data")

    def _check_writes(self, problem: SwapProblem, swapped_out_at: dict[int, int]) -> None:
        """A tensor overwritten in place is copied out before it is fetched again, and one
        that started on the host is back there at the end (written back)."""
        position = {op: i for i, op in enumerate(self.schedule)}
        pinned = set(self.pinned)
        on_host, returned = set(self.host_start), set(self.outputs_on_host)
        fetches: dict[int, list[int]] = {}
        for k, s in enumerate(self.swap_ins):
            fetches.setdefault(s.tensor, []).append(k)
        for t, op in enumerate(problem.writer()):
            if op < 0 or t in pinned:
                continue
            w = position[int(op)]
            out = swapped_out_at.get(t)
            copied = out is not None and self.swap_outs[out].after >= w
            for k in fetches.get(t, []):
                s = self.swap_ins[k]
                if s.after >= w and not (copied and self.swap_outs[out].after <= s.after
                                         and s.wait_swap_out >= out):
                    raise PlanError(f"swap-in {k} fetches {problem.tensor_names[t]} after it "
                                    "was overwritten, without its copy-out")
            if t in on_host and not (copied and t in returned):
                raise PlanError(f"{problem.tensor_names[t]} starts on the host and is "
                                "overwritten, but is not written back")

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> SwapPlan:
        data = dict(data)
        data["residencies"] = [Residency(**r) for r in data["residencies"]]
        data["swap_outs"] = [SwapOut(**s) for s in data["swap_outs"]]
        data["swap_ins"] = [SwapIn(**s) for s in data["swap_ins"]]
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SwapPlan:
        return cls.from_dict(json.loads(text))
