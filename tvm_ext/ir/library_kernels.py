"""Which loop nests of a kernel a vendor library can compute: GEMMs, 1-D and 2-D convolutions.

A fused kernel (after `FuseTIR`) is a root block whose body is a sequence of loop nests, one
per operator it fuses: `matmul` then a bias `add`, `pad` then `conv2d` then `relu`. This module
reads each top-level nest and says which are, exactly, one of:

* **GEMM**: `C[...] = C[...] + A[...] * B[...]` (init `C = 0`) over one reduction variable K,
  every index a plain block variable (or 0 on a unit axis). Spatial variables read by both
  operands are batch dims, one read only by A is M, one read only by B is N. Axis order is free
  (a transposed operand is just another order); a batch dim missing from an operand broadcasts.
* **conv2d**: `Y[n, f, y, x] += X[n, c', y*sh + ry*dh, x*sw + rx*dw] * W[f, c, ry, rx]` with
  `c' = c` or, grouped, `f // (F/g) * (C/g) + c`, each operand's axes in any order (a weight
  gradient reads its data and writes its output channels-first, [C, N, H, W]); roles are read
  off the indices, not the loop order. Padding stays where legalization put it, in the nest
  before (the data read is the padded buffer). A weight read through other index
  expressions (grouped transposed convolutions) is first computed into the canonical layout.
* **conv1d**: the same with one spatial axis; the library computes it as a conv2d of unit
  height.

Nothing is assumed: a nest that is not a perfect loop nest binding its block's variables over
the full extents of every buffer axis they index does not match, and is left to TVM's own code.
The roles (`LibraryCall.roles`) are those of the runtime library's `tvm_ext.blas.gemm`:
0 = M, 1 = N, 2 = K, 3 + i = batch dim i, -1 = an axis read at index 0.
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import sym as arith
from tvm import tirx
from tvm.ir import TensorLoad
from tvm.ir.prim import expr as pe
from tvm.s_tir import SBlockRealize

M, N, K, BATCH, UNIT = 0, 1, 2, 3, -1


@dataclasses.dataclass(frozen=True)
class LibraryCall:
    """One top-level loop nest (`stmt`, its index in the root block) a library computes."""

    kind: str  # "gemm", "conv2d" or "conv1d" (computed as a conv2d of unit height)
    stmt: int
    block: str
    operands: tuple  # buffer Vars: (A, B, C) or (data, weight, out)
    dtypes: tuple[str, ...]  # of the operands as stored
    roles: tuple[tuple[int, ...], ...] = ()  # gemm: per operand, per axis of its view
    # gemm: per operand, per view axis, the tensor axes merged into it (M, N or K spread
    # over adjacent axes, e.g. [2, 3, 8, 16] @ [16, 4] is one 48x16 by 16x4 product).
    views: tuple[tuple[tuple[int, ...], ...], ...] = ()
    conv: tuple[int, ...] = ()  # convolutions: stride h, w, dilation h, w, groups
    # convolutions: per operand (data, weight, out), the axis of its 4-D view holding each role
    # (data n, c, h, w; weight f, c, kh, kw; out n, f, h, w); a 1-D convolution's operands get
    # a unit last axis, its height.
    conv_axes: tuple[tuple[int, ...], ...] = ()
    # a weight read through index expressions (a grouped transposed convolution's): (block
    # variables f, c, k.., the weight's indices in them, their extents); the dispatch computes
    # it into a [F, C/g, K..] buffer first.
    weight_copy: tuple = ()
    flops: int | None = None  # when the extents are static


def gemm_dims(call: LibraryCall) -> tuple[int, int, int, int, bool]:
    """(batch, M, N, K, whether B has batch dims) of a GEMM call with static extents."""
    if call.kind != "gemm":
        raise ValueError(f"{call.kind} is not a GEMM")

    def extent(operand: int, wanted) -> int:
        shape = [int(s) for s in call.operands[operand].shape]
        total = 1
        for role, axes in zip(call.roles[operand], call.views[operand], strict=True):
            if wanted(role):
                for axis in axes:
                    total *= shape[axis]
        return total

    batch = extent(2, lambda r: r >= BATCH)
    batched_b = any(r >= BATCH for r in call.roles[1])
    return (batch, extent(0, lambda r: r == M), extent(1, lambda r: r == N),
            extent(0, lambda r: r == K), batched_b)


def root_statements(func: tirx.PrimFunc) -> list | None:
    """The top-level statements of the kernel's root block (None: no root block)."""
    root = func.body
    if not isinstance(root, SBlockRealize) or root.block.iter_vars:
        return None
    body = root.block.body
    return list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]


