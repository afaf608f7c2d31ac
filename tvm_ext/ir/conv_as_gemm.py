"""A convolution as a GEMM a library computes: the column matrix (im2col) as a loop nest, then
one batched GEMM over it.

    col[g, n, c, r.., o..] = X[data indices, the filter's group g]          (a gather)
    Y[n, g * F/G + fl, o..] = sum_{c, r..} W[g * F/G + fl, c, r..] * col[g, n, c, r.., o..]

with n the image, g the group (absent when ungrouped), c a channel of the group, r.. the window
offsets and o.. the output positions. As GEMM roles: batch (n, g), M the filters of a group,
N the output positions (merged), K the channels and window offsets (merged). The column
matrix is a loop nest of the kernel (generated code, parallel over GPU threads: it is a copy),
the product a `tvm_ext.cublas.gemm` call on views of the three buffers (a view splits an axis
into (group, filter) or merges adjacent axes; both keep the bytes where they are).

A weight whose (channel, window) axes are not adjacent and in that order (a weight gradient's
filter is the forward's output gradient, stored images first) is copied into the canonical
[F, C/G, R..] layout first; an output whose position axes are not adjacent and in order is
refused (the kernel keeps its generated convolution). Scratch: the column matrix (and the
copied weight), allocated per call like any kernel's scratch.
"""

from __future__ import annotations

import dataclasses
import math

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock, SBlockRealize

from .library_kernels import BATCH, ConvParts, K, M, N

# GEMM batch dims: the image, then the group.
_IMAGE, _GROUP = BATCH, BATCH + 1
_G = object()  # the group, in the column matrix's axis roles (no block variable has it)


@dataclasses.dataclass(frozen=True)
class GemmOperand:
    """A buffer as the GEMM sees it: a shape (the buffer's, axes split or merged) and the GEMM
    role of each of its axes."""

    buffer: object
    shape: tuple[int, ...]
    roles: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ConvGemm:
    scratch: tuple  # buffers the nests write (root allocations of the kernel)
    nests: tuple  # statements to run before the GEMM (weight copy, column matrix)
    operands: tuple[GemmOperand, GemmOperand, GemmOperand]  # A (weight), B (col), C (output)


def conv_as_gemm(parts: ConvParts, name: str) -> ConvGemm | None:
    """The nests and GEMM operands computing the convolution `parts` (see the module
    docstring); None when the output's positions cannot be one GEMM axis."""
    output = _output_operand(parts)
    if output is None:
        return None
    scratch, nests = [], []
    weight = _weight_operand(parts)
    if weight is None:
        packed, nest = _packed_weight(parts, name)
        scratch.append(packed)
        nests.append(nest)
        weight = _weight_operand(parts, packed)
    col, nest = _column_matrix(parts, name)
    scratch.append(col)
    nests.append(nest)
    groups = [parts.groups] if parts.groups > 1 else []
    windows = [parts.domains[r] for _, _, r, _, _ in parts.windows]
    positions = math.prod(parts.domains[o] for _, o, _, _, _ in parts.windows)
    depth = parts.domains[parts.c] * math.prod(windows)
    col_operand = GemmOperand(col, (*groups, parts.domains[parts.n], depth, positions),
                              (*([_GROUP] if groups else []), _IMAGE, K, N))
    return ConvGemm(tuple(scratch), tuple(nests), (weight, col_operand, output))


def _int(x: int):
    return tirx.IntImm("int64", x)


