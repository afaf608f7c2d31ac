"""One device's view of a kernel: the fused PrimFunc on a chunk of some of its dims.

`tvm_ext.ir.kernel_dims.kernel_dims` says which block iteration variables and buffer axes
form each dim of a kernel. Running the kernel on 1/f of dim d is then a matter of shrinking, by
f, every iteration domain of d, the loop that binds it, and every buffer axis it indexes
(parameters and intermediates): the index expressions stay as they are, since a chunk of the dim
reads exactly the chunk of each axis (`kernel_dims` checked that `X[16 * b + t]` or `X[h // 16]`
line up). This is exact only when nothing reads the dim's global position:

* a dim used as a value (one-hot, iota, flattened argmax positions), or in the index of an axis
  it does not cut (an input read whole), must see global indices: the kernel then takes the
  index of its chunk (`chunk_<dim>`, a scalar argument) and every such use of the variable
  becomes its global value, `v + chunk * local extent` for a contiguous chunk, the block
  arithmetic of the layout convention for the strided blocks of a dim split below a mesh level
  that does not split it (uses as indices of the axes it cuts stay local); a dim that only
  feeds a computed index (`x[i, labels[i]]`) needs nothing;
* a dim read through a window (`x[yy + ry - 1]`: a convolution's halo) reads beyond its chunk:
  across devices that needs a halo exchange (not lowered); a split in time copies each chunk's
  input range in, halo rows included, and `local_kernel(..., halo=True)` reads it there
  (`halo_chunks`);
* a dim reduced into an intermediate that the kernel reads again (softmax's max and sum, layer
  norm's mean, a matmul followed by its bias) needs an allreduce in the middle of the kernel:
  `split_kernel` cuts the kernel after each such block, so the allreduce runs between the parts;
* a loop must bind the variable directly (no fused or split loops).

`lowering_obstacle` says which of these stops a dim (None when it lowers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock, SBlockRealize

from ..errors import InputError
from .halo_chunks import HaloChunk, chunk_rows, halo_chunk, halo_obstacle
from .kernel_dims import KernelDims


class LoweringError(InputError):
    """A kernel cannot run on a chunk of the dims asked for."""


def lowering_obstacle(kdims: KernelDims, dim: int, allow_inner: bool = True,
                      allow_halo: bool = False) -> str | None:
    """Why dim `dim` of a kernel cannot be split by this lowering (None: it can).
    `allow_halo`: chunks may read their windows' input rows beyond the chunk (`halo_chunks`;
    what a split in time copies in, not what a device holds)."""
    spec = kdims.spec.dims[dim]
    if not spec.valid:
        return spec.reason
    if has_halo(kdims, dim):
        if not allow_halo:
            if any(c is not None and c.halo for c in spec.inputs):
                return "a window reads beyond the chunk (a halo exchange, not lowered)"
            return "a window variable reads the dim at an offset (a halo exchange, not lowered)"
        why = halo_obstacle(kdims, dim)
        if why is not None:
            return why
    if spec.inner:
        if not allow_inner:
            return "an allreduce inside the kernel (" + ", ".join(r.buffer for r in spec.inner) \
                + ")"
        try:
            split_kernel(kdims.func, kdims.spec.num_outputs, inner_blocks(kdims, [dim]))
        except LoweringError as err:
            return f"an allreduce inside the kernel, which cannot be cut there: {err}"
    try:
        _loop_factors(kdims, {dim: 2}, check_divisible=False)
    except LoweringError as err:
        return str(err)
    return None


def has_halo(kdims: KernelDims, dim: int) -> bool:
    """Whether a chunk of `dim` reads input rows beyond the chunk (through windows)."""
    return dim in kdims.window_dims or any(c is not None and c.halo
                                           for c in kdims.spec.dims[dim].inputs)


def inner_blocks(kdims: KernelDims, dims: Sequence[int]) -> set[str]:
    """The blocks after which the allreduces of split dims `dims` run."""
    return {r.buffer.split(":")[0] for d in dims for r in kdims.spec.dims[d].inner}


def _realizes(func: tirx.PrimFunc) -> list:
    out: list = []
    tvm_ffi.structural_walk(func.body, [(SBlockRealize, out.append)])
    return out


def _int(x) -> int:
    return int(x.value) if hasattr(x, "value") else int(x)


def _loop_factors(kdims: KernelDims, factors: Mapping[int, int], func: tirx.PrimFunc | None = None,
                  check_divisible: bool = True) -> dict:
    """Loop Var -> factor: the loops binding a variable of a split dim."""
    loops: dict = {}
    func = func if func is not None else kdims.func
    extents: dict = {}
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda f: extents.__setitem__(
        f.loop_var, (_int(f.min), _int(f.extent))))])
    for r in _realizes(func):
        for iv, value in zip(r.block.iter_vars, r.iter_values, strict=True):
            d = kdims.var_dims.get(iv.var, -1)
            f = factors.get(d, 1) if d >= 0 else 1
            if f == 1:
                continue
            name = f"block {r.block.name_hint}, variable {iv.var.name}"
            if not isinstance(value, tvm.ir.expr.Var) or value not in extents:
                raise LoweringError(f"{name} is bound to `{value}`, not to a loop")
            extent = _int(iv.dom.extent)
            if extents[value] != (0, extent):
                raise LoweringError(f"{name}: its loop runs over {extents[value]}, not [0, "
                                    f"{extent})")
            if check_divisible and extent % f:
                raise LoweringError(f"{name}: extent {extent} does not divide by {f}")
            if loops.setdefault(value, f) != f:
                raise LoweringError(f"loop {value.name} binds variables of two split dims")
    return loops


def _new_buffer(buf, shape: Sequence[int]):
    ty = buf.ty
    return tirx.decl_buffer(
        [tirx.IntImm(str(s.ty), v) for s, v in zip(ty.shape, shape, strict=True)],
        ty.dtype, buf.name, elem_offset=ty.elem_offset, scope=ty.storage_scope,
        data_alignment=ty.data_alignment,
        offset_factor=ty.offset_factor, layout=ty.layout)


def local_kernel(
    kdims: KernelDims,
    factors: Mapping[int, int],
    param_shapes: Mapping[int, Sequence[int]] | None = None,
    func: tirx.PrimFunc | None = None,
    num_outputs: int | None = None,
    levels: Mapping[int, Sequence[tuple[int, bool]]] | None = None,
    halo: bool = False,
) -> tirx.PrimFunc:
    """The kernel of `kdims` with each dim d of `factors` cut to 1/factors[d] of its extent.

    `param_shapes` gives the shape of buffer parameters by position explicitly (inputs the
    kernel never reads keep whatever piece the device holds). `func` is a part of the kernel
    (`split_kernel`) to shrink instead of the whole. A split dim whose index the kernel uses as
    a value adds a scalar parameter `chunk_<d>` (int64, after the inputs, before the
    `num_outputs` outputs, default the kernel's): the index of the device's chunk of dim d
    (`chunk_params` names them). The chunk is contiguous unless `levels[d]` lists the mesh
    levels from the outermost to the deepest one splitting d as `(parts, splits_d)`: the device
    then holds the blocks of the index convention of `tvm_ext.partition.layout` (strided when a
    level above a splitting one does not split d), and `chunk_<d>` is its coordinates at the
    splitting levels as one mixed-radix number, outermost first. With `halo`, one dim may be
    read through windows (`halo_chunks`): its inputs along the windowed axis are the chunk's
    input range, halo rows included, and the kernel takes its chunk index.
    """
    func = func if func is not None else kdims.func
    factors = {d: f for d, f in factors.items() if f > 1}
    for d in factors:
        why = lowering_obstacle(kdims, d, allow_halo=halo)
        if why is not None:
            raise LoweringError(f"dim {kdims.spec.dims[d].name}: {why}")
    halos = [halo_chunk(kdims, d, f) for d, f in factors.items() if has_halo(kdims, d)]
    if len(halos) > 1 or (halos and levels):
        raise LoweringError("chunks of more than one windowed dim, or across mesh levels, are "
                            "not lowered")
    loops = _loop_factors(kdims, factors, func)
    chunks = {d: tirx.Var(f"chunk_{d}", "int64") for d in factors
              if d in kdims.value_dims or any(h.dim == d for h in halos)}
    shift = _global_shifts(kdims, func, factors, chunks, levels)
    hc = halos[0] if halos else None
    if hc is not None:
        for var, step in hc.window_step.items():
            shift[var] = var + tirx.IntImm(str(var.ty), step) * (
                chunks[hc.dim] if str(var.ty) == "int64" else tirx.Cast(str(var.ty),
                                                                        chunks[hc.dim]))
    remap, shapes = _shrunk_buffers(kdims, func, factors, param_shapes, hc)
    out = _Shrink(kdims, factors, loops, remap, shapes, shift, hc,
                  _loop_extents(func, hc)).mutate(func)
    n_out = kdims.spec.num_outputs if num_outputs is None else num_outputs
    return _with_chunk_params(out, chunks, n_out)


def _global_shifts(kdims: KernelDims, func: tirx.PrimFunc, factors: Mapping[int, int],
                   chunks: Mapping, levels: Mapping[int, Sequence[tuple[int, bool]]] | None
                   ) -> dict:
    """Block variable -> its global value, for the variables of dims used as values."""
    shift: dict = {}
    for block in _blocks_in(func.body):
        for iv in block.iter_vars:
            d = kdims.var_dims.get(iv.var, -1)
            if d in chunks:
                shift[iv.var] = _global_index(iv.var, _int(iv.dom.extent), factors[d],
                                              chunks[d], (levels or {}).get(d))
    return shift


def _shrunk_buffers(kdims: KernelDims, func: tirx.PrimFunc, factors: Mapping[int, int],
                    param_shapes: Mapping[int, Sequence[int]] | None,
                    hc: HaloChunk | None = None) -> tuple[dict, dict]:
    """(old buffer -> new buffer, new buffer -> (old shape, new shape)) for the buffers whose
    shape changes: the axes of split dims cut, parameters in `param_shapes` as given; with a
    windowed dim `hc`, its inputs' windowed axes hold the chunk's input range and the buffers
    window variables write hold their rows."""
    remap: dict = {}
    shapes: dict = {}
    params = [p for p in func.params if getattr(p, "shape", None) is not None]
    forced = dict(param_shapes or {})
    windowed = _window_axes(func, hc) if hc is not None else {}
    # Input positions of the whole kernel (`func` may be a part of it, with other positions).
    kernel_inputs = [p for p in kdims.func.params
                     if getattr(p, "shape", None) is not None][:kdims.spec.num_inputs]
    for buf, axes in kdims.buffer_dims.items():
        old = [_int(s) for s in buf.ty.shape]
        new = list(old)
        pos = next((i for i, p in enumerate(params) if p.same_as(buf)), None)
        kpos = next((i for i, p in enumerate(kernel_inputs) if p.same_as(buf)), None)
        for a, d in enumerate(axes):
            if hc is not None and kpos is not None and kpos in hc.input_halo and \
                    hc.input_halo[kpos][0] == a:
                _, lo, hi = hc.input_halo[kpos]
                if new[a] % hc.factor:
                    raise LoweringError(f"buffer {buf.name} axis {a} ({new[a]}) does not "
                                        f"divide by {hc.factor}")
                new[a] = chunk_rows(new[a], hc.factor, lo, hi)
            elif (buf, a) in windowed:
                new[a] = windowed[(buf, a)]
            elif d in factors:
                if new[a] % factors[d]:
                    raise LoweringError(f"buffer {buf.name} axis {a} ({new[a]}) does not divide "
                                        f"by {factors[d]}")
                new[a] //= factors[d]
        if pos is not None and pos in forced:
            new = [int(s) for s in forced[pos]]
        if new != old:
            nb = _new_buffer(buf, new)
            remap[buf] = nb
            shapes[nb] = (old, new)
    return remap, shapes


def _window_axes(func: tirx.PrimFunc, hc: HaloChunk) -> dict:
    """(buffer, axis) -> its extent in a chunk, for the axes window variables store at."""
    out: dict = {}
    for block in _blocks_in(func.body):
        stores: list = []
        tvm_ffi.structural_walk(block.body, [(tirx.BufferStore, stores.append)])
        for st in stores:
            for a, idx in enumerate(st.indices):
                if isinstance(idx, tvm.ir.expr.Var) and idx in hc.window_extent:
                    out[(st.buffer, a)] = hc.window_extent[idx]
    return out


def _loop_extents(func: tirx.PrimFunc, hc: HaloChunk | None) -> dict:
    """Loop Var -> its extent in a chunk, for the loops binding window variables."""
    if hc is None:
        return {}
    out: dict = {}
    for r in _realizes(func):
        for iv, value in zip(r.block.iter_vars, r.iter_values, strict=True):
            if iv.var in hc.window_extent:
                if not isinstance(value, tvm.ir.expr.Var):
                    raise LoweringError(f"window variable {iv.var.name} is bound to `{value}`, "
                                        "not to a loop")
                out[value] = hc.window_extent[iv.var]
    return out


@dataclasses.dataclass
class _Shrink:
    """The rewrite of `local_kernel`: loops, block domains and buffers cut, split variables used
    as values shifted to their global value."""

    kdims: KernelDims
    factors: Mapping[int, int]
    loops: Mapping  # loop Var -> factor
    remap: Mapping  # old buffer -> new buffer
    shapes: Mapping  # new buffer -> (old shape, new shape)
    shift: Mapping  # block variable -> its global value
    halo: HaloChunk | None = None  # a dim read through windows (`halo_chunks`)
    loop_extent: Mapping = dataclasses.field(default_factory=dict)  # loop Var -> its extent

    def __post_init__(self):
        # Window variables belong to the dim they window; input axes read with a halo.
        self.var_dim = dict(self.kdims.var_dims)
        self.halo_axes: dict = {}  # input buffer (old and new) -> (axis, halo rows before)
        if self.halo is not None:
            self.var_dim.update({v: self.halo.dim for v in self.halo.window_extent})
            params = [p for p in self.kdims.func.params if getattr(p, "shape", None) is not None]
            for pos, (axis, lo, _) in self.halo.input_halo.items():
                for buf in (params[pos], self.remap.get(params[pos])):
                    if buf is not None:
                        self.halo_axes[buf] = (axis, lo)

    def mutate(self, func: tirx.PrimFunc) -> tirx.PrimFunc:
        """`func` with every rewrite applied."""
        return tvm_ffi.structural_mutate(func, [
            (tirx.PrimFunc, self.on_func), (tirx.For, self.on_for),
            (tirx.IterVar, self.on_iter_var), (tvm.ir.expr.TensorRegion, self.on_region),
            (tirx.BufferStore, self.on_store), (tvm.ir.TensorLoad, self.on_load),
            (tirx.Bind, self.on_bind)])

    def on_func(self, f, m):
        """The function with its buffers replaced by their shrunk versions."""
        for old, new in self.remap.items():
            m.var_remap_set(old, new)
        return m.default_mutate(f)

    def on_for(self, loop, m):
        """A loop binding a split variable, its extent cut."""
        loop = m.default_mutate(loop)
        f = self.loops.get(loop.loop_var)
        if loop.loop_var in self.loop_extent:
            extent = tirx.IntImm(str(loop.extent.ty), self.loop_extent[loop.loop_var])
        elif f is None:
            return loop
        else:
            extent = tirx.IntImm(str(loop.extent.ty), _int(loop.extent) // f)
        return tirx.For(loop.loop_var, loop.min, extent, loop.kind, loop.body,
                        loop.thread_binding, loop.annotations)

    def on_iter_var(self, iv, m):
        """A block variable of a split dim, its domain cut."""
        iv = m.default_mutate(iv)
        d = self.kdims.var_dims.get(iv.var, -1)
        f = self.factors.get(d, 1) if d >= 0 else 1
        if self.halo is not None and iv.var in self.halo.window_extent:
            extent = tirx.IntImm(str(iv.dom.extent.ty), self.halo.window_extent[iv.var])
        elif f == 1:
            return iv
        else:
            extent = tirx.IntImm(str(iv.dom.extent.ty), _int(iv.dom.extent) // f)
        return tirx.IterVar(tvm.ir.Range.from_min_extent(iv.dom.min, extent), iv.var,
                            iv.iter_type, iv.thread_tag)

    def on_region(self, region, m):
        """A region of a shrunk buffer: whole-axis ranges cover the new extent."""
        region = m.default_mutate(region)
        if region.source not in self.shapes:
            return region
        old, new = self.shapes[region.source]
        halo = self.halo_axes.get(region.source)
        ranges = []
        for a, (r, o, n) in enumerate(zip(region.region, old, new, strict=True)):
            if o != n and _is_const(r.min, 0) and _is_const(r.extent, o):
                r = tvm.ir.Range.from_min_extent(r.min, tirx.IntImm(str(r.extent.ty), n))
            elif halo is not None and halo[0] == a:  # the chunk's range starts halo rows early
                r = tvm.ir.Range.from_min_extent(r.min + tirx.IntImm(str(r.min.ty), halo[1]),
                                                 r.extent)
            ranges.append(r)
        return tvm.ir.expr.TensorRegion(region.source, ranges, region.ty)

    def global_values(self, expr):
        """`expr` with the split variables used as values shifted to their global value (not
        inside buffer indices, which address the local piece)."""
        return _substitute_direct(expr, self.shift)

    def on_load(self, load, m):
        """Indices of an axis not cut by a split dim take that dim's global value."""
        kdims, shift = self.kdims, self.shift
        axes = kdims.buffer_dims.get(load.source)
        halo = self.halo_axes.get(load.source)
        load = m.default_mutate(load)
        if not shift or axes is None:
            return load
        indices = [idx if axis_dim == -2 else _substitute_direct(idx, {
            v: g for v, g in shift.items() if self.var_dim.get(v) != axis_dim})
            for idx, axis_dim in zip(load.indices, axes, strict=True)]
        if halo is not None:  # the chunk's input range starts halo rows before the chunk
            a, lo = halo
            indices[a] = indices[a] + tirx.IntImm(str(indices[a].ty), lo)
        return tirx.BufferLoad(load.source, indices)

    def on_store(self, store, m):
        """A store whose value reads split variables at their global value."""
        store = m.default_mutate(store)
        if not self.shift:
            return store
        return tirx.BufferStore(store.buffer, self.global_values(store.value), store.indices)

    def on_bind(self, bind, m):
        """A binding whose value reads split variables at their global value."""
        bind = m.default_mutate(bind)
        return tirx.Bind(bind.var, self.global_values(bind.value)) if self.shift else bind


def _with_chunk_params(out: tirx.PrimFunc, chunks: Mapping, n_out: int) -> tirx.PrimFunc:
    """`out` taking the chunk indices it uses as scalars after its inputs, before its `n_out`
    outputs."""
    used: set = set()
    tvm_ffi.structural_walk(out.body, [(tvm.ir.expr.Var, used.add)])
    scalars = [v for d, v in sorted(chunks.items()) if v in used]
    ins, outs = out.params[:len(out.params) - n_out], out.params[len(out.params) - n_out:]
    # Rebuilt so that the function's type (what Relax checks calls against) has the new shapes.
    return tirx.PrimFunc([*ins, *scalars, *outs], out.body, out.ret_type, out.attrs)


def _substitute_direct(expr, values: Mapping) -> object:
    """`expr` with variables replaced by `values`, except inside nested loads."""
    if not values:
        return expr
    return tvm_ffi.structural_mutate(expr, [
        (tvm.ir.TensorLoad, lambda load, m: load),
        (tvm.ir.expr.Var, lambda v, m: values.get(v, v))])


def _global_index(var, extent: int, factor: int, chunk,
                  levels: Sequence[tuple[int, bool]] | None):
    """The global value of `var` (a dim of `extent` cut `factor` ways) on the device whose
    chunk index is `chunk` (see `local_kernel`, `levels`)."""
    dtype = str(var.ty)

    def const(x: int):
        return tirx.IntImm(dtype, x)

    chunk = chunk if str(chunk.ty) == dtype else tirx.Cast(dtype, chunk)
    if levels is None or all(split for _, split in levels):
        return var + chunk * const(extent // factor)
    # Along the dim, block b (of extent / prod(parts)) has one mixed-radix digit per level:
    # the device's coordinate at the splitting levels, the local block number's digits at the
    # others (the blocks a device holds, in increasing order).
    parts = [p for p, _ in levels]
    block = extent // math.prod(parts)
    if block * math.prod(parts) != extent:
        raise LoweringError(f"extent {extent} does not divide into {math.prod(parts)} blocks")
    local_block = tirx.floordiv(var, const(block))
    split_left = math.prod(p for p, split in levels if split)
    free_left = math.prod(p for p, split in levels if not split)
    if split_left != factor:
        raise LoweringError(f"levels {list(levels)} split the dim {split_left} ways, not "
                            f"{factor}")
    value = tirx.floormod(var, const(block))
    weight = block * math.prod(parts)
    for p, split in levels:
        weight //= p
        if split:
            split_left //= p
            digit = tirx.floormod(tirx.floordiv(chunk, const(split_left)), const(p))
        else:
            free_left //= p
            digit = tirx.floormod(tirx.floordiv(local_block, const(free_left)), const(p))
        value = value + digit * const(weight)
    return value


def chunk_params(func: tirx.PrimFunc) -> list[int]:
    """The dims whose chunk index `func` (a `local_kernel`) takes, in parameter order."""
    return [int(p.name.split("_")[1]) for p in func.params
            if getattr(p, "shape", None) is None and p.name.startswith("chunk_")]


def _is_const(expr, value: int) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr.value) == value


@dataclasses.dataclass
class KernelPart:
    """A part of a kernel cut by `split_kernel`: a PrimFunc whose parameters are some of the
    kernel's inputs, then intermediates of earlier parts, then its outputs."""

    func: tirx.PrimFunc
    inputs: list  # ("in", i) a kernel input, ("tmp", i) an intermediate of an earlier part
    outputs: list  # ("out", i) a kernel output, ("tmp", i) an intermediate for later parts
    writers: dict = dataclasses.field(default_factory=dict)  # output key -> its writer block


def reshape_obstacle(in_shape: Sequence[int], out_shape: Sequence[int], in_axis: int | None,
                     out_axis: int | None) -> str | None:
    """Why a reshape split along `in_axis` -> `out_axis` is not the reshape of each device's
    piece (None: it is). The pieces of both sides are the same flat range of every row of the
    common prefix exactly when the axes before the cut hold the same number of elements."""
    if in_axis is None or out_axis is None:
        return "the split cuts only one side of the reshape (a gather or a slice, not a view)"
    before_in = 1
    for n in in_shape[:in_axis]:
        before_in *= int(n)
    before_out = 1
    for n in out_shape[:out_axis]:
        before_out *= int(n)
    if before_in != before_out:
        return (f"axis {in_axis} of {list(in_shape)} and axis {out_axis} of {list(out_shape)} "
                "start at different flat positions (the pieces are not a reshape of each other)")
    return None


def _blocks_in(stmt) -> list:
    out: list = []
    tvm_ffi.structural_walk(stmt, [(SBlock, out.append)])
    return [b for b in out if b.iter_vars]


def _buffers_touched(stmt) -> tuple[set, set]:
    """(buffers read, buffers written) inside a statement."""
    reads: set = set()
    writes: set = set()
    tvm_ffi.structural_walk(stmt, [(tvm.ir.TensorLoad, lambda x: reads.add(x.source)),
                                   (tirx.BufferStore, lambda x: writes.add(x.buffer))])
    return reads, writes


def split_kernel(func: tirx.PrimFunc, num_outputs: int, after_blocks: set[str]) -> list[KernelPart]:
    """Cut a kernel after each top-level loop nest that holds one of `after_blocks`, so that
    something (an allreduce of what the block reduced) can run between the parts. Buffers
    written in one part and read in a later one become outputs, then inputs (kernel outputs
    read again too)."""
    root = func.body
    if not isinstance(root, SBlockRealize) or root.block.iter_vars:
        raise LoweringError("the kernel has no root block to cut")
    body = root.block.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    groups: list[list] = [[]]
    found: set[str] = set()
    for st in stmts:
        names = {b.name_hint for b in _blocks_in(st)}
        groups[-1].append(st)
        cut = names & after_blocks
        if cut:
            if len(names) > 1:
                raise LoweringError(f"block {sorted(cut)[0]} shares a loop nest with other "
                                    "blocks (the kernel cannot be cut after it)")
            found |= cut
            groups.append([])
    if found != set(after_blocks):
        raise LoweringError(f"blocks {sorted(set(after_blocks) - found)} are not top-level loop "
                            "nests of the kernel")
    groups = [g for g in groups if g]
    params = [p for p in func.params if getattr(p, "shape", None) is not None]
    num_inputs = len(params) - num_outputs
    key_of = {p: ("in", i) if i < num_inputs else ("out", i - num_inputs)
              for i, p in enumerate(params)}
    for i, buf in enumerate(root.block.alloc_buffers):
        key_of[buf] = ("tmp", i)
    writer = {}
    for block in _blocks_in(body):
        _, written = _buffers_touched(block.body)
        for buf in written:
            writer[key_of.get(buf)] = block.name_hint
    touched = [_buffers_touched(tirx.SeqStmt(g) if len(g) > 1 else g[0]) for g in groups]
    parts = []
    for i, g in enumerate(groups):
        reads, writes = touched[i]
        later_reads = set().union(*(r for r, _ in touched[i + 1:])) if i + 1 < len(groups) \
            else set()
        earlier_writes = set().union(*(w for _, w in touched[:i])) if i else set()
        ins = [p for p in params if p in reads and (key_of[p][0] == "in" or
                                                    p in earlier_writes)]
        ins += [b for b in root.block.alloc_buffers if b in reads and b in earlier_writes]
        outs = [b for b in root.block.alloc_buffers if b in writes and b in later_reads]
        outs += [p for p in params if key_of[p][0] == "out" and p in writes]
        local = [b for b in root.block.alloc_buffers if (b in reads or b in writes) and
                 b not in ins and b not in outs]
        block = SBlock([], [], [], "root", tirx.SeqStmt(g) if len(g) > 1 else g[0],
                       alloc_buffers=local)
        part = tirx.PrimFunc([*ins, *outs], SBlockRealize([], True, block), func.ret_type,
                             func.attrs)
        parts.append(KernelPart(part, [key_of[b] for b in ins], [key_of[b] for b in outs],
                                {key_of[b]: writer.get(key_of[b], "") for b in outs}))
    return parts