def find_library_calls(func: tirx.PrimFunc) -> list[LibraryCall]:
    """Every top-level nest of `func` a library can compute, in order."""
    stmts = root_statements(func)
    if stmts is None:
        return []
    calls = []
    for i, stmt in enumerate(stmts):
        block = _perfect_nest(stmt)
        if block is None:
            continue
        call = _match_gemm(block, i) or _match_conv(block, i)
        if call is not None:
            calls.append(call)
    return calls


def _is_int(expr, value: int) -> bool:
    return isinstance(expr, pe.IntImm) and int(expr.value) == value


def _static(expr) -> int | None:
    return int(expr.value) if isinstance(expr, pe.IntImm) else None


def _perfect_nest(stmt):
    """The block of a nest of serial loops from 0 that bind its variables one to one, over the
    variables' whole domains, with no predicate; None otherwise."""
    extents = {}
    while isinstance(stmt, tirx.For):
        if stmt.kind != tirx.ForKind.SERIAL or not _is_int(stmt.min, 0) or \
                stmt.thread_binding is not None:
            return None
        extents[stmt.loop_var] = stmt.extent
        stmt = stmt.body
    if not isinstance(stmt, SBlockRealize) or not _is_int(stmt.predicate, 1):
        return None
    block = stmt.block
    if block.match_buffers or block.alloc_buffers or len(block.iter_vars) != len(extents):
        return None
    analyzer = arith.Analyzer()
    for iv, value in zip(block.iter_vars, stmt.iter_values, strict=True):
        if value not in extents or not _is_int(iv.dom.min, 0) or \
                not analyzer.can_prove_equal(iv.dom.extent, extents.pop(value)):
            return None
    return block


def _loads(expr) -> tuple | None:
    """(x, y, x dtype, y dtype) of `x * y` with x, y loads, each maybe cast."""
    if not isinstance(expr, pe.Mul):
        return None
    out = []
    for side in (expr.a, expr.b):
        dtype = None
        if isinstance(side, pe.Cast):
            side = side.value
        if not isinstance(side, TensorLoad):
            return None
        dtype = str(side.source.ty.dtype)
        out.append((side, dtype))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def _accumulation(block):
    """(store, x load, y load) of `C[i] = C[i] + x * y` with `C[i] = 0` as init."""
    store, init = block.body, block.init
    if not isinstance(store, tirx.BufferStore) or not isinstance(init, tirx.BufferStore):
        return None
    if not init.buffer.same_as(store.buffer) or not _is_zero(init.value) or \
            not _same_indices(init.indices, store.indices):
        return None
    value = store.value
    if not isinstance(value, pe.Add):
        return None
    for acc, prod in ((value.a, value.b), (value.b, value.a)):
        if isinstance(acc, TensorLoad) and acc.source.same_as(store.buffer) and \
                _same_indices(acc.indices, store.indices):
            loads = _loads(prod)
            if loads is not None:
                return store, loads[0], loads[1]
    return None


def _is_zero(expr) -> bool:
    return isinstance(expr, (pe.IntImm, pe.FloatImm)) and float(expr.value) == 0.0


def _same_indices(a, b) -> bool:
    return len(a) == len(b) and all(x.same_as(y) for x, y in zip(a, b, strict=True))


def _var_axes(indices, block_vars) -> dict | None:
    """{block var: axis} of an access whose indices are plain block variables or 0 (unit
    axes, `UNIT`); None when an index is anything else or a variable repeats."""
    axes = {}
    for axis, idx in enumerate(indices):
        if isinstance(idx, tvm.ir.expr.Var) and idx in block_vars:
            if idx in axes:
                return None
            axes[idx] = axis
        elif not _is_int(idx, 0):
            return None
    return axes


def _covers(buf, axes: dict, domains: dict) -> bool:
    """Each variable spans its whole axis; every other axis has extent 1."""
    analyzer = arith.Analyzer()
    shape = buf.ty.shape
    by_axis = {axis: var for var, axis in axes.items()}
    for axis, extent in enumerate(shape):
        var = by_axis.get(axis)
        want = domains[var] if var is not None else 1
        if not analyzer.can_prove_equal(extent, want):
            return False
    return True


