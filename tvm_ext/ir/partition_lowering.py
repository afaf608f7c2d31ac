"""What PartitionOperators can express of a module's kernels: the dims each kernel (or reshape
view) can be split along by `local_kernels`, the reasons for those it cannot, and the local
kernels made for one device's chunk (cached per kernel and split)."""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax

from ..graph import DataflowGraph
from ..partition import PartitionPlan, PartitionProblem
from .kernel_dims import kernel_dims
from .local_kernels import (
    KernelPart,
    inner_blocks,
    local_kernel,
    lowering_obstacle,
    reshape_obstacle,
    split_kernel,
)


class PartitionLowering:
    """What this lowering can express of a module's kernels: KernelDims per kernel, the dims it
    cannot split (with reasons), and the local kernels it made."""

    def __init__(self, mod: tvm.IRModule, graph: DataflowGraph, problem: PartitionProblem):
        self.mod = mod
        self.graph = graph
        self.problem = problem
        self.kdims = {}
        self.disallow: dict[str, dict[int, str]] = {}
        for op in graph.ops:
            key = problem.op_spec[op.id]
            if key is None or key in self.disallow:
                continue
            spec = problem.specs[key]
            reasons: dict[int, str] = {}
            if op.kind == "kernel":
                kd = kernel_dims(mod[key], len(op.outputs), key)
                self.kdims[key] = kd
                for d, dim in enumerate(kd.spec.dims):
                    if dim.valid:
                        why = lowering_obstacle(kd, d)
                        if why is not None:
                            reasons[d] = why
            elif op.kind == "view":
                src, dst = (graph.tensors[op.inputs[0]].shape, graph.tensors[op.outputs[0]].shape)
                for d, dim in enumerate(spec.dims):
                    if dim.valid:
                        cut = dim.inputs[0]
                        out = dim.outputs[0]
                        why = reshape_obstacle(src, dst, None if cut is None else cut.axis,
                                               out if isinstance(out, int) else None)
                        if why is not None:
                            reasons[d] = why
            self.disallow[key] = reasons
        self._local: dict = {}

    def fallbacks(self, unrestricted: PartitionPlan | None = None) -> list[dict]:
        """Every dim the partitioner could split but this lowering cannot, with the reason, and
        the ops where `unrestricted` (a plan made without the restriction) split it."""
        chosen: dict[tuple[str, int], list[str]] = {}
        if unrestricted is not None:
            for o in unrestricted.ops:
                key = self.problem.op_spec[o.id]
                for d in o.strategy:
                    if key is not None and d >= 0 and d in self.disallow.get(key, {}):
                        chosen.setdefault((key, d), []).append(o.name)
        out = []
        for key, reasons in self.disallow.items():
            for d, why in sorted(reasons.items()):
                out.append({"kernel": key, "dim": self.problem.specs[key].dims[d].name,
                            "reason": why, "chosen_without_restriction":
                            sorted(set(chosen.get((key, d), [])))})
        return out

    def local(self, bb: relax.BlockBuilder, kernel: str, factors: dict[int, int],
              param_shapes: dict[int, tuple], levels: dict[int, tuple] | None = None,
              ) -> list[tuple[tvm.ir.GlobalVar, KernelPart]]:
        """`kernel` on one device's chunk of the split dims (`factors`: dim -> parts), as a
        list of (GlobalVar, part): one part, or the parts cut after the blocks whose
        reductions over a split dim are read again (`split_kernel`; the caller allreduces the
        intermediates named by `inner_buffers` between them). `levels`: the mesh levels of the
        dims split into strided blocks (see `local_kernel`)."""
        factors = {d: f for d, f in factors.items() if f > 1}
        kd = self.kdims[kernel]
        # Only the dims whose global index the kernel computes depend on the block layout.
        levels = {d: lv for d, lv in (levels or {}).items()
                  if d in factors and d in kd.value_dims}
        key = (kernel, tuple(sorted(factors.items())), tuple(sorted(param_shapes.items())),
               tuple(sorted(levels.items())))
        if key in self._local:
            return self._local[key]
        cuts = inner_blocks(kd, list(factors))
        if cuts:
            parts = split_kernel(kd.func, kd.spec.num_outputs, cuts)
        else:
            n_in = kd.spec.num_inputs
            parts = [KernelPart(kd.func, [("in", i) for i in range(n_in)],
                                [("out", i) for i in range(kd.spec.num_outputs)])]
        dims = kd.spec.dims
        suffix = "_".join(f"{dims[d].name.split('.')[-1]}_by{f}"
                          for d, f in sorted(factors.items()))
        out = []
        for i, part in enumerate(parts):
            shapes = {j: param_shapes[key[1]] for j, key in enumerate(part.inputs)
                      if key[0] == "in" and key[1] in param_shapes}
            if not factors and not shapes and len(parts) == 1:
                out.append((self.mod.get_global_var(kernel), part))
                continue
            func = local_kernel(kd, factors, shapes, func=part.func,
                                num_outputs=len(part.outputs), levels=levels)
            name = kernel + (f"_{suffix}" if suffix else "_local") + \
                ("_strided" if levels else "") + (f"_part{i}" if len(parts) > 1 else "")
            out.append((bb.add_func(func, name),
                        KernelPart(func, part.inputs, part.outputs, part.writers)))
        self._local[key] = out
        return out

    def inner_buffers(self, kernel: str, strategy: Sequence[int]) -> dict[str, list]:
        """Block -> [(level, combiner)]: the allreduces of what a block of a split kernel
        reduced over a split dim."""
        out: dict[str, list] = {}
        dims = self.kdims[kernel].spec.dims
        for lvl, d in enumerate(strategy):
            if d >= 0:
                for r in dims[d].inner:
                    out.setdefault(r.buffer.split(":")[0], []).append((lvl, r.combiner))
        return out
