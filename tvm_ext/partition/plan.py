"""`PartitionPlan`: how every tensor and operator is split, and what that costs (no IR).

What a lowering pass needs, per mesh level (level 1 = outermost; index convention in
`layout.py`):

* per tensor: its stored `layout` (REP = -1 or the cut axis, per level), the local shape and the
  bytes one device stores;
* per operator: its `strategy` (the op dim split at each level, -1 = replicated, named in
  `dims`), for each input the `required` scheme per level (`[axis, halo_lo, halo_hi]`, axis -1 =
  whole) and the conversion `steps` from the stored layout, in execution order; for each output
  the `produced` scheme (-2 = partial result) and the steps to the stored layout; the allreduces
  inside the kernel (`inner`, named by block and buffer); whether the kernel must be given
  global indices (`global_index`);
* each step: level, collective (allgather, reduce_scatter, allreduce, all_to_all, halo, slice),
  source and destination schemes, the group's data, bytes each device sends, predicted time.

Totals: bytes each device sends per iteration, communication / compute / iteration time,
per-device peak memory (stored pieces plus the transient converted copies, over the graph's
order) and the replicated part of it (bytes beyond 1/k of each live tensor: replicated tensors,
gathered copies), so that peak <= single-device peak / k + replicated.
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


def _ordered(steps: list[Step]) -> list[dict]:
    """Steps in execution order: shrinking, size-preserving, growing; deepest level first."""
    return [s.to_dict() for s in sorted(steps, key=lambda s: (_PHASE[s.kind], -s.level))]


@dataclasses.dataclass
class PartitionPlan:
    """A partition of one graph over `num_devices` devices (see the module docstring)."""

    num_devices: int
    mesh: list[int]
    links: list[str]
    hardware: str
    strategy: str
    tensors: list[dict]
    ops: list[dict]
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
        splits = [int(np.prod([p for p, d in zip(self.mesh, o["strategy"], strict=True)
                               if d >= 0])) for o in self.ops]
        local = []
        for t, info in zip(graph.tensors, self.tensors, strict=True):
            if t.kind == "workspace":
                size = t.nbytes // splits[t.producer]
            else:
                size = int(info["bytes_per_device"])
            if info.get("materialized"):
                t = dataclasses.replace(t, alias_of=None)
            local.append(dataclasses.replace(t, nbytes=size))
        transient = np.array([o.get("transient_bytes", 0.0) for o in self.ops])
        order = np.asarray(graph.order)
        return DataflowGraph(graph.ops, local, graph.outputs, graph.function, graph.num_input) \
            .memory_timeline(kinds=kinds).astype(np.float64) + transient[order]

    def peak_memory(self, graph: DataflowGraph, kinds: Sequence[str] = TENSOR_KINDS) -> int:
        """The peak of `memory_timeline`."""
        if not graph.ops:
            return 0
        return int(self.memory_timeline(graph, kinds).max())

    def tensor_layouts(self) -> dict[str, list[int]]:
        return {t["name"]: t["layout"] for t in self.tensors}

    def op_strategies(self) -> dict[str, list[str]]:
        return {o["name"]: o["dims"] for o in self.ops}

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
            "replicated_ops": sum(all(d < 0 for d in o["strategy"]) for o in self.ops),
            "unsupported": len(self.unsupported),
            "search_seconds": self.search_seconds,
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PartitionPlan:
        return cls(**data)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> PartitionPlan:
        return cls.from_dict(json.loads(text))


def build_plan(model: PartitionModel, state: State, strategy: str,
               search_seconds: float = 0.0) -> PartitionPlan:
    """Evaluate a complete assignment into a plan."""
    g = model.graph
    mesh = model.mesh
    k = int(np.prod(mesh))
    tensors = []
    for t in g.tensors:
        layout = [int(s) for s in state.layout[t.id]]
        tensors.append({
            "id": t.id, "name": t.name, "shape": list(t.shape), "dtype": t.dtype,
            "kind": t.kind, "layout": layout,
            "local_shape": list(local_shape(t.shape, mesh, layout)),
            "bytes_per_device": model.stored_bytes(t.id, layout),
        })
    ops = []
    counts: Counter = Counter()
    sent: Counter = Counter()
    comm = compute = latency = 0.0
    transient = np.zeros(len(g.ops))
    materialized: set[int] = set()
    dying = _dying(g)
    for op in g.ops:
        strategy_l = [int(d) for d in state.strategy[op.id]]
        spec = model.specs[op.id]
        names = ["replicate" if d == REP else spec.dims[d].name for d in strategy_l]
        op_steps: list[Step] = []
        inputs, outputs = [], []
        for e in model.edges[op.id]:
            layout = state.layout[e.tensor]
            steps = model.edge_steps(e, op.id, layout, strategy_l)
            op_steps += steps
            if e.output:
                produced = [model.produced(op.id, e.position, d) for d in strategy_l]
                outputs.append({"tensor": e.tensor, "position": e.position,
                                "produced": produced, "steps": _ordered(steps)})
            else:
                required = [model.required(op.id, e.position, d) for d in strategy_l]
                inputs.append({"tensor": e.tensor, "position": e.position,
                               "required": [[r.axis, r.halo_lo, r.halo_hi] for r in required],
                               "steps": _ordered(steps)})
        transient[op.id], view_copy = _transient(model, op.id, strategy_l, state.layout,
                                                 dying.get(op.id, set()))
        if view_copy:
            materialized.add(op.outputs[0])
        inner = model.inner_steps(op.id, strategy_l)
        op_steps += inner
        op_compute = model.compute_time(op.id, strategy_l)
        compute += op_compute
        for s in op_steps:
            comm += s.time
            latency += s.latency
            if s.kind != "slice":
                counts[s.kind] += 1
                sent[s.kind] += s.bytes
        global_index = any(d >= 0 and spec.dims[d].global_index for d in strategy_l)
        ops.append({
            "id": op.id, "name": op.name, "kernel": op.kernel, "phase": op.phase,
            "strategy": strategy_l, "dims": names, "inputs": inputs, "outputs": outputs,
            "inner": [dict(s.to_dict(), buffer=b) for s, b in _inner_names(spec, strategy_l,
                                                                         inner)],
            "compute_time": op_compute, "global_index": global_index,
            "transient_bytes": float(transient[op.id]),
        })
    for t in materialized:
        tensors[t]["materialized"] = True
        tensors[t]["bytes_per_device"] = _local_bytes(model, t, state.layout[t])
    peak, replicated = _memory(model, state, transient, materialized)
    single = int(g.peak_memory())
    collectives = {kind: {"count": counts[kind], "bytes_per_device": sent[kind]}
                   for kind in sorted(counts)}
    return PartitionPlan(
        num_devices=k, mesh=list(mesh), links=[link.name for link in model.links],
        hardware=model.hardware.name, strategy=strategy, tensors=tensors, ops=ops,
        bytes_per_device=float(sum(sent.values())), comm_time=comm, latency_time=latency,
        compute_time=compute,
        peak_bytes_per_device=peak, replicated_at_peak=replicated,
        single_device_peak=single,
        collectives=collectives,
        unsupported=[list(x) for x in model.problem.unsupported()],
        objective=objective(model, state), search_seconds=search_seconds,
    )


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