def _match_gemm(block, stmt: int) -> LibraryCall | None:
    acc = _accumulation(block)
    if acc is None:
        return None
    store, x, y = acc
    spatial = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    reduce = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if not reduce or len(spatial) + len(reduce) != len(block.iter_vars):
        return None
    domains = {iv.var: iv.dom.extent for iv in block.iter_vars}
    c_axes, x_axes, y_axes = (_var_axes(a.indices, set(domains)) for a in (store, x, y))
    if c_axes is None or x_axes is None or y_axes is None or set(c_axes) != set(spatial):
        return None
    if any(k not in x_axes or k not in y_axes for k in reduce):
        return None
    operands = (x.source, y.source, store.buffer)
    if len({id(o) for o in operands}) != 3 or store.buffer.same_as(x.source) or \
            store.buffer.same_as(y.source) or x.source.same_as(y.source):
        return None
    axes = (x_axes, y_axes, c_axes)
    if not all(_covers(b, a, domains) for b, a in zip(operands, axes, strict=True)):
        return None
    groups = _gemm_groups(spatial, reduce, axes)
    if groups is None:
        return None
    views = tuple(_view(a, len(b.ty.shape), groups) for a, b in zip(axes, operands,
                                                                     strict=True))
    if any(v is None for v in views):
        return None
    return LibraryCall("gemm", stmt, str(block.name_hint), operands,
                       tuple(str(b.ty.dtype) for b in operands),
                       tuple(tuple(r for r, _ in v) for v in views),
                       views=tuple(tuple(ax for _, ax in v) for v in views), flops=_flops(block))


def _gemm_groups(spatial, reduce, axes) -> dict | None:
    """{var: (role, the group's vars in axis order)}: the variables read by A and C only form
    M, by B and C only N, the reduction ones K, each group merged into one matrix axis, so it
    must lie on adjacent axes, in one order, in both tensors that hold it (an M or N variable
    that does not is a batch dim of C broadcast over one operand instead); the other
    variables are batch dims, one role each."""
    x_axes, y_axes, c_axes = axes
    m_vars = _adjacent_run([v for v in spatial if v in x_axes and v not in y_axes],
                           (c_axes, x_axes))
    n_vars = _adjacent_run([v for v in spatial if v in y_axes and v not in x_axes],
                           (c_axes, y_axes))
    k_vars = _adjacent_run(list(reduce), (x_axes, y_axes))
    if not m_vars or not n_vars or len(k_vars) != len(reduce):
        return None
    groups = {}
    for role, order in ((M, m_vars), (N, n_vars), (K, k_vars)):
        for v in order:
            groups[v] = (role, tuple(order))
    batch = [v for v in spatial if v not in groups]
    for i, v in enumerate(sorted(batch, key=lambda v: c_axes[v])):
        groups[v] = (BATCH + i, (v,))
    return groups


def _adjacent_run(candidates: list, holders: tuple) -> list:
    """The candidates that lie on adjacent axes, in one order, in every tensor of `holders`,
    growing from the one on the last axis of the first holder; in axis order."""
    if not candidates:
        return []
    first = holders[0]
    order = sorted(candidates, key=lambda v: -first[v])
    run = [order[0]]
    for v in order[1:]:
        if all(held[v] == held[run[-1]] - 1 for held in holders):
            run.append(v)
        else:
            break
    return run[::-1]


def _view(axes: dict, ndim: int, groups: dict) -> list | None:
    """[(role, the tensor axes merged into one view axis)] of one operand."""
    by_axis = {axis: var for var, axis in axes.items()}
    out, axis = [], 0
    while axis < ndim:
        var = by_axis.get(axis)
        if var is None:
            out.append((UNIT, (axis,)))
            axis += 1
            continue
        role, members = groups[var]
        held = [m for m in members if m in axes]
        if not held[0].same_as(var):
            return None
        out.append((role, tuple(range(axis, axis + len(held)))))
        axis += len(held)
    return out


def _flops(block) -> int | None:
    total = 2
    for iv in block.iter_vars:
        extent = _static(iv.dom.extent)
        if extent is None:
            return None
        total *= extent
    return total


