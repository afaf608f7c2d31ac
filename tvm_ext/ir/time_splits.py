"""Which kernels a swap plan may run in chunks, one after another (operator splitting in time,
`tvm_ext.swap.split`), read off their TIR by the partitioner's index analysis.

A kernel dim qualifies when the lowering of PartitionOperators can cut it (`local_kernels`: the
same chunk kernels run here one after another on one device) and, cut into contiguous chunks,
it splits every output and some inputs along their leading axis, with no halo and nothing
reduced over it: chunk j of each cut tensor is then one contiguous byte range of it (a reshape
view's too), the chunks' outputs are independent, and the other inputs are read whole. A dim
whose index the kernel uses as a value gets its chunk's index as an argument.
"""

from __future__ import annotations

import tvm

from ..partition.spec import AxisCut
from ..swap.alignment import ALIGNMENT
from .graph import DataflowGraph
from .kernel_dims import kernel_dims
from .local_kernels import chunk_params, local_kernel, lowering_obstacle


def time_split_options(mod: tvm.IRModule, graph: DataflowGraph) -> list[list[list]]:
    """Per op of `graph` (the graph of `mod`'s function), its split options as
    `SplitOption.to_list()`: [dim, divisor, cut inputs, whole inputs, cut outputs] with base
    tensor ids."""
    cache: dict[str, list] = {}
    out = []
    for op in graph.ops:
        if op.kind != "kernel" or op.kernel not in [gv.name_hint for gv in mod.functions]:
            out.append([])
            continue
        if op.kernel not in cache:
            kd = kernel_dims(mod[op.kernel], len(op.outputs), op.kernel)
            cache[op.kernel] = [(d, kd) for d in range(len(kd.spec.dims))
                                if _qualifies(kd, d)]
        out.append(_options(graph, op, cache[op.kernel]))
    return out


def _qualifies(kd, d: int) -> bool:
    dim = kd.spec.dims[d]
    if not dim.valid or dim.reduction or dim.inner or lowering_obstacle(kd, d) is not None:
        return False
    if any(o != 0 or isinstance(o, bool) for o in dim.outputs):
        return False
    if not all(c is None or (isinstance(c, AxisCut) and c.axis == 0 and not c.halo)
               for c in dim.inputs):
        return False
    # A kernel that reads the dim's index as a value (a causal mask, an iota) gets its chunk's
    # index as an argument; such splits gave wrong results on the corpus transformers: refused.
    return not chunk_params(local_kernel(kd, {d: dim.divisor or dim.extent}))


def _options(graph: DataflowGraph, op, dims: list) -> list[list]:
    options = []
    for d, kd in dims:
        dim = kd.spec.dims[d]
        if len(dim.inputs) != len(op.inputs):
            continue
        cut = [graph.base(t) for t, c in zip(op.inputs, dim.inputs, strict=True) if c is not None]
        whole = [graph.base(t) for t, c in zip(op.inputs, dim.inputs, strict=True) if c is None]
        if set(cut) & set(whole) or len(set(op.inputs)) != len(op.inputs):
            continue  # one tensor read both in chunks and whole, or read twice
        outputs = [graph.base(t) for t in op.outputs]
        # Chunks are byte ranges at aligned offsets of the tensors as the plan sizes them.
        if any(graph.tensors[t].nbytes % ALIGNMENT for t in (*cut, *outputs)):
            continue
        options.append([d, dim.divisor or dim.extent, sorted(set(cut)), sorted(set(whole)),
                        outputs])
    return options


def annotate_time_splits(mod: tvm.IRModule, graph: DataflowGraph) -> DataflowGraph:
    """`graph` with each op's split options (`Op.time_splits`), in place; returns it."""
    for op, options in zip(graph.ops, time_split_options(mod, graph), strict=True):
        op.time_splits = options
    return graph
