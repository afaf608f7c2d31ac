"""Which kernels a swap plan may run in chunks, one after another (operator splitting in time,
`tvm_ext.swap.split`), read off their TIR by the partitioner's index analysis.

A kernel dim qualifies when the lowering of PartitionOperators can cut it (`local_kernels`: the
same chunk kernels run here one after another on one device) and it splits some inputs along
one axis each, and either every output along one axis with nothing reduced over
it (the chunks' outputs are independent) or no output, every output being reduced over it by
one block with an init and a stated update (`accumulate`: the outputs stay whole and each chunk
after the first adds to them, `accumulating_kernels`), or reduced over it into intermediates
that later blocks finish the outputs from, where those blocks read no cut input
(`epilogue_kernels`: the intermediates add up chunk by chunk, the epilogue runs once); the
other inputs are read whole. Chunk j of a tensor cut along its leading
axis (the first whose extent is not 1) is one contiguous byte range of it (a reshape view's
too, when the view covers its base); cut along a later axis, its bytes are strided
(`SplitOption.strided`: copied row by row). A dim whose index the kernel uses as a value
(a causal mask, an iota) gets its chunk's index as an argument. A tensor read twice is read as the
same chunk by both reads; a base read in chunks and whole, in chunks through two different
views, or in chunks along two axes (x @ x split along the dim it reduces) is not cut. A dim read
through windows (a convolution's or a pooling's output rows) qualifies too: each chunk reads
its input range with the halo rows of its windows (`halo_chunks`, `SplitOption.halo_bytes`),
copied in whole rows at a time (never read in place), overlapping its neighbours'. (The swap
simulator times a windowed input's stream at the tensor's bytes, without the halo rows.) Two
such dims combine where one (a batch) cuts every cut tensor along axis 0 and the other along
later axes: the split runs the second's chunks within each item of the first
(`SplitOption.outer_dim`; a convolution by images and rows).
"""

from __future__ import annotations

import dataclasses
import math

import tvm

from ..graph import DataflowGraph
from ..partition.spec import AxisCut
from ..swap.alignment import align
from ..swap.split import SplitOption
from .accumulating_kernels import adds_to_outputs
from .epilogue_kernels import reduction_epilogue
from .kernel_cost import buffer_bytes
from .kernel_dims import kernel_dims
from .local_kernels import (
    LoweringError,
    has_halo,
    inner_blocks,
    local_kernel,
    lowering_obstacle,
)


def time_split_options(mod: tvm.IRModule, graph: DataflowGraph) -> list[list[list]]:
    """Per op of `graph` (the graph of `mod`'s function), its split options as
    `SplitOption.to_list()` (base tensor ids)."""
    cache: dict[str, list] = {}
    lowers: dict[str, dict] = {}
    out = []
    for op in graph.ops:
        if op.kind != "kernel" or op.kernel not in [gv.name_hint for gv in mod.functions]:
            out.append([])
            continue
        if op.kernel not in cache:
            kd = kernel_dims(mod[op.kernel], len(op.outputs), op.kernel)
            dims = [(d, kd, reduction_epilogue(kd, d) if kd.spec.dims[d].inner else None)
                    for d in range(len(kd.spec.dims))]
            cache[op.kernel] = [(d, k, e) for d, k, e in dims if _qualifies(k, d, e)]
        out.append(_options(graph, op, cache[op.kernel], lowers))
    return out


def _qualifies(kd, d: int, epilogue) -> bool:
    dim = kd.spec.dims[d]
    if not dim.valid or lowering_obstacle(kd, d, allow_halo=True) is not None:
        return False
    ins, outs = _params(kd)
    if len(outs) != len(dim.outputs):
        return False
    if dim.inner:  # reduced into intermediates the kernel finishes its outputs from
        if epilogue is None:
            return False
    elif dim.reduction:  # every output reduced over it, by a block that adds to it
        if not all(isinstance(o, str) for o in dim.outputs) or \
                not any(c is not None for c in dim.inputs) or \
                not adds_to_outputs(kd.func, outs):
            return False
    elif not all(isinstance(o, int) and not isinstance(o, bool) for o in dim.outputs):
        return False
    return len(ins) == len(dim.inputs) and all(
        c is None or isinstance(c, AxisCut) for c in dim.inputs)


def _params(kd) -> tuple[list, list]:
    """The kernel's input and output buffer parameters."""
    params = [p for p in kd.func.params if getattr(p, "shape", None) is not None]
    return params[:kd.spec.num_inputs], params[kd.spec.num_inputs:]


def _leading(shape, axis: int) -> bool:
    """Whether chunks along `axis` are contiguous byte ranges: every axis before it is 1."""
    return all(int(n) == 1 for n in shape[:axis])


def _options(graph: DataflowGraph, op, dims: list, lowers: dict) -> list[list]:
    options = _one_dim_options(graph, op, dims)
    kds = {d: (kd, epilogue) for d, kd, epilogue in dims}
    lowers = lowers.setdefault(op.kernel, {})
    pairs = [_two_dim_option(*kds[i.dim], o, i, lowers) for o in options for i in options
             if o.dim != i.dim]
    return [o.to_list() for o in options + [p for p in pairs if p is not None]]


