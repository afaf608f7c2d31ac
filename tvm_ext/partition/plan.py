"""`PartitionPlan`: how every tensor and operator is split, and what that costs (no IR).

What a lowering pass needs, per mesh level (level 1 = outermost; index convention in
`layout.py`):

* per tensor (`TensorPlacement`): its stored `layout` (REP = -1 or the cut axis, per level), the
  local shape and the bytes one device stores;
* per operator (`OpPlacement`): its `strategy` (the op dim split at each level, -1 =
  replicated, named in `dims`), for each input (`InputConversion`) the `required` scheme per
  level (`[axis, halo_lo, halo_hi]`, axis -1 = whole) and the conversion `steps` from the
  stored layout, in execution order; for each output (`OutputConversion`) the `produced` scheme
  (-2 = partial result) and the steps to the stored layout; the allreduces inside the kernel
  (`inner`, `InnerStep`s naming the buffer); whether the kernel must be given global indices
  (`global_index`);
* each step (`layout.Step`): level, collective (allgather, reduce_scatter, allreduce,
  all_to_all, halo, slice), source and destination schemes, the group's data, bytes each device
  sends, predicted time.

Totals: bytes each device sends per iteration, communication / compute / iteration time,
per-device peak memory (stored pieces plus the transient converted copies, over the graph's
order) and the replicated part of it (bytes beyond 1/k of each live tensor: replicated tensors,
gathered copies), so that peak <= single-device peak / k + replicated.

`to_dict`/`to_json` write plain JSON (the records as objects with these field names);
`from_dict`/`from_json` read it back into the typed records.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence

import numpy as np

from ..graph import TENSOR_KINDS, DataflowGraph
from .layout import PARTIAL, REP, Step, conversion_sequence, local_shape
from .model import PartitionModel
from .search import State, objective

_PHASE = {"slice": 0, "reduce_scatter": 0, "all_to_all": 1, "allreduce": 1, "halo": 1,
          "allgather": 2}


def _ordered(steps: list[Step]) -> list[Step]:
    """Steps in execution order: shrinking, size-preserving, growing; deepest level first."""
    return sorted(steps, key=lambda s: (_PHASE[s.kind], -s.level))


@dataclasses.dataclass(frozen=True)
class InnerStep(Step):
    """An allreduce inside a kernel: its step and the buffer it reduces."""

    buffer: str

    @classmethod
    def of(cls, step: Step, buffer: str) -> InnerStep:
        return cls(**dataclasses.asdict(step), buffer=buffer)


@dataclasses.dataclass
class InputConversion:
    """One input of an op: the scheme the kernel requires per level (`[axis, halo_lo,
    halo_hi]`, axis -1 = whole) and the steps from the stored layout, in execution order."""

    tensor: int
    position: int
    required: list[list[int]]
    steps: list[Step]

    @classmethod
    def from_dict(cls, data: dict) -> InputConversion:
        conv = cls(**data)
        conv.steps = [Step(**s) for s in conv.steps]
        return conv


@dataclasses.dataclass
class OutputConversion:
    """One output of an op: the scheme the kernel produces per level (-2 = partial result)
    and the steps to the stored layout, in execution order."""

    tensor: int
    position: int
    produced: list[int]
    steps: list[Step]

    @classmethod
    def from_dict(cls, data: dict) -> OutputConversion:
        conv = cls(**data)
        conv.steps = [Step(**s) for s in conv.steps]
        return conv


@dataclasses.dataclass
class TensorPlacement:
    """How one tensor is stored: its `layout` per level (REP = -1 or the cut axis), the local
    shape and the bytes one device stores. `materialized`: a view whose result is a copy of
    its own (it then stores its local bytes)."""

    id: int
    name: str
    shape: list[int]
    dtype: str
    kind: str
    layout: list[int]
    local_shape: list[int]
    bytes_per_device: float
    materialized: bool = False

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        if not self.materialized:  # the JSON names the flag only where it is set
            del data["materialized"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> TensorPlacement:
        return cls(**data)


@dataclasses.dataclass
class OpPlacement:
    """How one operator runs: its `strategy` (the op dim split at each level, -1 =
    replicated, named in `dims`), its inputs' and outputs' conversions, the allreduces inside
    the kernel (`inner`), whether the kernel must be given global indices (`global_index`),
    its compute time and the bytes of the converted copies it holds while it runs
    (`transient_bytes`; None where the JSON does not record them: counted as 0)."""

    id: int
    name: str
    kernel: str
    phase: str
    strategy: list[int]
    dims: list[str]
    inputs: list[InputConversion]
    outputs: list[OutputConversion]
    inner: list[InnerStep]
    compute_time: float
    global_index: bool
    transient_bytes: float | None = None

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        if self.transient_bytes is None:
            del data["transient_bytes"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> OpPlacement:
        op = cls(**data)
        op.inputs = [InputConversion.from_dict(e) for e in op.inputs]
        op.outputs = [OutputConversion.from_dict(e) for e in op.outputs]
        op.inner = [InnerStep(**s) for s in op.inner]
        return op


@dataclasses.dataclass
class PartitionPlan:
    """A partition of one graph over `num_devices` devices (see the module docstring)."""

    num_devices: int
    mesh: list[int]
    links: list[str]
    hardware: str
    strategy: str
    tensors: list[TensorPlacement]  # indexed by tensor id
    ops: list[OpPlacement]  # indexed by op id
    bytes_per_device: float
    comm_time: float  # bytes over link bandwidth
    latency_time: float  # link latency of every message round, unbucketed
    compute_time: float
    peak_bytes_per_device: int
    replicated_at_peak: int  # bytes held beyond 1/k of each tensor at that peak
    single_device_peak: int
    collectives: dict[str, dict]
    unsupported: list[list[str]]
    objective: float = 0.0  # what the search minimised (see model.py)
    search_seconds: float = 0.0
    # Tensors the search held at a fixed layout (replicated, or data parallelism's) because
    # choosing theirs jointly with the rest was out of its reach (`Searcher.solve_holding`).
    held: list[str] = dataclasses.field(default_factory=list)

    @property
    def iteration_time(self) -> float:
        """Compute plus communication, nothing overlapped, latency of bucketed collectives
        neglected (what the search minimises, see `model.py`)."""
        return self.comm_time + self.compute_time

    @property
    def total_bytes(self) -> float:
        """Bytes sent by all devices together."""
        return self.bytes_per_device * self.num_devices

    @property
    def memory_bound(self) -> float:
        """1/k of the single-device peak plus what the plan replicates at its peak."""
        return self.single_device_peak / self.num_devices + self.replicated_at_peak

    @property
    def memory_ratio(self) -> float:
        """Peak per device over `memory_bound` (at most 1: the peak is 1/k of the live tensors
        at that step, which the single-device peak bounds, plus the replicated bytes)."""
        return self.peak_bytes_per_device / max(self.memory_bound, 1.0)

    def memory_timeline(self, graph: DataflowGraph,
                        kinds: Sequence[str] = TENSOR_KINDS) -> np.ndarray:
        """Bytes one device holds at each op of `graph` (the graph this plan was made for):
        the stored pieces of the tensors of `kinds` plus the transient converted copies of each
        op. With every kind it peaks at `peak_bytes_per_device`; with the kinds a runtime
        allocator sees (no kernel workspace, no module constants) it predicts what a device
        measures in an unplanned build."""
        if len(graph.tensors) != len(self.tensors) or len(graph.ops) != len(self.ops):
            raise ValueError("the graph is not the one this plan was made for")
        splits = [int(np.prod([p for p, d in zip(self.mesh, o.strategy, strict=True)
                               if d >= 0])) for o in self.ops]
        local = []
        for t, info in zip(graph.tensors, self.tensors, strict=True):
            if t.kind == "workspace":
                size = t.nbytes // splits[t.producer]
            else:
                size = int(info.bytes_per_device)
            if info.materialized:
                t = dataclasses.replace(t, alias_of=None)
            local.append(dataclasses.replace(t, nbytes=size))
        transient = np.array([o.transient_bytes or 0.0 for o in self.ops])
        order = np.asarray(graph.order)
        return DataflowGraph(graph.ops, local, graph.outputs, graph.function, graph.num_input) \
            .memory_timeline(kinds=kinds).astype(np.float64) + transient[order]

    def peak_memory(self, graph: DataflowGraph, kinds: Sequence[str] = TENSOR_KINDS) -> int:
        """The peak of `memory_timeline`."""
        if not graph.ops:
            return 0
        return int(self.memory_timeline(graph, kinds).max())

    def tensor_layouts(self) -> dict[str, list[int]]:
        return {t.name: t.layout for t in self.tensors}

    def op_strategies(self) -> dict[str, list[str]]:
        return {o.name: o.dims for o in self.ops}

    def summary(self) -> dict:
        return {
            "strategy": self.strategy,
            "num_devices": self.num_devices,
            "mesh": self.mesh,
            "links": self.links,
            "bytes_per_device": self.bytes_per_device,
            "total_bytes": self.total_bytes,
            "comm_time_s": self.comm_time,
            "latency_time_s": self.latency_time,
            "compute_time_s": self.compute_time,
            "iteration_time_s": self.iteration_time,
            "objective": self.objective,
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "single_device_peak": self.single_device_peak,
            "replicated_at_peak": self.replicated_at_peak,
            "memory_bound": self.memory_bound,
            "memory_ratio": self.memory_ratio,
            "collectives": self.collectives,
            "replicated_ops": sum(all(d < 0 for d in o.strategy) for o in self.ops),
            "unsupported": len(self.unsupported),
            "held": len(self.held),
            "search_seconds": self.search_seconds,
        }

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["tensors"] = [t.to_dict() for t in self.tensors]
        data["ops"] = [o.to_dict() for o in self.ops]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> PartitionPlan:
        """The plan `to_dict` gave; raises TypeError where a record lacks a field or has one
        it does not know."""
        plan = cls(**data)
        plan.tensors = [TensorPlacement.from_dict(t) for t in plan.tensors]
        plan.ops = [OpPlacement.from_dict(o) for o in plan.ops]
        return plan

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> PartitionPlan:
        return cls.from_dict(json.loads(text))


def build_plan(model: PartitionModel, state: State, strategy: str,
               search_seconds: float = 0.0) -> PartitionPlan:
    """Evaluate a complete assignment into a plan."""
    g = model.graph
    counts: Counter = Counter()
    sent: Counter = Counter()
    comm = compute = latency = 0.0
    ops = []
    materialized: set[int] = set()
    dying = _dying(g)
    for op in g.ops:
        placed, op_steps, view_copy = _place_op(model, state, op.id, dying.get(op.id, set()))
        ops.append(placed)
        if view_copy:
            materialized.add(op.outputs[0])
        compute += placed.compute_time
        for s in op_steps:
            comm += s.time
            latency += s.latency
            if s.kind != "slice":
                counts[s.kind] += 1
                sent[s.kind] += s.bytes
    tensors = [_place_tensor(model, state, t.id, t.id in materialized) for t in g.tensors]
    transient = np.array([o.transient_bytes for o in ops], dtype=np.float64)
    peak, replicated = _memory(model, state, transient, materialized)
    collectives = {kind: {"count": counts[kind], "bytes_per_device": sent[kind]}
                   for kind in sorted(counts)}
    return PartitionPlan(
        num_devices=int(np.prod(model.mesh)), mesh=list(model.mesh),
        links=[link.name for link in model.links], hardware=model.hardware.name,
        strategy=strategy, tensors=tensors, ops=ops,
        bytes_per_device=float(sum(sent.values())), comm_time=comm, latency_time=latency,
        compute_time=compute,
        peak_bytes_per_device=peak, replicated_at_peak=replicated,
        single_device_peak=int(g.peak_memory()),
        collectives=collectives,
        unsupported=[list(x) for x in model.problem.unsupported()],
        objective=objective(model, state), search_seconds=search_seconds,
        held=[g.tensors[t].name for t in state.held],
    )


def _place_tensor(model: PartitionModel, state: State, tensor: int,
                  materialized: bool) -> TensorPlacement:
    t = model.graph.tensors[tensor]
    layout = [int(s) for s in state.layout[tensor]]
    if materialized:  # a view's own copy stores its local bytes
        stored = _local_bytes(model, tensor, state.layout[tensor])
    else:
        stored = model.stored_bytes(tensor, layout)
    return TensorPlacement(
        id=t.id, name=t.name, shape=list(t.shape), dtype=t.dtype, kind=t.kind, layout=layout,
        local_shape=list(local_shape(t.shape, model.mesh, layout)), bytes_per_device=stored,
        materialized=materialized)


def _place_op(model: PartitionModel, state: State, op_id: int,
              dying: set[int]) -> tuple[OpPlacement, list[Step], bool]:
    """An op's record, every step it runs (its edges' conversions in edge order, then the
    allreduces inside the kernel) and whether a view's result must be a copy of its own."""
    op = model.graph.ops[op_id]
    strategy = [int(d) for d in state.strategy[op_id]]
    spec = model.specs[op_id]
    op_steps: list[Step] = []
    inputs, outputs = [], []
    for e in model.edges[op_id]:
        steps = model.edge_steps(e, op_id, state.layout[e.tensor], strategy)
        op_steps += steps
        if e.output:
            produced = [model.produced(op_id, e.position, d) for d in strategy]
            outputs.append(OutputConversion(e.tensor, e.position, produced, _ordered(steps)))
        else:
            required = [model.required(op_id, e.position, d) for d in strategy]
            inputs.append(InputConversion(e.tensor, e.position,
                                          [[r.axis, r.halo_lo, r.halo_hi] for r in required],
                                          _ordered(steps)))
    transient, view_copy = _transient(model, op_id, strategy, state.layout, dying)
    inner = model.inner_steps(op_id, strategy)
    op_steps += inner
    placed = OpPlacement(
        id=op.id, name=op.name, kernel=op.kernel, phase=op.phase, strategy=strategy,
        dims=["replicate" if d == REP else spec.dims[d].name for d in strategy],
        inputs=inputs, outputs=outputs,
        inner=[InnerStep.of(s, b) for s, b in _inner_names(spec, strategy, inner)],
        compute_time=model.compute_time(op_id, strategy),
        global_index=any(d >= 0 and spec.dims[d].global_index for d in strategy),
        transient_bytes=float(transient))
    return placed, op_steps, view_copy