def _filter_axis(parts: ConvParts, extent: int) -> tuple[list[int], list[int]]:
    """(shape, roles) of a filter axis: the group and the group's filters, or M alone."""
    if parts.groups > 1:
        return [parts.groups, extent // parts.groups], [_GROUP, M]
    return [extent], [M]


def _output_operand(parts: ConvParts) -> GemmOperand | None:
    out = parts.store
    shape = [int(s) for s in out.buffer.ty.shape]
    positions = [o for _, o, _, _, _ in parts.windows]
    axes = [next(a for a, i in enumerate(out.indices) if i.same_as(v)) for v in positions]
    if axes != list(range(axes[0], axes[0] + len(axes))):
        return None
    view, roles, axis = [], [], 0
    while axis < len(shape):
        index = out.indices[axis]
        if axis == axes[0]:
            view.append(math.prod(shape[a] for a in axes))
            roles.append(N)
            axis += len(axes)
            continue
        if index.same_as(parts.n):
            view.append(shape[axis])
            roles.append(_IMAGE)
        else:  # the filter
            s, r = _filter_axis(parts, shape[axis])
            view += s
            roles += r
        axis += 1
    return GemmOperand(out.buffer, tuple(view), tuple(roles))


def _weight_operand(parts: ConvParts, packed=None) -> GemmOperand | None:
    """The weight as [(group,) filter, K] in its own layout, the K axes (channel, window
    offsets) adjacent and in that order; None when they are not (it must be copied); a
    `packed` canonical copy is [F, C/G, R..]."""
    order = parts.weight_order
    if packed is not None:
        shape = [int(s) for s in packed.ty.shape]
        axes = list(range(len(order)))
        buffer = packed
    else:
        weight = parts.weight
        shape = [int(s) for s in weight.source.ty.shape]
        axes = []
        for v in order:
            found = [a for a, i in enumerate(weight.indices) if i.same_as(v)]
            if len(found) != 1 or shape[found[0]] != parts.domains[v]:
                return None
            axes.append(found[0])
        if len(weight.indices) != len(order):
            return None
        buffer = weight.source
    k_axes = axes[1:]
    if k_axes != list(range(k_axes[0], k_axes[0] + len(k_axes))):
        return None
    view, roles, axis = [], [], 0
    while axis < len(shape):
        if axis == k_axes[0]:
            view.append(math.prod(shape[a] for a in k_axes))
            roles.append(K)
            axis += len(k_axes)
            continue
        s, r = _filter_axis(parts, shape[axis])
        view += s
        roles += r
        axis += 1
    return GemmOperand(buffer, tuple(view), tuple(roles))


def _nest(name: str, buffer, extents: list[int], names: list[str], value_of) -> SBlockRealize:
    """A loop nest writing every element of `buffer` (shape `extents`): `buffer[v..] =
    value_of(v..)`, one spatial block variable per axis."""
    iters = [tirx.IterVar(tvm.ir.Range.from_min_extent(_int(0), _int(e)),
                          tirx.Var(f"v_{n}", "int64"), tirx.IterVar.DataPar)
             for n, e in zip(names, extents, strict=True)]
    loops = [tirx.Var(n, "int64") for n in names]
    value = value_of([it.var for it in iters])
    reads: list = []
    tvm_ffi.structural_walk(value, [(tvm.ir.TensorLoad, lambda x: reads.append(x.source))])
    regions = [_full_region(b) for b in dict.fromkeys(reads)]
    store = tirx.BufferStore(buffer, value, [it.var for it in iters])
    nest = SBlockRealize(loops, True, SBlock(iters, regions, [_full_region(buffer)], name, store))
    for loop, extent in reversed(list(zip(loops, extents, strict=True))):
        nest = tirx.For(loop, _int(0), _int(extent), tirx.ForKind.SERIAL, nest)
    return nest


def _full_region(buf):
    ranges = [tvm.ir.Range.from_min_extent(0, e) for e in buf.ty.shape]
    return tvm.ir.expr.TensorRegion(buf, ranges, tirx.BufferRegionType())


def _load(load, values: dict):
    """`load` with its block variables replaced by `values`, indices simplified."""
    analyzer = tvm.sym.Analyzer()
    indices = [analyzer.simplify(tvm_ffi.structural_map(
        i, (tvm.ir.expr.Var, lambda v: values.get(v, v)))) for i in load.indices]
    return tirx.BufferLoad(load.source, indices)


def _packed_weight(parts: ConvParts, name: str):
    order = parts.weight_order
    extents = [parts.domains[v] for v in order]
    source = parts.weight.source
    packed = tirx.decl_buffer([_int(e) for e in extents], source.ty.dtype,
                              f"{source.name}_packed")
    nest = _nest(f"{name}_weight", packed, extents, [f"w{k}" for k in range(len(order))],
                 lambda vs: _load(parts.weight, dict(zip(order, vs, strict=True))))
    return packed, nest


def _column_matrix(parts: ConvParts, name: str):
    """The column matrix [(G,) N, C/G, R.., O..] and the nest that gathers it."""
    d = parts.domains
    windows = [r for _, _, r, _, _ in parts.windows]
    positions = [o for _, o, _, _, _ in parts.windows]
    grouped = parts.groups > 1
    roles = [*([_G] if grouped else []), parts.n, parts.c, *windows, *positions]
    extents = [parts.groups if v is _G else d[v] for v in roles]
    data = parts.data.source
    col = tirx.decl_buffer([_int(e) for e in extents], data.ty.dtype, f"{name}_col")
    names = [*(["g"] if grouped else []), "n", "c", *(f"r{k}" for k in range(len(windows))),
             *(f"o{k}" for k in range(len(positions)))]

    def value(vs):
        values = {v: x for v, x in zip(roles, vs, strict=True) if v is not _G}
        if grouped:  # the filter's group picks the channels: f = g * F/G reads group g
            values[parts.f] = vs[0] * _int(parts.fpg)
        return _load(parts.data, values)

    return col, _nest(f"{name}_col", col, extents, names, value)