def _one_dim_options(graph: DataflowGraph, op, dims: list) -> list[SplitOption]:
    options = []
    for d, kd, epilogue in dims:
        dim = kd.spec.dims[d]
        if len(dim.inputs) != len(op.inputs):
            continue
        cut = [graph.base(t) for t, c in zip(op.inputs, dim.inputs, strict=True) if c is not None]
        whole = [graph.base(t) for t, c in zip(op.inputs, dim.inputs, strict=True) if c is None]
        if set(cut) & set(whole) or len(set(cut)) != len(
                {t for t, c in zip(op.inputs, dim.inputs, strict=True) if c is not None}):
            continue  # a base read both in chunks and whole, or in chunks through two views
        axes = {(t, c.axis) for t, c in zip(op.inputs, dim.inputs, strict=True)
                if c is not None}
        if len(axes) != len({t for t, _ in axes}):
            continue  # a tensor read in chunks along two axes (x @ x over its reduced dim)
        outputs = [graph.base(t) for t in op.outputs]
        # A chunk of a view read in chunks is that byte range of its base: the view must
        # cover the whole base (a reshape), not a part of it.
        if any(not _covers_base(graph, t) for t, c in zip(op.inputs, dim.inputs, strict=True)
               if c is not None):
            continue
        ins, outs = _params(kd)
        strided = {graph.base(t) for t, p, c in zip(op.inputs, ins, dim.inputs, strict=True)
                   if c is not None and (c.halo or not _leading(p.shape, c.axis))}
        halo = {graph.base(t): graph.tensors[graph.base(t)].nbytes // int(p.shape[c.axis])
                * (c.halo_lo + c.halo_hi)
                for t, p, c in zip(op.inputs, ins, dim.inputs, strict=True)
                if c is not None and c.halo}
        accumulate = dim.reduction or epilogue is not None
        if accumulate:  # the outputs stay whole
            outputs = []
        else:
            strided |= {graph.base(t) for t, p, a in zip(op.outputs, outs, dim.outputs,
                                                         strict=True)
                        if not _leading(p.shape, a)}
        options.append(SplitOption(d, _divisor(kd, d), tuple(sorted(set(cut))),
                                   tuple(sorted(set(whole))), tuple(outputs),
                                   cut_bytes=tuple((t, graph.tensors[t].nbytes)
                                                   for t in sorted(set(cut))),
                                   strided=tuple(sorted(strided)), accumulate=accumulate,
                                   epilogue=epilogue is not None,
                                   epilogue_bytes=_epilogue_bytes(epilogue),
                                   halo_bytes=tuple(sorted(halo.items()))))
    return options


def _two_dim_option(kd, epilogue, outer: SplitOption, inner: SplitOption,
                    lowers: dict) -> SplitOption | None:
    """`inner` run within each item of `outer` cut into its finest items, or None: `outer`
    cuts every tensor `inner` cuts (and no other) along its axis 0, without a halo or its
    index used as a value, and `inner` cuts them along other axes; both cut the outputs or
    both reduce into them (by the same blocks, `epilogue` the inner's); and the kernel lowers
    with both cut (`lowers`: what earlier ops of the kernel found, by (outer dim, inner
    dim))."""
    if outer.halo_bytes or outer.divisor < 2 or outer.dim in kd.value_dims or \
            (outer.cut_inputs, outer.cut_outputs) != (inner.cut_inputs, inner.cut_outputs) or \
            (outer.accumulate, outer.epilogue) != (inner.accumulate, inner.epilogue) or \
            inner_blocks(kd, [outer.dim]) != inner_blocks(kd, [inner.dim]):
        return None
    o_dim, i_dim = kd.spec.dims[outer.dim], kd.spec.dims[inner.dim]
    o_axes = [c.axis for c in o_dim.inputs if c is not None]
    i_axes = [c.axis for c in i_dim.inputs if c is not None]
    if not inner.accumulate:
        o_axes, i_axes = o_axes + list(o_dim.outputs), i_axes + list(i_dim.outputs)
    if any(a != 0 for a in o_axes) or any(a == 0 for a in i_axes):
        return None
    key = (outer.dim, inner.dim)
    if key not in lowers:
        part = epilogue.reduction if epilogue is not None else None
        try:
            local_kernel(kd, {outer.dim: outer.divisor, inner.dim: min(
                c for c in range(2, inner.divisor + 1) if inner.divisor % c == 0)},
                func=part.func if part else None, halo=has_halo(kd, inner.dim),
                num_outputs=len(part.outputs) if part else None)
            lowers[key] = True
        except LoweringError:
            lowers[key] = False
    if not lowers[key]:
        return None
    return dataclasses.replace(
        inner, strided=tuple(sorted({*inner.cut_inputs, *inner.cut_outputs})),
        halo_bytes=tuple((t, n // outer.divisor) for t, n in inner.halo_bytes),
        outer_dim=outer.dim, outer_chunks=outer.divisor)


def _divisor(kd, d: int) -> int:
    """What chunk counts of dim `d` must divide: the dim's own divisor and the extent of every
    buffer axis the chunk kernel cuts by it (a window's buffer may be shorter than the dim)."""
    divisor = kd.spec.dims[d].divisor or kd.spec.dims[d].extent
    for buf, axes in kd.buffer_dims.items():
        for a, axis_dim in enumerate(axes):
            if axis_dim == d:
                divisor = math.gcd(divisor, int(buf.ty.shape[a]))
    return divisor


def _epilogue_bytes(epilogue) -> int:
    """Device bytes of a split's intermediates besides its outputs (none when in place)."""
    if epilogue is None or epilogue.in_place:
        return 0
    return sum(align(n) for n in epilogue.intermediate_sizes)


def _covers_base(graph: DataflowGraph, tid: int) -> bool:
    t = graph.tensors[tid]
    return t.alias_of is None or \
        buffer_bytes(t.shape, t.dtype) == graph.tensors[graph.base(tid)].nbytes


def annotate_time_splits(mod: tvm.IRModule, graph: DataflowGraph) -> DataflowGraph:
    """`graph` with each op's split options (`Op.time_splits`), in place; returns it."""
    for op, options in zip(graph.ops, time_split_options(mod, graph), strict=True):
        op.time_splits = options
    return graph