def _window(expr, out_var, red_var) -> tuple[int, int] | None:
    """(stride, dilation) of `out_var * stride + red_var * dilation`."""
    coeffs = arith.detect_linear_equation(expr, [out_var, red_var])
    if len(coeffs) != 3 or not all(isinstance(c, pe.IntImm) for c in coeffs):
        return None
    stride, dilation, const = (int(c.value) for c in coeffs)
    if const != 0 or stride < 1 or dilation < 1:
        return None
    return stride, dilation


def _group(expr, f, c) -> tuple[int, int] | None:
    """(filters per group, channels per group) of `f // fpg * cpg + c`; (0, 0) for `c`."""
    if expr.same_as(c):
        return 0, 0
    if not isinstance(expr, pe.Add):
        return None
    for prod, rest in ((expr.a, expr.b), (expr.b, expr.a)):
        if rest.same_as(c) and isinstance(prod, pe.Mul) and isinstance(prod.a, pe.FloorDiv) \
                and prod.a.a.same_as(f) and isinstance(prod.a.b, pe.IntImm) \
                and isinstance(prod.b, pe.IntImm):
            return int(prod.a.b.value), int(prod.b.value)
    return None


def _vars_in(exprs) -> set:
    found: list = []
    for e in exprs:
        tvm_ffi.structural_walk(e, [(pe.Var, found.append)])
    return set(found)


def _data_roles(data, n, f, c_candidates, others_out, reduce):
    """{role: (axis, ...)} of the data load: "n_axis" (its batch axis), "c" (channel axis, the
    reduction variable and the group), and "windows": [(axis, out var, red var, stride,
    dilation)] in axis order; None when an axis is none of these."""
    roles: dict = {"windows": []}
    free_out, free_red = list(others_out), list(reduce)
    for axis, idx in enumerate(data.indices):
        if idx.same_as(n) and "n_axis" not in roles:
            roles["n_axis"] = axis
            continue
        group = next(((c, _group(idx, f, c)) for c in c_candidates
                      if "c" not in roles and _group(idx, f, c) is not None), None)
        if group is not None:
            roles["c"] = (axis, group[0], *group[1])
            free_red = [r for r in free_red if not r.same_as(group[0])]
            continue
        window = next(((o, r, _window(idx, o, r)) for o in free_out for r in free_red
                       if _window(idx, o, r) is not None), None)
        if window is None:
            return None
        o, r, (stride, dilation) = window
        roles["windows"].append((axis, o, r, stride, dilation))
        free_out = [v for v in free_out if not v.same_as(o)]
        free_red = [v for v in free_red if not v.same_as(r)]
    return roles if "n_axis" in roles and "c" in roles else None


@dataclasses.dataclass(frozen=True)
class ConvParts:
    """What each piece of a convolution nest is: the output store, the data and weight loads,
    the block variables of each role, and the group structure."""

    store: tirx.BufferStore
    data: TensorLoad
    weight: TensorLoad
    n: tirx.Var  # image (the data's and the output's batch axis)
    f: tirx.Var  # filter (output channel)
    c: tirx.Var  # channel within a group (reduced)
    # (data axis, output variable, window variable, stride, dilation), in data-axis order
    windows: tuple
    groups: int
    fpg: int  # filters per group (0: ungrouped)
    cpg: int  # channels per group (0: ungrouped)
    domains: dict  # block variable -> its static extent

    @property
    def weight_order(self) -> list:
        """The weight's canonical axis order: filter, channel, window variables."""
        return [self.f, self.c, *(r for _, _, r, _, _ in self.windows)]


def conv_parts(func: tirx.PrimFunc, call: LibraryCall) -> ConvParts:
    """The `ConvParts` of the convolution `call` found in `func`."""
    parts = _conv_parts(_perfect_nest(root_statements(func)[call.stmt]))
    if parts is None:
        raise ValueError(f"{call.block} is not a convolution nest")
    return parts


def _match_conv(block, stmt: int) -> LibraryCall | None:
    """A 2-D or 1-D convolution, its operands stored in any axis order (see ConvLayout)."""
    parts = _conv_parts(block)
    return None if parts is None else _conv_call(block, stmt, parts)