def _inner_names(spec, strategy, inner_steps):
    names = []
    for d in strategy:
        if d >= 0:
            names += [r.buffer for r in spec.dims[d].inner]
    return list(zip(inner_steps, names, strict=True))


def _local_bytes(model: PartitionModel, tensor: int, schemes) -> float:
    size = float(model.nbytes[tensor])
    for p, s in zip(model.mesh, schemes, strict=True):
        if s is not None and s >= 0:
            size /= p
    return size


def _memory(model: PartitionModel, state: State, transient: np.ndarray,
            materialized: set[int]) -> tuple[int, int]:
    """Per-device peak (stored pieces + transient converted copies, over the graph's order) and
    the replicated bytes at that peak: what devices hold beyond 1/k of each live tensor."""
    g = model.graph
    if not g.ops:
        return 0, 0
    k = int(np.prod(model.mesh))
    split_ops = [int(np.prod([p for p, d in zip(model.mesh, state.strategy[op.id], strict=True)
                              if d >= 0])) for op in g.ops]
    local, excess = [], []
    for t in g.tensors:
        if t.kind == "workspace":
            size = t.nbytes // split_ops[t.producer]
        elif t.id in materialized:
            size = int(_local_bytes(model, t.id, state.layout[t.id]))
            t = dataclasses.replace(t, alias_of=None)
        else:
            size = int(model.stored_bytes(t.id, state.layout[t.id]))
        whole = model.nbytes[t.id] if t.id in materialized else t.nbytes
        local.append(dataclasses.replace(t, nbytes=size))
        excess.append(dataclasses.replace(t, nbytes=max(0, size - whole // k)))
    order = np.asarray(g.order)
    per_device = DataflowGraph(g.ops, local, g.outputs, g.function, g.num_input) \
        .memory_timeline().astype(np.float64) + transient[order]
    replicated = DataflowGraph(g.ops, excess, g.outputs, g.function, g.num_input) \
        .memory_timeline().astype(np.float64) + transient[order]
    step = int(np.argmax(per_device))
    return int(per_device[step]), int(replicated[step])


def _dying(g: DataflowGraph) -> dict[int, set[int]]:
    """Op -> the tensors (stored ones, not arguments, views or outputs) it uses last."""
    if not g.ops:
        return {}
    _, end = g.lifetimes()
    order = g.order
    out: dict[int, set[int]] = {}
    for t in g.tensors:
        if t.alias_of is None and t.kind in ("activation", "gradient") and not t.is_output \
                and 0 <= end[t.id] < len(order) and t.consumers:
            out.setdefault(order[end[t.id]], set()).add(t.id)
    return out


def _chain(model: PartitionModel, tensor: int, src, dst, combiners=None) -> list[float]:
    """Bytes of each step's result of one edge's conversion (empty: nothing converted)."""
    return [_local_bytes(model, tensor, s.after)
            for s in conversion_sequence(src, dst, combiners)]


def _chain_peak(sizes: list[float], source_freed: float = 0.0) -> float:
    """Peak bytes while converting, beyond the source: a step's result is allocated while its
    input is alive; the source may be freed after the first step (its last use)."""
    peak = sizes[0]
    for i in range(1, len(sizes)):
        peak = max(peak, sizes[i - 1] + sizes[i] - source_freed)
    return peak


def _transient(model: PartitionModel, op_id: int, strategy, layouts,
               dying: set[int]) -> tuple[float, bool]:
    """Bytes an op holds beyond the graph timeline's stored pieces while it runs, in the order
    a lowering runs it (`conversion_sequence`): inputs converted one by one, the kernel on the
    converted copies writing its produced outputs, outputs converted one by one; every copy and
    every tensor freed after its last use (`dying`: the tensors whose last use is this op).
    Also whether a view's result must be a copy of its own (a converted input or output): it
    then stores its local bytes for its lifetime."""
    g = model.graph
    op = g.ops[op_id]
    levels = model.levels
    unused = set(model.specs[op_id].unused_inputs)
    uses: dict[int, int] = {}
    for t in op.inputs:
        uses[t] = uses.get(t, 0) + 1
    ins = []  # (converted sizes, source bytes freed after its first step)
    for pos, t in enumerate(op.inputs):
        if pos in unused:
            continue
        src = [REP] * levels if model.free[t] else [int(x) for x in layouts[t]]
        dst = [model.required(op_id, pos, d).axis for d in strategy]
        sizes = _chain(model, t, src, dst)
        if sizes:
            freed = model.stored_bytes(t, layouts[t]) if t in dying and uses[t] == 1 else 0.0
            ins.append((sizes, freed))
    outs = []  # (produced bytes, converted sizes)
    for pos, t in enumerate(op.outputs):
        produced = [model.produced(op_id, pos, d) for d in strategy]
        sizes = _chain(model, t, produced, [int(x) for x in layouts[t]])
        if sizes:
            outs.append((_local_bytes(model, t, produced), sizes, t))
    if op.kind == "view":
        if not ins and not outs:
            return 0.0, False
        stored = _local_bytes(model, op.outputs[0], layouts[op.outputs[0]])
        phases = [_chain_peak(*ins[0]) - stored] if ins else []
        if outs:
            phases.append((ins[0][0][-1] if ins else 0.0) + _chain_peak(outs[0][1]) - stored)
        return max(0.0, *phases), True
    stored_all = sum(model.stored_bytes(t, layouts[t]) for t in op.outputs)
    stored_converted = sum(model.stored_bytes(t, layouts[t]) for _, _, t in outs)
    dead_after = sum(model.stored_bytes(t, layouts[t]) for t in set(op.inputs) if t in dying)
    phases = []
    held = freed = 0.0
    for sizes, source in ins:
        phases.append(held - freed + _chain_peak(sizes, source) - stored_all)
        held += sizes[-1]
        freed += source
    pending = sum(produced for produced, _, _ in outs)
    phases.append(held - freed + pending - stored_converted)
    done = 0.0
    for produced, sizes, _ in outs:
        phases.append(done + pending + _chain_peak(sizes) - stored_converted - dead_after)
        done += sizes[-1]
        pending -= produced
    return max(0.0, *phases), False


def layout_name(scheme: int) -> str:
    if scheme == REP:
        return "R"
    if scheme == PARTIAL:
        return "P"
    return f"S{scheme}"


def layouts_of(plan: PartitionPlan, graph: DataflowGraph) -> dict:
    """The layouts a partitioned module takes its arguments in and returns its outputs in:
    `num_devices`, `mesh`, and per argument and output `name`, `shape` (whole), `dtype` and
    `layout` (one entry per mesh level). Outputs that update an argument in place (an
    optimizer step's new parameters and state) are not returned: they are in the argument."""
    args = sorted((t for t in graph.tensors if t.arg_index is not None),
                  key=lambda t: t.arg_index)
    returned = [t for t in graph.outputs if graph.tensors[t].overwrites is None]
    return {"num_devices": plan.num_devices, "mesh": list(plan.mesh),
            "arguments": _layouts(plan, graph, [t.id for t in args]),
            "outputs": _layouts(plan, graph, returned)}


def in_place_mismatches(plan: PartitionPlan, graph: DataflowGraph) -> list[str]:
    """Names of the in-place updates whose layout is not their argument's: the update writes
    into the argument's own pieces, so a plan must give both one layout."""
    by_id = {t.id: t for t in plan.tensors}
    return [t.name for t in graph.tensors if t.overwrites is not None
            and list(by_id[t.id].layout) != list(by_id[graph.base(t.id)].layout)]


def _layouts(plan: PartitionPlan, graph: DataflowGraph, tids) -> list[dict]:
    by_id = {t.id: t for t in plan.tensors}
    return [{"name": graph.tensors[t].name, "shape": list(graph.tensors[t].shape),
             "dtype": graph.tensors[t].dtype, "layout": list(by_id[t].layout)}
            for t in tids]
