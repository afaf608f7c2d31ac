"""Kernel index analysis: what each iteration dim of a kernel's TIR indexes.

For every kernel of a legalized, fused module (and every reshape view) this derives a
`KernelSpec` (see `spec.py`): the iteration dims of the kernel and, for each, how splitting it
splits the inputs and outputs. Nothing is written by hand per operator:

1. Each block of the PrimFunc gives its iteration variables (spatial or reduction), its stores
   (whose indices must be plain variables) and every load. Load indices are simplified under the
   variables' ranges and read as affine forms `sum(c_v * v) + c`, `floor(affine / d)` (a
   reshape that merges axes) or `v % m`; anything else (a gathered index `idx[i]`) is an axis
   read whole.
2. Variables are unified into dims. A consumer reading an intermediate buffer so that chunks of
   one of its variables read exactly the chunks of the producer's variable (`X[i]`,
   `X[16 * b + t]`, `X[h // 16]`) shares the producer's dim; variables of different blocks that
   read one input axis at a plain variable are one dim too (softmax's reduction and its
   normalisation), unless two variables of one block would merge (`x[i] * x[j]`).
3. A producer variable its only consumer reads through a window (`pad_temp[yy + ry]`) is
   replaced by that window, so a convolution is seen to read `x[yy + ry - 1]`: a halo.
4. Per dim: each input axis it indexes in chunks (scale `axis * d == c * dim`, window inside
   the chunk) is cut, with halo rows from the window's range; reductions over the dim whose
   results are read again need an allreduce inside the kernel, with the combiner (sum, max, min,
   prod) read from the update; the dim is flagged when its index is used as a value (padding
   tests, one-hot) or feeds a computed index.

What cannot be analysed makes a dim invalid (with the reason) or the whole kernel replicated
(with a note); `PartitionProblem.unsupported()` lists them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import tvm
import tvm_ffi
from tvm import sym as arith
from tvm import te, tirx, topi
from tvm.ir import TensorLoad
from tvm.ir.prim import expr as pe
from tvm.s_tir import SBlockRealize

from ..partition.problem import PartitionProblem
from ..partition.spec import AxisCut, DimSpec, InnerReduce, KernelSpec, replicated_spec
from .graph_builder import build_graph
from .kernel_cost import buffer_bytes

_COMBINER_OPS = ((pe.Add, "sum"), (pe.Max, "max"), (pe.Min, "min"), (pe.Mul, "prod"))
_LEAVES = (pe.IntImm, pe.FloatImm, tvm.ir.expr.StringImm)


class _Unsupported(Exception):
    """The kernel uses a construct the analysis does not read: it will be replicated."""


@dataclasses.dataclass
class _Form:
    """`floor((sum(coeffs[v] * v) + const) / den)`, or `v % mod` when mod > 0."""

    coeffs: dict[int, int]
    const: int = 0
    den: int = 1
    mod: int = 0


@dataclasses.dataclass
class _Index:
    form: _Form | None  # None: not affine, the axis is read whole
    direct: set[int]  # variables in the index outside nested loads


@dataclasses.dataclass
class _Access:
    buffer: object  # buffer key
    indices: list[_Index]


@dataclasses.dataclass
class _Block:
    name: str
    var_ids: list[int]
    stores: list[tuple[object, list[int]]]  # buffer key, variable id per axis
    loads: list[_Access]
    value_vars: set[int]  # variables used as values, not only as indices
    combiner: str | None  # of a reduction block with one store


def _int(x) -> int:
    return int(x.value) if hasattr(x, "value") else int(x)


class _KernelReader:
    """Reads one PrimFunc into blocks, variables and buffers (step 1)."""

    def __init__(self, func: tirx.PrimFunc, num_outputs: int):
        params = [p for p in func.params if getattr(p, "shape", None) is not None]
        if num_outputs > len(params):
            raise _Unsupported(f"{num_outputs} outputs but {len(params)} buffer parameters")
        self.num_inputs = len(params) - num_outputs
        self.keys: dict[object, object] = {}
        self.names: dict[object, str] = {}
        self.shapes: dict[object, tuple[int, ...]] = {}
        self.dtypes: dict[object, str] = {}
        for i, p in enumerate(params):
            key = ("in", i) if i < self.num_inputs else ("out", i - self.num_inputs)
            self._add_buffer(p, key)
        self.var_extent: list[int] = []
        self.var_reduce: list[bool] = []
        self.var_name: list[str] = []
        self.var_block: list[int] = []
        self.blocks: list[_Block] = []
        realizes: list = []
        tvm_ffi.structural_walk(func.body, [(SBlockRealize, realizes.append)])
        for r in realizes:
            for buf in r.block.alloc_buffers:
                self._add_buffer(buf, ("tmp", len(self.keys)))
        owned = 0
        for r in realizes:
            if r.block.iter_vars:
                if not (isinstance(r.predicate, pe.IntImm) and int(r.predicate.value) == 1):
                    raise _Unsupported(f"block {r.block.name_hint} has a predicate")
                owned += self._read_block(r.block)
        total: list = []
        tvm_ffi.structural_walk(func.body, [(tirx.BufferStore, total.append)])
        if len(total) != owned:
            raise _Unsupported("stores outside iteration blocks (hand-written loops)")
        if not self.blocks:
            raise _Unsupported("no iteration blocks")

    def _add_buffer(self, buf, key) -> None:
        if not all(isinstance(s, pe.IntImm) for s in buf.shape):
            # A generic kernel (TVM's GPU scan) serves every call's shapes: read as a whole.
            raise _Unsupported(f"buffer {buf.name} has a symbolic extent {list(buf.shape)}")
        self.keys[buf] = key
        self.names[key] = str(buf.name)
        self.shapes[key] = tuple(_int(s) for s in buf.shape)
        self.dtypes[key] = str(buf.dtype)

    def key(self, buf):
        if buf not in self.keys:
            raise _Unsupported(f"access to an unknown buffer {getattr(buf, 'name', buf)}")
        return self.keys[buf]

    def _read_block(self, block) -> int:
        base = len(self.var_extent)
        local: dict[object, int] = {}
        analyzer = arith.Analyzer()
        for iv in block.iter_vars:
            if iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce):
                raise _Unsupported(f"block {block.name_hint}: iteration type {iv.iter_type}")
            if not isinstance(iv.dom.min, pe.IntImm) or \
                    not isinstance(iv.dom.extent, pe.IntImm):
                raise _Unsupported(f"block {block.name_hint}: its domain depends on an "
                                   f"enclosing loop")
            if _int(iv.dom.min) != 0:
                raise _Unsupported(f"block {block.name_hint}: iteration not from 0")
            local[iv.var] = len(self.var_extent)
            self.var_extent.append(_int(iv.dom.extent))
            self.var_reduce.append(iv.iter_type == tirx.IterVar.CommReduce)
            self.var_name.append(f"{block.name_hint}.{iv.var.name}")
            self.var_block.append(len(self.blocks))
            analyzer.bind(iv.var, iv.dom)
        stores: list = []
        values: list = []
        _statements(block.body, stores, values)
        n_stores = len(stores)
        if block.init is not None:
            init_stores: list = []
            _statements(block.init, init_stores, [])
            n_stores += len(init_stores)
        store_list = []
        for st in stores:
            ids = []
            for idx in st.indices:
                if idx not in local:
                    raise _Unsupported(f"block {block.name_hint} stores at a computed index")
                ids.append(local[idx])
            store_list.append((self.key(st.buffer), ids))
            values.append(st.value)
        loads: list[_Access] = []
        value_vars: set[int] = set()
        for v in values:
            self._scan(v, analyzer, local, loads, value_vars, block.name_hint)
        combiner = None
        if len(stores) == 1 and any(self.var_reduce[base:]):
            combiner = _combiner(stores[0])
        self.blocks.append(_Block(block.name_hint, list(range(base, len(self.var_extent))),
                                  store_list, loads, value_vars, combiner))
        return n_stores

    def _scan(self, expr, analyzer, local, loads, value_vars, block_name) -> None:
        """Collect loads (with index forms) and variables used as values."""
        if isinstance(expr, TensorLoad):
            indices = []
            for i in expr.indices:
                i = analyzer.simplify(i)
                direct: set[int] = set()
                self._scan(i, analyzer, local, loads, direct, block_name)
                indices.append(_Index(_form(i, local), direct))
            loads.append(_Access(self.key(expr.source), indices))
            return
        if isinstance(expr, tvm.ir.expr.Var):
            if expr in local:
                value_vars.add(local[expr])
            return
        if isinstance(expr, _LEAVES):
            return
        # Not subclasses LogicalExpr but has no `.b`: test it first.
        if isinstance(expr, pe.Not):
            children = (expr.a,)
        elif isinstance(expr, (pe.BinaryOpExpr, pe.CmpExpr, pe.LogicalExpr)):
            children = (expr.a, expr.b)
        elif isinstance(expr, pe.Select):
            children = (expr.condition, expr.true_value, expr.false_value)
        elif isinstance(expr, pe.Cast):
            children = (expr.value,)
        elif isinstance(expr, tirx.Let):
            children = (expr.value, expr.body)
        elif isinstance(expr, tvm.ir.expr.Call):
            children = tuple(expr.args)
        else:
            raise _Unsupported(f"block {block_name}: expression {type(expr).__name__}")
        for c in children:
            self._scan(c, analyzer, local, loads, value_vars, block_name)


def _statements(stmt, stores: list, values: list) -> None:
    if isinstance(stmt, tirx.BufferStore):
        stores.append(stmt)
    elif isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            _statements(s, stores, values)
    elif isinstance(stmt, tirx.Bind):
        values.append(stmt.value)
    else:
        raise _Unsupported(f"{type(stmt).__name__} inside an iteration block")


def _form(expr, local: dict) -> _Form | None:
    """The affine, floor-divided affine or modulo form of an index, or None."""
    if isinstance(expr, pe.FloorMod) and isinstance(expr.a, tvm.ir.expr.Var) and \
            expr.a in local and isinstance(expr.b, pe.IntImm):
        return _Form({local[expr.a]: 1}, mod=int(expr.b.value))
    den = 1
    if isinstance(expr, pe.FloorDiv) and isinstance(expr.b, pe.IntImm) and expr.b.value > 0:
        den, expr = int(expr.b.value), expr.a
    variables = list(local)
    coeffs = arith.detect_linear_equation(expr, variables)
    if len(coeffs) != len(variables) + 1 or not all(isinstance(c, pe.IntImm) for c in coeffs):
        return None
    form = {local[v]: int(c.value) for v, c in zip(variables, coeffs[:-1], strict=True)
            if int(c.value) != 0}
    return _Form(form, int(coeffs[-1].value), den)


def _combiner(store) -> str | None:
    """sum / max / min / prod when the update is `buf[i] = op(buf[i], x)`."""
    value = store.value
    for cls, name in _COMBINER_OPS:
        if isinstance(value, cls):
            for side in (value.a, value.b):
                if (isinstance(side, TensorLoad) and side.source.same_as(store.buffer)
                        and all(a.same_as(b) for a, b in zip(side.indices, store.indices,
                                                              strict=True))):
                    return name
    return None


def _axis_cut(form: _Form, v: int, axis_extent: int, var_extent: Sequence[int],
              axis: int = 0) -> AxisCut | None:
    """How a chunk of variable `v` reads an axis: the matching chunk plus a halo, or None
    when the chunks do not line up (see the module docstring, step 4)."""
    if form.mod:
        return None
    c, d = form.coeffs[v], form.den
    if c <= 0 or axis_extent * d != c * var_extent[v]:
        return None
    lo = hi = form.const
    for u, cu in form.coeffs.items():
        if u != v:
            span = cu * (var_extent[u] - 1)
            lo += min(0, span)
            hi += max(0, span)
    return AxisCut(axis, max(0, -(lo // d)), max(0, (hi - c) // d + 1))


class _UnionFind:
    """Dims as classes of variables; never two variables of one block in one class."""

    def __init__(self, extents: Sequence[int], block_of: Sequence[int]):
        self.parent = list(range(len(extents)))
        self.members = [{block_of[i]: i} for i in range(len(extents))]
        self.divisor = list(extents)  # chunk counts must divide it

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def conflicts(self, a: int, b: int) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        shared = self.members[ra].keys() & self.members[rb].keys()
        return any(self.members[ra][k] != self.members[rb][k] for k in shared)

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.members[ra].update(self.members[rb])
            self.divisor[ra] = math.gcd(self.divisor[ra], self.divisor[rb])


class _KernelAnalysis:
    """Dims and their splits (steps 2-4 of the module docstring)."""

    def __init__(self, reader: _KernelReader, num_outputs: int, kernel: str):
        self.r = reader
        self.kernel = kernel
        self.num_outputs = num_outputs
        self.uf = _UnionFind(reader.var_extent, reader.var_block)
        self.writer: dict[object, list[int]] = {}  # buffer -> store variable per axis
        for block in reader.blocks:
            for key, ids in block.stores:
                if key in self.writer:
                    raise _Unsupported(f"buffer {reader.names[key]} written by several blocks")
                self.writer[key] = ids
        self.derived: dict[int, _Form] = {}
        self._unify()

    def _reads(self):
        """Every load except a reduction reading its own result."""
        for block in self.r.blocks:
            own = {key for key, _ in block.stores}
            for acc in block.loads:
                if acc.buffer not in own:
                    yield acc

    def _intermediate_reads(self):
        for acc in self._reads():
            if acc.buffer[0] != "in" and acc.buffer in self.writer:
                yield acc, self.writer[acc.buffer]

    def _exact_var(self, form: _Form | None, extent: int) -> int | None:
        """The one variable whose chunks read exactly the chunks of an axis of `extent`."""
        if form is None or form.mod:
            return None
        for v in form.coeffs:
            cut = _axis_cut(form, v, extent, self.r.var_extent)
            if cut is not None and not cut.halo:
                return v
        return None

    # ---------------------------------------------------------------- steps 2-3
    def _unify(self) -> None:
        r, uf = self.r, self.uf
        windows: dict[int, list[_Form | None]] = {}
        for acc, wids in self._intermediate_reads():
            for a, index in enumerate(acc.indices):
                w = wids[a]
                v = self._exact_var(index.form, r.var_extent[w])
                if v is None:
                    windows.setdefault(w, []).append(index.form)
                    continue
                if uf.conflicts(v, w):
                    raise _Unsupported(f"an intermediate buffer is read transposed within one "
                                       f"block ({r.var_name[v]}, {r.var_name[w]})")
                uf.union(v, w)
        first: dict[tuple, int] = {}
        for acc in self._reads():
            if acc.buffer[0] != "in":
                continue
            for a, index in enumerate(acc.indices):
                v = _plain(index.form)
                if v is None or r.var_extent[v] != r.shapes[acc.buffer][a]:
                    continue
                u = first.setdefault((acc.buffer, a), v)
                if not uf.conflicts(u, v):
                    uf.union(u, v)
        for w, forms in windows.items():
            alone = len(uf.members[uf.find(w)]) == 1
            if alone and len(forms) == 1 and forms[0] is not None and forms[0].den == 1 \
                    and not forms[0].mod:
                self.derived[w] = forms[0]

    def resolve(self, form: _Form | None) -> _Form | None:
        """Substitute window variables (recursively) by their windows."""
        for _ in range(len(self.derived) + 1):
            if form is None or not any(v in self.derived for v in form.coeffs):
                return form
            if form.mod:
                return None
            coeffs, const = dict(form.coeffs), form.const
            for v in [v for v in form.coeffs if v in self.derived]:
                c, sub = coeffs.pop(v), self.derived[v]
                const += c * sub.const
                for u, cu in sub.coeffs.items():
                    coeffs[u] = coeffs.get(u, 0) + c * cu
            form = _Form({u: c for u, c in coeffs.items() if c}, const, form.den)
        return None

    def _touches(self, index: _Index, members: set[int]) -> bool:
        """The index depends on the dim (directly or through window variables)."""
        for v in index.direct:
            if v in members:
                return True
            if v in self.derived:
                form = self.resolve(_Form({v: 1}))
                if form is None or any(u in members for u in form.coeffs):
                    return True
        return False

    # ---------------------------------------------------------------- step 4
    def spec(self) -> KernelSpec:
        r, uf = self.r, self.uf
        classes: dict[int, list[int]] = {}
        for v in range(len(r.var_extent)):
            if v not in self.derived:
                classes.setdefault(uf.find(v), []).append(v)
        order = sorted((min(m), root) for root, m in classes.items() if uf.divisor[root] > 1)
        self.dim_index = {root: i for i, (_, root) in enumerate(order)}
        dims = [self._dim(root, classes[root]) for _, root in order]
        used = {acc.buffer[1] for acc in self._reads() if acc.buffer[0] == "in"}
        unused = [i for i in range(r.num_inputs) if i not in used]
        return KernelSpec(self.kernel, r.num_inputs, self.num_outputs, dims, [], unused)

    def _dim(self, root: int, members: list[int]) -> DimSpec:
        r = self.r
        member_set = set(members)
        first = min(members)
        divisor = self.uf.divisor[root]
        reason = None
        global_index = any(v in member_set or (v in self.derived and self._touches(
            _Index(None, {v}), member_set)) for b in r.blocks for v in b.value_vars)
        outputs: list[int | str | None] = [None] * self.num_outputs
        for key, wids in self.writer.items():
            if key[0] == "out":
                axes = [a for a, w in enumerate(wids) if self.uf.find(w) == root]
                if len(axes) > 1:
                    reason = reason or f"output {key[1]} has two axes in this dim"
                elif axes:
                    outputs[key[1]] = axes[0]
        # Reductions over the dim: partial outputs, or an allreduce inside the kernel.
        inner: list[InnerReduce] = []
        read_again = {acc.buffer for acc in self._reads()}
        for block in r.blocks:
            if not any(v in member_set and r.var_reduce[v] for v in block.var_ids):
                continue
            if block.combiner is None:
                reason = reason or f"block {block.name} reduces it with an unknown update"
                continue
            for key, ids in block.stores:
                if key[0] == "out" and key not in read_again:
                    outputs[key[1]] = block.combiner
                    continue
                dims = tuple(-1 if w in self.derived else self.dim_index.get(self.uf.find(w), -1)
                             for w in ids)
                nbytes = buffer_bytes(r.shapes[key], r.dtypes[key])
                inner.append(InnerReduce(f"{block.name}:{r.names[key]}", block.combiner,
                                         nbytes, dims))
        # Intermediates: read by the same chunks that computed them, not by the dim at all, or
        # computed whole by every chunk (their blocks have no variable of the dim: a resize's
        # source, read at computed rows).
        for acc, wids in self._intermediate_reads():
            if not any(self._touches(_Index(None, {v}), member_set) for b in r.blocks
                       if any(k == acc.buffer for k, _ in b.stores) for v in b.var_ids):
                continue
            for a, index in enumerate(acc.indices):
                w = wids[a]
                if w in self.derived:
                    continue
                if w in member_set:
                    ok = self._exact_var(index.form, r.var_extent[w]) in member_set
                else:
                    ok = not self._touches(index, member_set) and not (
                        index.form is not None and any(v in member_set
                                                       for v in index.form.coeffs))
                    if not ok and index.form is not None and index.form.mod:
                        ok, divisor = True, math.gcd(divisor, _mod_divisor(index.form, r))
                if not ok:
                    reason = reason or f"intermediate {r.names[acc.buffer]} is read across " \
                                       f"chunks"
        inputs, divisor, computed = self._input_cuts(member_set, divisor)
        return DimSpec(r.var_name[first], r.var_extent[first], inputs, outputs, inner,
                       global_index or computed, reason, divisor)

    def _input_cuts(self, members: set[int], divisor: int):
        """Per input: the one axis every load of it reads by chunks of the dim, else None."""
        r = self.r
        per_input: list[list[_Access]] = [[] for _ in range(r.num_inputs)]
        for acc in self._reads():
            if acc.buffer[0] == "in":
                per_input[acc.buffer[1]].append(acc)
        cuts: list[AxisCut | None] = []
        computed = False
        for i, accesses in enumerate(per_input):
            shape = r.shapes[("in", i)]
            found: list[AxisCut | None] = []
            for acc in accesses:
                related: list[AxisCut | None] = []
                for a, index in enumerate(acc.indices):
                    form = self.resolve(index.form)
                    if form is not None and form.mod and any(v in members for v in form.coeffs):
                        divisor = math.gcd(divisor, _mod_divisor(form, r))
                        continue  # read whole along this axis, chunk-aligned
                    if form is None:
                        computed = computed or self._touches(index, members)
                        continue
                    mine = [v for v in form.coeffs if v in members]
                    if len(mine) == 1:
                        related.append(_axis_cut(form, mine[0], shape[a], r.var_extent, a))
                    elif mine:
                        related.append(None)
                found.append(related[0] if len(related) == 1 else None)
            axes = {c.axis for c in found if c is not None}
            if not found or None in found or len(axes) != 1:
                cuts.append(None)
                # Read whole: a chunk's indices into it must be global, and chunks contiguous.
                computed = computed or any(self._touches(index, members)
                                           for acc in accesses for index in acc.indices)
            else:
                cuts.append(AxisCut(axes.pop(), max(c.halo_lo for c in found),
                                    max(c.halo_hi for c in found)))
        return cuts, divisor, computed


def _plain(form: _Form | None) -> int | None:
    if form is None or form.den != 1 or form.mod or form.const != 0 or len(form.coeffs) != 1:
        return None
    ((v, c),) = form.coeffs.items()
    return v if c == 1 else None


def _mod_divisor(form: _Form, reader: _KernelReader) -> int:
    """`v % m` reads the same rows in every chunk only if chunks are multiples of m."""
    ((v, _),) = form.coeffs.items()
    extent = reader.var_extent[v]
    return extent // form.mod if extent % form.mod == 0 else 1


def kernel_spec(func: tirx.PrimFunc, num_outputs: int, kernel: str = "kernel") -> KernelSpec:
    """The `KernelSpec` of one PrimFunc whose last `num_outputs` buffers are its outputs."""
    if not isinstance(func, tirx.PrimFunc):
        raise TypeError(f"kernel_spec reads a PrimFunc (a call_tir callee), got "
                        f"{type(func).__name__}")
    num_inputs = sum(getattr(p, "shape", None) is not None for p in func.params) - num_outputs
    try:
        reader = _KernelReader(func, num_outputs)
        return _KernelAnalysis(reader, num_outputs, kernel).spec()
    except _Unsupported as err:
        return replicated_spec(kernel, num_inputs, num_outputs, str(err))


@dataclasses.dataclass
class KernelDims:
    """Where each dim of a kernel's `KernelSpec` lives in its TIR: what a pass needs to run the
    kernel on one device's chunk of a dim (see `tvm_ext.passes.partition_operators`).

    Dims are numbered as in `spec.dims`; -1 means no dim (not split by any), -2 a window variable
    (read through `yy + ry`, replaced by its window in the analysis).
    """

    func: tirx.PrimFunc
    spec: KernelSpec
    var_dims: dict  # block iteration Var -> dim
    buffer_dims: dict  # buffer Var (parameter or allocated) -> dim per axis
    window_dims: set[int]  # dims some window variable's window reads (a halo or an offset)
    # Dims whose index is used as a value (padding tests, one-hot) or in the index of an axis it
    # does not cut (a resize reading its input whole): a chunk must be told where it starts. A
    # dim flagged `global_index` but not here only feeds indices through loads of its own piece
    # (`x[i, labels[i]]`).
    value_dims: set[int] = dataclasses.field(default_factory=set)
    # Window variable (block Var) -> its window over the other block Vars, `(coeffs, const)`:
    # `pad_temp`'s row is `2 * yy + ry` (None where the window is not affine).
    windows: dict = dataclasses.field(default_factory=dict)


def kernel_dims(func: tirx.PrimFunc, num_outputs: int, kernel: str = "kernel") -> KernelDims:
    """The `KernelSpec` of a PrimFunc (as `kernel_spec`) and where its dims live in the TIR."""
    spec = kernel_spec(func, num_outputs, kernel)
    if not spec.dims:
        return KernelDims(func, spec, {}, {}, set())
    reader = _KernelReader(func, num_outputs)
    analysis = _KernelAnalysis(reader, num_outputs, kernel)
    analysis.spec()
    uf, derived = analysis.uf, analysis.derived

    def dim_of(v: int) -> int:
        return -2 if v in derived else analysis.dim_index.get(uf.find(v), -1)

    var_dims: dict = {}
    for r_block in _iter_blocks(func):
        for iv in r_block.iter_vars:
            var_dims[iv.var] = -1
    variables = _block_vars(func)
    for v, var in enumerate(variables):
        var_dims[var] = dim_of(v)
    buffer_dims: dict = {}
    for buf, key in reader.keys.items():
        ndim = len(reader.shapes[key])
        if key[0] == "tmp":
            ids = analysis.writer.get(key)
            buffer_dims[buf] = [dim_of(w) for w in ids] if ids else [-1] * ndim
            continue
        axes = [-1] * ndim
        for d, dim in enumerate(spec.dims):
            cut = dim.inputs[key[1]] if key[0] == "in" else dim.outputs[key[1]]
            axis = cut.axis if isinstance(cut, AxisCut) else cut
            if isinstance(axis, int) and not isinstance(axis, bool):
                axes[axis] = d
        buffer_dims[buf] = axes
    window_dims: set[int] = set()
    for w in derived:
        form = analysis.resolve(_Form({w: 1}))
        if form is None:
            window_dims.update(range(len(spec.dims)))
            continue
        window_dims.update(d for u in form.coeffs if (d := dim_of(u)) >= 0)
    value_dims: set[int] = set()
    # A dim's variable in the index of an axis not cut by that dim (an input read whole, a
    # computed or offset index) must take its global value there.
    by_key = {key: buf for buf, key in reader.keys.items()}
    for block in reader.blocks:
        for acc in block.loads:
            axes = buffer_dims[by_key[acc.buffer]]
            for a, index in enumerate(acc.indices):
                for v in index.direct:
                    d = dim_of(v)
                    if d >= 0 and axes[a] != d and axes[a] != -2:
                        value_dims.add(d)
    for block in reader.blocks:
        for v in block.value_vars:
            if v in derived:
                form = analysis.resolve(_Form({v: 1}))
                value_dims.update(range(len(spec.dims)) if form is None else
                                  {d for u in form.coeffs if (d := dim_of(u)) >= 0})
            elif (d := dim_of(v)) >= 0:
                value_dims.add(d)
    windows: dict = {}
    for w in derived:
        form = analysis.resolve(_Form({w: 1}))
        windows[variables[w]] = None if form is None or form.den != 1 or form.mod else (
            {variables[u]: c for u, c in form.coeffs.items()}, form.const)
    return KernelDims(func, spec, var_dims, buffer_dims, window_dims, value_dims, windows)


def _iter_blocks(func: tirx.PrimFunc) -> list:
    realizes: list = []
    tvm_ffi.structural_walk(func.body, [(SBlockRealize, realizes.append)])
    return [r.block for r in realizes if r.block.iter_vars]


def _block_vars(func: tirx.PrimFunc) -> list:
    """Block iteration Vars in the order `_KernelReader` numbers them."""
    return [iv.var for block in _iter_blocks(func) for iv in block.iter_vars]


def reshape_spec(in_shape: Sequence[int], out_shape: Sequence[int], dtype: str = "float32",
                 kernel: str = "relax.reshape") -> KernelSpec:
    """The `KernelSpec` of a reshape view, read from the TIR of the same reshape."""
    data = te.placeholder(tuple(int(s) for s in in_shape), dtype, name="data")
    out = topi.reshape(data, tuple(int(s) for s in out_shape))
    return kernel_spec(te.create_prim_func([data, out]), 1, kernel)


def problem_from_module(mod: tvm.IRModule, graph=None, function: str = "main"):
    """The `PartitionProblem` of a legalized, fused module (see `pipeline.fuse`)."""
    graph = build_graph(mod, function) if graph is None else graph
    specs: dict[str, KernelSpec] = {}
    op_spec: list[str | None] = []
    for op in graph.ops:
        if op.kind == "kernel":
            key = op.kernel
            if key not in specs:
                specs[key] = kernel_spec(mod[key], len(op.outputs), key)
        elif op.kind == "view" and op.kernel == "relax.reshape":
            src, dst = graph.tensors[op.inputs[0]], graph.tensors[op.outputs[0]]
            key = f"reshape{list(src.shape)}->{list(dst.shape)}"
            if key not in specs:
                specs[key] = reshape_spec(src.shape, dst.shape, src.dtype, key)
        else:
            key = None
        op_spec.append(key)
    return PartitionProblem(graph, specs, op_spec)
