"""The objective the search minimises and a plan reports (no IR).

Choices: a layout per tensor (one scheme per mesh level, see `layout.py`) and a strategy per
operator (the op dim it splits at each level, or REP). The objective is Tofu's: the time the
communication takes,

    sum over input edges of conversions            stored layout -> required by the strategy
  + sum over output edges of conversions           produced by the strategy -> stored layout
  + sum over ops of kernel-internal allreduces     (a split reduction whose result is reused)

each collective priced by `tvm_ext.cost.collectives` on its level's link: its bytes over the
link bandwidth, plus the link latency per message round when `latency=True` (by default the
latency is reported, not optimised: a runtime buckets small collectives, as DDP does).

Partition-n-reduce (Tofu): an operator on the data path (one whose tensors carry the batch,
followed from the inputs' axis 0) must be split at every level where one of its dims can be, so
that its work and its outputs' memory fall with k; operators off the data path (a weight's
transpose, a gradient's) may run replicated, as in data parallelism. Ties go to the choice
storing fewer bytes per device (`memory_weight` per byte; raise it to trade communication for
memory), then to the one computing less per device (roofline time, also reported as the plan's
compute time). A level given as None is undecided (the top-down
search): it counts as splitting everything (Tofu's even-split assumption) and contributes no
collective. Constants can be sliced for free on any device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..cost.collectives import collective_bytes, collective_steps
from ..cost.hardware import Hardware, Link, get_hardware, get_link
from ..cost.roofline import op_time
from .layout import PARTIAL, REP, REQ_REP, Req, Step, edge_steps
from .problem import PartitionProblem
from .spec import KernelSpec


def logical_bytes(tensor) -> int:
    """Bytes of a tensor's data (a view's too, though it stores none of its own)."""
    if tensor.alias_of is None:
        return int(tensor.nbytes)
    itemsize = 1 if tensor.dtype == "bool" else np.dtype(tensor.dtype).itemsize
    return int(np.prod(tensor.shape, dtype=np.int64)) * itemsize


# Ties between plans of equal communication go to the one storing fewer bytes per device, then
# to the one computing less per device. Both weights are far below a byte on any link.
MEMORY_TIE_BREAK = 1e-16  # seconds per byte stored
COMPUTE_TIE_BREAK = 1e-9  # per second of compute


@dataclasses.dataclass(frozen=True)
class Edge:
    tensor: int
    position: int  # input or output position of the op
    output: bool


class PartitionModel:
    """A problem on a device mesh: legal choices and their costs."""

    def __init__(
        self,
        problem: PartitionProblem,
        mesh: Sequence[int],
        links: Sequence[str | Link],
        hardware: str | Hardware = "h100",
        latency: bool = False,
        memory_weight: float = MEMORY_TIE_BREAK,
    ):
        self.problem = problem
        self.latency = latency
        # Seconds charged per byte a device stores: a tie-break by default; larger values trade
        # communication for memory (1 / link bandwidth prices a stored byte like a sent one).
        self.memory_weight = float(memory_weight)
        self.graph = g = problem.graph
        self.mesh = [int(p) for p in mesh]
        if any(p < 2 for p in self.mesh):
            raise ValueError(f"mesh levels must have at least 2 devices, got {self.mesh}")
        self.levels = len(self.mesh)
        self.links = [get_link(link) for link in links]
        if len(self.links) != self.levels:
            raise ValueError(f"{len(self.links)} links for {self.levels} mesh levels")
        self.hardware = get_hardware(hardware)
        self.prefix = []
        acc = 1
        for p in self.mesh:
            acc *= p
            self.prefix.append(acc)
        self.specs: list[KernelSpec] = [problem.spec(op.id) for op in g.ops]
        self.free = [t.kind == "constant" for t in g.tensors]
        self.nbytes = [logical_bytes(t) for t in g.tensors]
        self.edges: list[list[Edge]] = []
        for op, spec in zip(g.ops, self.specs, strict=True):
            unused = set(spec.unused_inputs)
            edges = [Edge(t, i, False) for i, t in enumerate(op.inputs)
                     if not self.free[t] and i not in unused]
            edges += [Edge(t, i, True) for i, t in enumerate(op.outputs)]
            self.edges.append(edges)
        self.op_dims = [[self._legal_dims(op.id, lvl) for lvl in range(self.levels)]
                        for op in g.ops]
        self.tensor_schemes = [[self._legal_schemes(t.shape, lvl) for lvl in range(self.levels)]
                               for t in g.tensors]
        self.batch_axes = batch_axes(problem, self.specs)
        self.data_path = [any(t in self.batch_axes for t in (*op.inputs, *op.outputs))
                          for op in g.ops]
        self._edge_cache: dict = {}

    # ---------------------------------------------------------------- legal choices
    def _legal_schemes(self, shape, level: int) -> list[int]:
        parts = self.prefix[level]
        return [REP] + [a for a, n in enumerate(shape) if n >= parts and n % parts == 0]

    def _legal_dims(self, op_id: int, level: int) -> list[int]:
        """REP and every dim whose chunks divide evenly at this level (contiguity aside)."""
        parts = self.prefix[level]
        op = self.graph.ops[op_id]
        shape_in = [self.graph.tensors[t].shape for t in op.inputs]
        shape_out = [self.graph.tensors[t].shape for t in op.outputs]
        legal = [REP]
        for d, dim in enumerate(self.specs[op_id].dims):
            if not dim.splits(parts):
                continue
            ok = True
            for cut, shape in zip(dim.inputs, shape_in, strict=True):
                if cut is not None and (shape[cut.axis] % parts or
                                        max(cut.halo_lo, cut.halo_hi) > shape[cut.axis] // parts):
                    ok = False
            for out, shape in zip(dim.outputs, shape_out, strict=True):
                if isinstance(out, int) and shape[out] % parts:
                    ok = False
            if ok:
                legal.append(d)
        return legal

    def contiguous_ok(self, op_id: int, strategy: Sequence[int | None]) -> bool:
        """A halo / global-index dim split at a level must be split at every level above."""
        dims = self.specs[op_id].dims
        for lvl, d in enumerate(strategy):
            if d is not None and d >= 0 and dims[d].contiguous:
                if any(strategy[m] != d for m in range(lvl)):
                    return False
        return True

    # ---------------------------------------------------------------- schemes of a strategy
    def required(self, op_id: int, position: int, dim: int | None) -> Req | None:
        if dim is None:
            return None
        if dim == REP:
            return REQ_REP
        cut = self.specs[op_id].dims[dim].inputs[position]
        return REQ_REP if cut is None else Req(cut.axis, cut.halo_lo, cut.halo_hi)

    def produced(self, op_id: int, position: int, dim: int | None) -> int | None:
        if dim is None:
            return None
        if dim == REP:
            return REP
        out = self.specs[op_id].dims[dim].outputs[position]
        if out is None:
            return REP
        return PARTIAL if isinstance(out, str) else int(out)

    # ---------------------------------------------------------------- costs
    def edge_steps(self, edge: Edge, op_id: int, layout: Sequence[int | None],
                   strategy: Sequence[int | None]) -> list[Step]:
        t = self.graph.tensors[edge.tensor]
        if edge.output:
            src = tuple(self.produced(op_id, edge.position, d) for d in strategy)
            dst = tuple(layout)
        else:
            src = tuple(layout)
            dst = tuple(self.required(op_id, edge.position, d) for d in strategy)
        nbytes = self.nbytes[edge.tensor]
        key = (nbytes, t.shape, src, dst)
        steps = self._edge_cache.get(key)
        if steps is None:
            steps = edge_steps(nbytes, t.shape, self.mesh, self.links, src, dst)
            self._edge_cache[key] = steps
        return steps

    def step_cost(self, step: Step) -> float:
        """What a collective adds to the objective: its bandwidth time, plus its latency when
        the model counts latency (by default collectives are taken as bucketed, as DDP and
        NCCL group calls do, so that many small ones cost their bytes, not their count)."""
        return step.time + step.latency if self.latency else step.time

    def edge_time(self, edge: Edge, op_id: int, layout, strategy) -> float:
        return sum(self.step_cost(s) for s in self.edge_steps(edge, op_id, layout, strategy))

    def compute_time(self, op_id: int, strategy: Sequence[int | None]) -> float:
        op = self.graph.ops[op_id]
        if op.kind == "view":
            return 0.0
        split = 1
        for p, d in zip(self.mesh, strategy, strict=True):
            if d is None or d >= 0:
                split *= p
        return op_time(op.flops / split, op.bytes_moved / split, self.hardware, op.kind,
                       op.library, op.low_precision)

    def inner_steps(self, op_id: int, strategy: Sequence[int | None]) -> list[Step]:
        """Allreduces inside a kernel whose reduction dim is split."""
        dims = self.specs[op_id].dims
        steps = []
        for lvl, d in enumerate(strategy):
            if d is None or d < 0:
                continue
            for inner in dims[d].inner:
                group = float(inner.nbytes)
                for m, dm in enumerate(strategy):
                    cut = dm is None or (dm >= 0 and dm in inner.dims)
                    # The same reduction split deeper too: one hierarchical allreduce.
                    deeper = m > lvl and dm is not None and dm >= 0 and inner in dims[dm].inner
                    if m != lvl and (cut or deeper):
                        group /= self.mesh[m]
                p = self.mesh[lvl]
                sent = collective_bytes("allreduce", p, group)
                rounds = collective_steps("allreduce", p)
                steps.append(Step(lvl, "allreduce", PARTIAL, REP, group, sent, rounds,
                                  sent / self.links[lvl].bandwidth,
                                  rounds * self.links[lvl].latency))
        return steps

    def op_cost(self, op_id: int, strategy: Sequence[int | None]) -> float:
        """An op's own part of the objective: its kernel-internal collectives (and the compute
        tie-break)."""
        return COMPUTE_TIE_BREAK * self.compute_time(op_id, strategy) + sum(
            self.step_cost(s) for s in self.inner_steps(op_id, strategy))

    def stored_bytes(self, tensor: int, layout: Sequence[int | None]) -> float:
        """Bytes one device stores of a tensor (views store nothing of their own)."""
        t = self.graph.tensors[tensor]
        if t.alias_of is not None:
            return 0.0
        size = float(t.nbytes)
        for p, s in zip(self.mesh, layout, strict=True):
            if s is None or s >= 0:
                size /= p
        return size


def batch_axes(problem: PartitionProblem, specs: Sequence[KernelSpec]) -> dict[int, int]:
    """Tensor -> its batch axis, followed from the model inputs' axis 0 through each op's dims:
    an op dim that cuts an input along its batch axis cuts the outputs along theirs."""
    g = problem.graph
    axes: dict[int, int] = {t.id: 0 for t in g.tensors if t.kind == "input" and t.shape}
    for op in g.ops:
        for dim in specs[op.id].dims:
            if not dim.valid or not any(cut is not None and axes.get(t) == cut.axis
                                        for t, cut in zip(op.inputs, dim.inputs, strict=True)):
                continue
            for t, out in zip(op.outputs, dim.outputs, strict=True):
                if isinstance(out, int) and t not in axes:
                    axes[t] = out
            break
    return axes
