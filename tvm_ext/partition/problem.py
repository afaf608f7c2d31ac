"""The partitioner's input: a DataflowGraph and what splitting each operator implies (no IR)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from ..graph import DataflowGraph
from .spec import KernelSpec, replicated_spec


@dataclasses.dataclass
class PartitionProblem:
    """A graph and the `KernelSpec` of each of its operators.

    `op_spec[i]` names the spec of op i in `specs` (a kernel name, or a reshape view's key);
    None means the op is not understood (a packed builtin): it runs replicated.
    """

    graph: DataflowGraph
    specs: dict[str, KernelSpec]
    op_spec: list[str | None]

    def __post_init__(self) -> None:
        if len(self.op_spec) != len(self.graph.ops):
            raise ValueError(f"{len(self.op_spec)} op specs for {len(self.graph.ops)} ops")
        for op, key in zip(self.graph.ops, self.op_spec, strict=True):
            if key is None:
                continue
            if key not in self.specs:
                raise ValueError(f"op {op.id} ({op.name}) names an unknown spec {key!r}")
            spec = self.specs[key]
            if (spec.num_inputs, spec.num_outputs) != (len(op.inputs), len(op.outputs)):
                raise ValueError(f"spec {key!r} has {spec.num_inputs} inputs and "
                                 f"{spec.num_outputs} outputs; op {op.id} ({op.name}) has "
                                 f"{len(op.inputs)} and {len(op.outputs)}")

    def spec(self, op_id: int) -> KernelSpec:
        key = self.op_spec[op_id]
        op = self.graph.ops[op_id]
        if key is None:
            return replicated_spec(op.kernel, len(op.inputs), len(op.outputs),
                                   f"{op.kind} op {op.kernel} is not analysed")
        return self.specs[key]

    def unsupported(self) -> list[tuple[str, str]]:
        """(kernel, reason) for every operator that can only run replicated, and every dim
        that cannot be split (reported once per kernel)."""
        out: list[tuple[str, str]] = []
        seen: set[str] = set()
        for op in self.graph.ops:
            spec = self.spec(op.id)
            if spec.kernel in seen:
                continue
            seen.add(spec.kernel)
            out += [(spec.kernel, note) for note in spec.notes]
            out += [(spec.kernel, f"dim {d.name}: {d.reason}") for d in spec.dims if d.reason]
        return out

    def restricted(self, disallow: Mapping[str, Mapping[int, str]]) -> PartitionProblem:
        """The same problem with some dims made unsplittable: `disallow[spec key][dim] = reason`
        (what a lowering cannot express). The reasons show in `unsupported()`."""
        specs = dict(self.specs)
        for key, dims in disallow.items():
            if key not in specs or not dims:
                continue
            spec = specs[key]
            new_dims = list(spec.dims)
            for d, reason in dims.items():
                if new_dims[d].reason is None:
                    new_dims[d] = dataclasses.replace(new_dims[d], reason=reason)
            specs[key] = dataclasses.replace(spec, dims=new_dims)
        return PartitionProblem(self.graph, specs, list(self.op_spec))

    def to_dict(self) -> dict:
        return {
            "graph": self.graph.to_dict(),
            "specs": {k: s.to_dict() for k, s in self.specs.items()},
            "op_spec": list(self.op_spec),
        }

    @classmethod
    def from_dict(cls, data: dict) -> PartitionProblem:
        return cls(DataflowGraph.from_dict(data["graph"]),
                   {k: KernelSpec.from_dict(s) for k, s in data["specs"].items()},
                   list(data["op_spec"]))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> PartitionProblem:
        return cls.from_dict(json.loads(text))
