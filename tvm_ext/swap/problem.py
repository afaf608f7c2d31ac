"""The swap problem: what a swap planner needs to know about one iteration, as plain arrays.

Ops carry a compute duration and the base tensors they touch (inputs, outputs, kernel scratch);
tensors carry their size and whether they may start on the host (function arguments: a host
copy exists before the iteration). An op may overwrite a tensor in place (`op_writes`: an
optimizer step's update of a parameter or its state): from then on the host copy is stale, so
evicting the tensor copies it out, and an argument that starts the iteration on the host ends
it there, written back (the plan is a steady state across iterations). The op follows every
other reader of what it overwrites (`op_deps` holds those too). Such a function (a training
step) returns its other outputs (the loss) from the host (`end_on_host`): the caller keeps
the return value, which must not hold device memory into the next iteration.
Views are resolved to their base: they take no bytes, and a view op needs nothing resident
(the base must be resident where the view is used, not where it is made). `pinned` tensors
(module constants by default) stay on the device for the whole iteration, outside the planned
pools. Sizes in the problem are rounded up to the pool alignment (256 bytes), the granularity at
which the SwapOffload pass places tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import numpy as np

from ..cost.hardware import Hardware, get_hardware
from ..cost.roofline import op_times as roofline_op_times
from ..errors import InputError
from ..graph import DataflowGraph
from ..units import format_size, parse_size
from .alignment import align
from .split import SplitOption, finest_working_set, largest_working_set


class InfeasibleBudgetError(InputError):
    """The device budget is below what a single op needs resident while it runs."""

    def __init__(self, budget: int, minimum: int, op_name: str, pinned: int = 0,
                 no_swap_peak: int | None = None):
        self.budget, self.minimum, self.op_name = int(budget), int(minimum), op_name
        self.no_swap_peak = no_swap_peak  # of the graph refused, where known
        super().__init__(
            f"device budget {format_size(budget, 2)} cannot run this graph: op {op_name!r} alone "
            f"needs {format_size(minimum - pinned, 2)} resident while it runs"
            + (f" plus {format_size(pinned, 2)} of constants kept on the device" if pinned else "")
            + f", so the smallest feasible budget is {format_size(minimum, 2)} ({minimum} bytes); "
            f"raise the budget to at least that")


@dataclasses.dataclass
class SwapProblem:
    """One iteration to plan under a device memory budget (see the module docstring).

    Tensor ids and op ids are those of the `DataflowGraph` the problem came from, so a plan's
    ids index the graph directly.
    """

    op_names: list[str]
    durations: np.ndarray  # seconds per op (float64)
    op_deps: list[list[int]]  # ops each op must follow (producers of its inputs)
    op_inputs: list[list[int]]  # base tensors read
    op_outputs: list[list[int]]  # base tensors written (a view op "writes" nothing new)
    op_scratch: list[list[int]]  # kernel scratch (counted only if count_scratch)
    op_phases: list[str]  # "forward" / "backward" (vDNN's policy needs it)
    tensor_names: list[str]
    sizes: np.ndarray  # bytes per tensor, aligned; 0 for views (int64)
    tensor_kinds: list[str]
    producers: list[int]  # producing op, -1 for arguments and constants
    host_start: np.ndarray  # bool: a valid host copy exists before the iteration
    pinned: np.ndarray  # bool: on the device for the whole iteration, outside the pools
    outputs: list[int]  # base tensors the function returns
    budget: int  # device bytes for the pools plus pinned tensors
    h2d_bandwidth: float  # bytes/s
    h2d_latency: float  # s per copy
    d2h_bandwidth: float
    d2h_latency: float
    count_scratch: bool = False
    order: list[int] | None = None  # the IR's schedule (default 0..n-1)
    name: str = ""
    op_kinds: list[str] | None = None  # "kernel" / "view" / "builtin" (None: all kernels)
    # Per op, the dims it may be split along in time (`SplitOption.to_list()`); None: none.
    op_splits: list[list[list]] | None = None
    copy_issue: float = 0.0  # compute-stream seconds per copy issued (`Hardware`)
    sync_latency: float = 0.0  # s from an event to the stream stalled on it resuming
    # Measured hand-over of a copy to an idle stream by its idle time (`Hardware.copy_wake`);
    # () : `copy_issue`, the copy starting `sync_latency` after it.
    copy_wake: tuple = ()
    op_writes: list[list[int]] | None = None  # base tensors each op overwrites in place
    end_on_host: list[int] | None = None  # outputs copied to the host at the end
    # Compute-stream seconds each kernel call beyond an op's first costs (`Hardware`): what
    # every further chunk of an op split in time pays besides its share of the work.
    launch_overhead: float = 0.0
    # The kernel each op calls (None: unknown): ops of one kernel do the same work at the same
    # shapes, which shows the search the repeats of a block (`repeats.py`).
    op_kernels: list[str] | None = None

    def __post_init__(self):
        self.durations = np.asarray(self.durations, dtype=np.float64)
        self.sizes = np.asarray(self.sizes, dtype=np.int64)
        self.host_start = np.asarray(self.host_start, dtype=bool)
        self.pinned = np.asarray(self.pinned, dtype=bool)
        self.copy_wake = tuple(sorted(tuple(float(x) for x in p) for p in self.copy_wake))
        if any(len(p) != 3 or min(p) < 0 for p in self.copy_wake):
            raise ValueError("copy_wake takes (idle s, issue s, start s) points, all >= 0, got "
                             f"{self.copy_wake}")
        if self.order is None:
            self.order = list(range(self.num_ops))
        if self.op_writes is None:
            self.op_writes = [[] for _ in range(self.num_ops)]
        if self.end_on_host is None:
            self.end_on_host = []
        if not self.is_topological(self.order):
            raise ValueError("the problem's default order is not topological")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_graph(
        cls,
        graph: DataflowGraph,
        budget: int,
        hardware: str | Hardware = "gtx1080ti",
        op_times: Sequence[float] | None = None,
        *,
        count_scratch: bool = False,
        pin_constants: bool = True,
        name: str = "",
    ) -> SwapProblem:
        """The problem of one call of `graph`'s function on `hardware` with `budget` bytes.

        op_times: measured seconds per op (`tvm_ext.cost.calibration.op_times_measured`);
            roofline otherwise.
        count_scratch: kernel scratch (`workspace` tensors) counts against the budget. Off by
            default: on TVM's CPU backend scratch is not allocated by the VM allocator.
        pin_constants: module constants stay on the device (the VM loads them there).
        """
        hw = get_hardware(hardware)
        durations = (roofline_op_times(graph, hw) if op_times is None
                     else np.asarray(op_times, dtype=np.float64))
        if len(durations) != graph.num_ops:
            raise ValueError(f"{len(durations)} op times for {graph.num_ops} ops")
        base = [graph.base(t.id) for t in graph.tensors]
        sizes = np.array([0 if t.alias_of is not None else align(t.nbytes)
                          for t in graph.tensors], dtype=np.int64)
        op_inputs, op_outputs, op_scratch, op_deps = [], [], [], []
        for op in graph.ops:
            # A view reads and writes nothing: SwapOffload re-derives it from its base at
            # each use.
            ins = [] if op.kind == "view" else _unique(base[t] for t in op.inputs)
            outs = [] if op.kind == "view" else \
                [b for b in _unique(base[t] for t in op.outputs) if b not in ins]
            op_inputs.append(ins)
            op_outputs.append(outs)
            op_scratch.append([op.workspace] if op.workspace is not None else [])
            op_deps.append(_unique([*(graph.tensors[t].producer for t in op.inputs
                                      if graph.tensors[t].producer is not None),
                                    *graph.must_follow(op.id)]))
        kinds = [t.kind for t in graph.tensors]
        is_arg = np.array([k in ("parameter", "state", "input") for k in kinds])
        is_const = np.array([k == "constant" for k in kinds])
        pinned = is_const & pin_constants
        host_start = is_arg | (is_const & ~pinned)
        return cls(
            op_names=[op.name for op in graph.ops], durations=durations, op_deps=op_deps,
            op_inputs=op_inputs, op_outputs=op_outputs, op_scratch=op_scratch,
            op_phases=[op.phase for op in graph.ops],
            tensor_names=[t.name for t in graph.tensors], sizes=sizes, tensor_kinds=kinds,
            producers=[-1 if t.producer is None else t.producer for t in graph.tensors],
            host_start=host_start, pinned=pinned,
            outputs=_unique(base[t] for t in graph.outputs), budget=int(budget),
            h2d_bandwidth=hw.host_to_device.bandwidth, h2d_latency=hw.host_to_device.latency,
            d2h_bandwidth=hw.device_to_host.bandwidth, d2h_latency=hw.device_to_host.latency,
            count_scratch=count_scratch, order=graph.order, name=name or graph.function,
            op_kinds=[op.kind for op in graph.ops],
            op_splits=None if all(op.time_splits is None for op in graph.ops) else
            [op.time_splits or [] for op in graph.ops],
            copy_issue=hw.copy_issue_overhead, sync_latency=hw.sync_overhead,
            copy_wake=hw.copy_wake,
            launch_overhead=hw.launch_overhead,
            op_kernels=[op.kernel for op in graph.ops],
            op_writes=[graph.overwritten(op.id) for op in graph.ops],
            end_on_host=_returned_from_host(graph),
        )

    def with_budget(self, budget: int) -> SwapProblem:
        """This problem under another budget (what does not depend on it is not recomputed)."""
        other = dataclasses.replace(self, budget=int(budget))
        for name in ("_split_options", "_min_budget", "_needs", "_needs_csr", "_written"):
            if name in self.__dict__:
                other.__dict__[name] = self.__dict__[name]
        return other

    # ---------------------------------------------------------------- queries
    @property
    def num_ops(self) -> int:
        return len(self.op_names)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_names)

    def needs(self, op: int) -> list[int]:
        """Base tensors that must be resident while `op` runs (pinned ones included); the
        caller must not change the list (built once per problem: planners ask per op, again
        and again)."""
        return self._needs[op]

    @functools.cached_property
    def _needs(self) -> list[list[int]]:
        return [_unique([*self.op_inputs[op], *self.op_outputs[op],
                         *(self.op_scratch[op] if self.count_scratch else [])])
                for op in range(self.num_ops)]

    def is_topological(self, order: Sequence[int]) -> bool:
        if len(order) != self.num_ops or sorted(order) != list(range(self.num_ops)):
            return False
        position = np.empty(self.num_ops, dtype=np.int64)
        position[np.asarray(order, dtype=np.int64)] = np.arange(self.num_ops)
        return all(position[d] < position[op] for op in range(self.num_ops)
                   for d in self.op_deps[op])

    def is_run_sequence(self, runs: Sequence[int]) -> bool:
        """Whether `runs` is a topological order of the ops in which some one-output kernels
        run again later (recompute: `tvm_ext.swap.recompute`)."""
        first: dict[int, int] = {}
        for i, op in enumerate(runs):
            first.setdefault(int(op), i)
        if len(first) != self.num_ops or not self.is_topological(sorted(first, key=first.get)):
            return False
        return all(self.may_run_again(int(op)) for i, op in enumerate(runs)
                   if first[int(op)] != i)

    def may_run_again(self, op: int) -> bool:
        """Whether `op` may run a second time (recompute): a kernel with one output, and no
        in-place write involved (a second run would read what was written in between)."""
        kinds = self.op_kinds or ["kernel"] * self.num_ops
        return (kinds[op] == "kernel" and len(self.op_outputs[op]) == 1
                and not self.op_writes[op] and not self._written & set(self.needs(op)))

    def needs_csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The needs of every op as flat arrays: (ptr, tensors, op of each entry), op `k`'s
        needs being tensors[ptr[k]:ptr[k + 1]] (for vectorised sums over ops' needs)."""
        return self._needs_csr

    @functools.cached_property
    def _needs_csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        counts = np.array([len(n) for n in self._needs], dtype=np.int64)
        ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        idx = np.array([t for n in self._needs for t in n], dtype=np.int64)
        return ptr, idx, np.repeat(np.arange(self.num_ops, dtype=np.int64), counts)

    def whole_working_sets(self, fixed: np.ndarray) -> np.ndarray:
        """Per op, the bytes of its needs that are not `fixed` (what it needs in the pools
        run whole)."""
        _, idx, op_of = self.needs_csr()
        return np.bincount(op_of, weights=self.sizes[idx] * ~fixed[idx],
                           minlength=self.num_ops).astype(np.int64)

    @functools.cached_property
    def _written(self) -> set[int]:
        return {t for ts in self.op_writes for t in ts}

    def writer(self) -> np.ndarray:
        """The op that overwrites each tensor in place (-1: none); at most one per tensor."""
        out = np.full(self.num_tensors, -1, dtype=np.int64)
        for op, tensors in enumerate(self.op_writes):
            for t in tensors:
                if out[t] >= 0:
                    raise ValueError(f"tensor {self.tensor_names[t]} is overwritten by two ops")
                out[t] = op
        return out

    @property
    def pinned_bytes(self) -> int:
        return int(self.sizes[self.pinned].sum())

    def movable_arguments(self) -> np.ndarray:
        """The arguments that may start the iteration on the host: not pinned, not empty."""
        return np.nonzero(self.host_start & ~self.pinned & (self.sizes > 0))[0]

    def split_options(self) -> list[list[SplitOption]]:
        """Per op, the dims it may be split along in time (`tvm_ext.swap.split`); built once
        per problem (planners ask for them per op, thousands of times)."""
        return self._split_options

    @functools.cached_property
    def _split_options(self) -> list[list[SplitOption]]:
        if self.op_splits is None:
            return [[] for _ in range(self.num_ops)]
        # A kernel that writes in place splits only where no chunk reads what another wrote
        # (an optimizer's elementwise update: each chunk updates its own slice).
        options = [[SplitOption.from_list(o) for o in ops] for ops in self.op_splits]
        return [[o for o in opts if not writes or o.in_place_safe(writes)]
                for opts, writes in zip(options, self.op_writes, strict=True)]

    def op_working_set(self, op: int, split: bool = True) -> int:
        """Aligned bytes of `op`'s unpinned needs: what must fit in the pools while it runs
        (with `split`, at its finest split in time where that needs less)."""
        whole = int(sum(self.sizes[t] for t in self.needs(op) if not self.pinned[t]))
        if not split or self.op_splits is None:
            return whole
        finest = finest_working_set(self.sizes, self.needs(op), self.pinned,
                                    self.split_options()[op])
        return whole if finest is None else min(whole, finest)

    def min_budget(self) -> tuple[int, int]:
        """(smallest budget that can run the graph, splitting ops in time where that needs
        less; the op that sets it)."""
        return self._min_budget

    @functools.cached_property
    def _min_budget(self) -> tuple[int, int]:
        if self.num_ops == 0:
            return self.pinned_bytes, -1
        most, op = largest_working_set(self, self.pinned)
        return self.pinned_bytes + most, op

    def check_feasible(self) -> None:
        """Raise `InfeasibleBudgetError` if no plan can run the graph within the budget."""
        minimum, op = self.min_budget()
        if self.budget < minimum:
            raise InfeasibleBudgetError(self.budget, minimum,
                                        self.op_names[op] if op >= 0 else "<constants>",
                                        self.pinned_bytes, self.no_swap_peak())

    def no_swap_peak(self, order: Sequence[int] | None = None) -> int:
        """Peak device bytes with everything on the device and nothing swapped (arguments and
        pinned tensors resident throughout, others from production to last use)."""
        order = self.order if order is None else list(order)
        n = len(order)
        start = np.zeros(self.num_tensors, dtype=np.int64)
        end = np.full(self.num_tensors, -1, dtype=np.int64)
        resident_all = self.host_start | self.pinned
        end[resident_all] = n - 1
        for pos, op in enumerate(order):
            for t in self.needs(op):
                if self.producers[t] == op:
                    start[t] = pos
                end[t] = max(end[t], pos)
        for t in self.outputs:
            end[t] = n - 1
        delta = np.zeros(n + 1, dtype=np.int64)
        live = end >= 0
        np.add.at(delta, start[live], self.sizes[live])
        np.add.at(delta, end[live] + 1, -self.sizes[live])
        return int(np.cumsum(delta)[:n].max()) if n else int(self.sizes[resident_all].sum())

    def transfer_time(self, nbytes: float, direction: str) -> float:
        bw, lat = ((self.h2d_bandwidth, self.h2d_latency) if direction == "h2d"
                   else (self.d2h_bandwidth, self.d2h_latency))
        return lat + nbytes / bw if nbytes > 0 else 0.0

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for key in ("durations", "sizes", "host_start", "pinned"):
            data[key] = getattr(self, key).tolist()
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> SwapProblem:
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SwapProblem:
        return cls.from_dict(json.loads(text))