def _conv_parts(block) -> ConvParts | None:
    acc = _accumulation(block)
    spatial = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    reduce = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    dims = len(reduce) - 1
    if acc is None or dims not in (1, 2) or len(spatial) != 2 + dims or \
            len(spatial) + len(reduce) != len(block.iter_vars):
        return None
    store, x, y = acc
    out_axes = _var_axes(store.indices, set(spatial))
    if out_axes is None or len(out_axes) != len(spatial):
        return None
    for data, weight in ((x, y), (y, x)):
        roles = _conv_roles(data, weight, spatial, reduce, dims)
        if roles is not None:
            break
    else:
        return None
    domains = {iv.var: _static(iv.dom.extent) for iv in block.iter_vars}
    dshape = _static_shape(data.source)
    if dshape is None or any(d is None for d in domains.values()):
        return None
    c_axis, c, fpg, cpg = roles["c"]
    if dshape[roles["n_axis"]] != domains[roles["n"]] or dshape[c_axis] % domains[c]:
        return None
    groups = dshape[c_axis] // domains[c]
    if (groups == 1) != (fpg == 0) or (groups > 1 and (fpg * groups != domains[roles["f"]] or
                                                       cpg != domains[c])):
        return None
    for axis, o, r, stride, dilation in roles["windows"]:
        # The window must stay inside the data buffer (padding lives in it already).
        if (domains[o] - 1) * stride + (domains[r] - 1) * dilation >= dshape[axis]:
            return None
    return ConvParts(store, data, weight, roles["n"], roles["f"], c, tuple(roles["windows"]),
                     groups, fpg, cpg, domains)


def _conv_roles(data, weight, spatial, reduce, dims) -> dict | None:
    weight_vars = _vars_in(weight.indices)
    f = [v for v in spatial if v in weight_vars]
    if len(f) != 1 or weight_vars != {f[0], *reduce} or len(data.indices) != 2 + dims:
        return None
    f = f[0]
    plain = [idx for idx in data.indices if isinstance(idx, pe.Var) and idx in spatial]
    batch = [v for v in plain if not v.same_as(f)]
    if len(batch) != 1:
        return None
    n = batch[0]
    others = [v for v in spatial if not v.same_as(n) and not v.same_as(f)]
    roles = _data_roles(data, n, f, reduce, others, reduce)
    if roles is None or len(roles["windows"]) != dims:
        return None
    return dict(roles, n=n, f=f)


def _conv_call(block, stmt, parts: ConvParts) -> LibraryCall | None:
    domains, store, weight, windows = parts.domains, parts.store, parts.weight, parts.windows
    if _static_shape(store.buffer) is None:
        return None
    order = parts.weight_order
    w_axes = _var_axes(weight.indices, set(order))
    wshape = _static_shape(weight.source)
    if w_axes is not None and len(w_axes) == len(order) and wshape is not None and \
            all(wshape[w_axes[v]] == domains[v] for v in order):
        w_view, copy = [w_axes[v] for v in order], ()
    else:  # computed through its index expressions into a [F, C/g, K..] buffer
        w_view, copy = list(range(len(order))), (tuple(order), tuple(weight.indices))
    out_axes = _var_axes(store.indices, set(domains))
    outs = [parts.n, parts.f, *(o for _, o, _, _, _ in windows)]
    y_view = [out_axes[v] for v in outs]
    n_axis = next(a for a, i in enumerate(parts.data.indices) if i.same_as(parts.n))
    c_axis = next(a for a, i in enumerate(parts.data.indices)
                  if not i.same_as(parts.n) and parts.c in _vars_in([i]))
    x_view = [n_axis, c_axis, *(axis for axis, _, _, _, _ in windows)]
    params = [(stride, dilation) for _, _, _, stride, dilation in windows]
    dims = len(windows)
    if dims == 1:  # a unit height, as a last axis of every operand's 4-D view
        x_view, w_view, y_view = ([v[0], v[1], 3, v[2]] for v in (x_view, w_view, y_view))
        params = [(1, 1), *params]
    (sh, dh), (sw, dw) = params
    operands = (parts.data.source, weight.source, store.buffer)
    return LibraryCall(f"conv{dims}d", stmt, str(block.name_hint), operands,
                       tuple(str(b.ty.dtype) for b in operands),
                       conv=(sh, sw, dh, dw, parts.groups), flops=_flops(block),
                       conv_axes=(tuple(x_view), tuple(w_view), tuple(y_view)),
                       weight_copy=copy + ((tuple(domains[v] for v in order),) if copy else ()))


def _static_shape(buf) -> tuple[int, ...] | None:
    shape = tuple(_static(s) for s in buf.ty.shape)
    return None if any(s is None for s in shape) else shape
