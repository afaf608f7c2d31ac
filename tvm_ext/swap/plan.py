"""SwapPlan: what a swap planner decides, in the form the SwapOffload pass applies.

Positions index `schedule` (the op at position i runs i-th). The plan says:

* `schedule`: the op runs in order: a topological order of the graph, in which a one-output
  kernel may run a second time to make its tensor again (recompute, `tvm_ext.swap.recompute`;
  the residency it writes is "produced" there like the first);
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
  stay in their pool window to the end;
* `splits`: ops run in chunks along a dim (`tvm_ext.swap.split`), each with its chunk buffers'
  window (pool, offset, bytes) at its position: its cut inputs come in from their host copies
  by one swap-in each with no residency of its own (`residency` -1), its cut outputs leave for
  the host by one swap-out each issued after it, and are on the host only afterwards. A split
  that `accumulate`s cuts no output: its outputs are made on the device like any op's.

A view takes no bytes: the pass re-derives it from its base's current residency at each use.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np

from ..errors import InternalError
from .alignment import ALIGNMENT
from .problem import SwapProblem
from .split import SplitOption, chunk_counts, scratch_bytes


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
class Split:
    """An op run in `chunks` chunks along dim `dim` at `position` (see the module docstring)."""

    position: int
    op: int
    dim: int
    chunks: int
    pool: int
    offset: int
    nbytes: int  # its chunk buffers: two per cut tensor
    cut_inputs: list[int]
    whole_inputs: list[int]
    cut_outputs: list[int]
    wait_swap_out: int = -1  # swap-out of what the chunk buffers' window held before
    buffers: int = 2  # chunk buffers per cut tensor (1: chunks one after another, no overlap)
    viewed_inputs: list[int] = dataclasses.field(default_factory=list)  # cut, on the device
    accumulate: bool = False  # a reduction dim: the outputs stay whole, each chunk adds to them
    epilogue: bool = False  # ... into intermediates, the outputs finished after the last chunk
    epilogue_bytes: int = 0  # the intermediates' bytes in the chunk window (0: in place)
    # [cut input, bytes of its halo rows per chunk]: inputs read through windows
    halo_bytes: list[list[int]] = dataclasses.field(default_factory=list)
    outer_dim: int = -1  # a second dim cut into `outer_chunks` items, each in chunks of `dim`
    outer_chunks: int = 1

    def option(self, divisor: int = 0) -> SplitOption:
        """The split option this split runs (`divisor` as given: plans do not keep it)."""
        return SplitOption(self.dim, divisor, tuple(self.cut_inputs), tuple(self.whole_inputs),
                           tuple(self.cut_outputs), tuple(self.viewed_inputs),
                           accumulate=self.accumulate, epilogue=self.epilogue,
                           epilogue_bytes=self.epilogue_bytes,
                           halo_bytes=tuple((int(t), int(n)) for t, n in self.halo_bytes),
                           outer_dim=self.outer_dim, outer_chunks=self.outer_chunks)


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
    splits: list[Split] = dataclasses.field(default_factory=list)
    # Fused kernels the plan runs as their unfused parts (`tvm_ext.ir.kernel_fission`): its
    # graph is the fused module's with those kernels cut.
    fissioned: list[str] = dataclasses.field(default_factory=list)

    def split_at(self) -> dict[int, Split]:
        """The splits by position."""
        return {s.position: s for s in self.splits}

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
        for sp in self.splits:
            if sp.wait_swap_out >= 0:
                waits[sp.position].append(("d2h", sp.wait_swap_out))
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
            "fissioned_kernels": len(self.fissioned),
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
        if not problem.is_run_sequence(self.schedule):
            raise PlanError("the schedule is not a topological order of the ops (with "
                            "one-output kernels run again after their first run)")
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
        self._check_splits(problem)
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
        n = len(self.schedule)
        for r in self.residencies:
            if r.offset % ALIGNMENT or r.offset < 0 or r.offset + r.nbytes > self.pools[r.pool]:
                raise PlanError(f"residency of tensor {r.tensor} at {r.offset} is outside "
                                f"pool {r.pool} or unaligned")
            if r.nbytes != problem.sizes[r.tensor] or not 0 <= r.begin <= r.end < n:
                raise PlanError(f"residency of tensor {r.tensor} is malformed: {r}")
        by_pool: dict[int, list[Residency]] = {}
        for r in self.residencies:
            by_pool.setdefault(r.pool, []).append(r)
        for sp in self.splits:
            if sp.offset % ALIGNMENT or sp.offset < 0 or \
                    sp.offset + sp.nbytes > self.pools[sp.pool] or not 0 <= sp.position < n:
                raise PlanError(f"the chunk buffers of the split at {sp.position} are outside "
                                f"pool {sp.pool} or unaligned")
            if self.schedule[sp.position] != sp.op:
                raise PlanError(f"the split at {sp.position} is not its op's position")
            # Its chunk buffers: a window held at its position only (tensor -1).
            by_pool.setdefault(sp.pool, []).append(Residency(
                -1, sp.pool, sp.offset, sp.nbytes, sp.position, sp.position, "produced"))
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

    def _check_splits(self, problem: SwapProblem) -> None:
        """Each split is one of its op's options, in chunks it allows, with its cut inputs
        streamed or (kept on the device) viewed, and chunk buffers of the size it needs."""
        options = problem.split_options()
        pinned = np.zeros(problem.num_tensors, dtype=bool)
        pinned[self.pinned] = True
        for sp in self.splits:
            given = sp.option()
            on_device = [o.on_device(pinned) for o in options[sp.op] if o.dim == sp.dim]
            match = [o for o in on_device
                     if o is not None and dataclasses.replace(o, divisor=0) == given]
            if not match or sp.chunks not in chunk_counts(match[0], problem.sizes) or \
                    sp.buffers not in (1, 2):
                raise PlanError(f"the split at {sp.position} is not one op "
                                f"{problem.op_names[sp.op]} allows")
            if sp.nbytes != scratch_bytes(problem.sizes, given, sp.chunks, sp.buffers):
                raise PlanError(f"the split at {sp.position} has chunk buffers of the wrong size")

    def _check_needs(self, problem: SwapProblem) -> None:
        """Every need of an op not pinned is resident at each position the op runs."""
        pinned = set(self.pinned)
        covering: dict[int, list[Residency]] = {}
        for r in self.residencies:
            covering.setdefault(r.tensor, []).append(r)
        split_at = self.split_at()
        for i, op in enumerate(self.schedule):
            split = split_at.get(i)
            cut = set() if split is None else {*split.cut_inputs, *split.cut_outputs}
            for t in problem.needs(op):
                if t in cut:
                    continue
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
        streamed_out = {(t, sp.position) for sp in self.splits for t in sp.cut_outputs}
        streamed_in = {(t, sp.position) for sp in self.splits for t in sp.cut_inputs}
        for k, s in enumerate(self.swap_outs):
            if (s.tensor, s.after) not in ends | streamed_out:
                raise PlanError(f"swap-out {k} is not issued where a residency of its tensor "
                                f"ends, nor by a split op")
        for k, s in enumerate(self.swap_ins):
            if s.residency < 0:
                if (s.tensor, s.before) not in streamed_in or s.after != s.before - 1:
                    raise PlanError(f"swap-in {k} has no window and streams no split's input")
                self._check_source(problem, k, s, swapped_out_at)
                continue
            r = self.residencies[s.residency]
            if r.tensor != s.tensor or r.swap_in != k or r.begin != s.after + 1:
                raise PlanError(f"swap-in {k} does not match its residency")
            if not s.after < s.before <= r.end:
                raise PlanError(f"swap-in {k} is needed before it is issued")
            self._check_source(problem, k, s, swapped_out_at)

    def _check_source(self, problem: SwapProblem, k: int, s: SwapIn,
                      swapped_out_at: dict[int, int]) -> None:
        """A swap-in of a tensor made on the device follows, and waits for, its swap-out."""
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
        data["splits"] = [Split(**s) for s in data.get("splits", [])]
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SwapPlan:
        return cls.from_dict(json.loads(text))