def _returned_from_host(graph: DataflowGraph) -> list[int]:
    """The outputs a function that updates arguments in place returns from the host: those
    that are not the updates (which go to their arguments)."""
    if not any(t.overwrites is not None for t in graph.tensors):
        return []
    return _unique(graph.base(t) for t in graph.outputs
                   if graph.tensors[t].overwrites is None and graph.tensors[t].arg_index is None
                   and graph.tensors[graph.base(t)].kind not in ("constant",))


def _unique(items) -> list[int]:
    seen: dict[int, None] = {}
    for x in items:
        seen.setdefault(int(x), None)
    return list(seen)


def problem_for_budget(
    graph: DataflowGraph,
    device_memory: int | str,
    hardware: str | Hardware = "h100",
    op_times: Sequence[float] | None = None,
    reserved: int = 0,
) -> SwapProblem:
    """The swap problem of `graph` under `device_memory` (bytes, "512MiB", "25%" of the
    no-swap peak, or "min": the smallest budget any plan can run in). `reserved`: bytes of
    device memory that are not the graph's (a vendor library's workspace); an absolute budget
    is the whole device memory, so the plan gets what is left beside them (a percentage or
    "min" is of the graph's own peak)."""
    problem = SwapProblem.from_graph(graph, 1, hardware, op_times)
    text = device_memory.strip().lower() if isinstance(device_memory, str) else ""
    if text == "min":
        return problem.with_budget(problem.min_budget()[0])
    budget = parse_size(device_memory, reference=problem.no_swap_peak())
    if text.endswith("%"):
        return problem.with_budget(budget)
    if reserved and budget <= reserved:
        raise InputError(f"a device budget of {format_size(budget)} leaves nothing beside the "
                         f"{format_size(reserved)} the vendor library's workspace takes")
    return problem.with_budget(budget - reserved)
