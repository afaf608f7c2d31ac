"""Per-kernel equivalence of partitioned execution: for a fused kernel and a split of its dims,
each device's local kernel (`tvm_ext.ir.local_kernels.local_kernel`, cut into parts with the
allreduces between them where a reduction is read again) run on its chunk of the inputs must
give the chunk of the global kernel's outputs (or a partial result whose combination is the
global output). Numpy plays the collectives. Used by tests/test_kernel_chunks.py on every
distinct kernel of the corpus."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import tvm
from one_op import one_op_module
from tvm import relax, tirx

from tvm_ext.ir.halo_chunks import chunk_rows
from tvm_ext.ir.kernel_dims import KernelDims, kernel_dims
from tvm_ext.ir.local_kernels import (
    KernelPart,
    chunk_params,
    has_halo,
    inner_blocks,
    local_kernel,
    lowering_obstacle,
    split_kernel,
)
from tvm_ext.partition.spec import AxisCut

LLVM = tvm.target.Target("llvm")
_COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


@dataclasses.dataclass
class ChunkCheck:
    kernel: str
    factors: dict  # dim name -> parts
    error: str | None  # None: every chunk equals the global kernel's


def fused_kernel(build, *shapes) -> KernelDims:
    """The analysis of the one fused PrimFunc of `build(*params)` (float32 parameters of
    `shapes`) after LegalizeOps + fusion."""
    mod = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()])(one_op_module(build, *shapes))
    (gv,) = [gv for gv in mod.functions if isinstance(mod[gv], tirx.PrimFunc)]
    return kernel_dims(mod[gv], 1, gv.name_hint)


def _compile(func: tirx.PrimFunc):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), LLVM)


def _buffers(func: tirx.PrimFunc) -> list:
    return [p for p in func.params if getattr(p, "shape", None) is not None]


def _random(shape, dtype: str, rng: np.random.Generator) -> np.ndarray:
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.startswith(("int", "uint")):
        return np.asarray(rng.integers(0, 2, size=shape), dtype=dtype)  # valid gather indices
    return np.asarray(rng.standard_normal(shape), dtype=dtype)


def _call(rt, args: Sequence[np.ndarray], scalars: Sequence[int], out_params) -> list:
    outs = [tvm.runtime.empty([int(s) for s in p.shape], str(p.dtype)) for p in out_params]
    rt["main"](*[tvm.runtime.tensor(np.array(a, order="C")) for a in args], *scalars, *outs)
    return [o.numpy() for o in outs]


def _chunk(array: np.ndarray, axis: int, index: int, parts: int, _cut=None) -> np.ndarray:
    size = array.shape[axis] // parts
    return np.take(array, range(index * size, (index + 1) * size), axis=axis)


def _window(array: np.ndarray, axis: int, index: int, parts: int, cut: AxisCut) -> np.ndarray:
    """Chunk `index`'s input range along a windowed axis, halo rows included; rows outside the
    array hold NaN (a kernel that read them would show it)."""
    n = array.shape[axis]
    rows = chunk_rows(n, parts, cut.halo_lo, cut.halo_hi)
    start = index * (n // parts) - cut.halo_lo
    out = np.full([*array.shape[:axis], rows, *array.shape[axis + 1:]], np.nan, array.dtype) \
        if array.dtype.kind == "f" else np.zeros([*array.shape[:axis], rows,
                                                  *array.shape[axis + 1:]], array.dtype)
    lo, hi = max(start, 0), min(start + rows, n)
    dst = [slice(None)] * array.ndim
    src = [slice(None)] * array.ndim
    dst[axis], src[axis] = slice(lo - start, hi - start), slice(lo, hi)
    out[tuple(dst)] = array[tuple(src)]
    return out


def global_run(kd: KernelDims, seed: int = 0) -> tuple[list, list]:
    """Random inputs of the kernel of `kd` and its outputs on them, run whole."""
    rng = np.random.default_rng(seed)
    params = _buffers(kd.func)
    inputs = [_random([int(s) for s in p.shape], str(p.dtype), rng)
              for p in params[:kd.spec.num_inputs]]
    return inputs, _call(_compile(kd.func), inputs, [], params[kd.spec.num_inputs:])


def check_split(kd: KernelDims, factors: dict[int, int], run: tuple[list, list] | None = None,
                kernel: str = "kernel") -> ChunkCheck:
    """Split the kernel of `kd` by `factors` (dim index -> parts) and run it chunk by chunk on
    the inputs of `run` (`global_run`: computed here if not given)."""
    func, num_outputs = kd.func, kd.spec.num_outputs
    dims = kd.spec.dims
    names = {dims[d].name: f for d, f in factors.items()}
    inputs, expected = run if run is not None else global_run(kd)
    cuts = inner_blocks(kd, list(factors))
    parts = split_kernel(func, num_outputs, cuts) if cuts else [KernelPart(
        func, [("in", i) for i in range(kd.spec.num_inputs)],
        [("out", i) for i in range(num_outputs)])]
    inner: dict[str, tuple[str, set[int]]] = {}  # block -> combiner, dims reduced over
    for d in factors:
        for r in dims[d].inner:
            combiner, over = inner.setdefault(r.buffer.split(":")[0], (r.combiner, set()))
            over.add(d)
    order = sorted(factors)
    chunks = list(itertools.product(*(range(factors[d]) for d in order)))

    def groups(over: set[int]) -> list[list[int]]:
        """Chunks that differ only in the dims of `over`: one collective's group."""
        out: dict[tuple, list[int]] = {}
        for c, idx in enumerate(chunks):
            key = tuple(i for d, i in zip(order, idx, strict=True) if d not in over)
            out.setdefault(key, []).append(c)
        return list(out.values())

    def combine(name: str, arrays: list[np.ndarray]) -> np.ndarray:
        total = arrays[0]
        for a in arrays[1:]:
            total = _COMBINE[name](total, a)
        return total

    values: list[dict] = [{("in", i): x for i, x in enumerate(inputs)} for _ in chunks]
    halo = any(has_halo(kd, d) for d in factors)
    for d, f in factors.items():  # inputs cut by a split dim: each device holds its chunk
        for i, cut in enumerate(dims[d].inputs):
            if isinstance(cut, AxisCut):
                for c, idx in enumerate(chunks):
                    take = _window if cut.halo else _chunk
                    values[c][("in", i)] = take(values[c][("in", i)], cut.axis,
                                                idx[order.index(d)], f, cut)
    for part in parts:
        local = local_kernel(kd, factors, func=part.func, num_outputs=len(part.outputs),
                             halo=halo)
        rt = _compile(local)
        out_params = _buffers(local)[len(part.inputs):]
        results = []
        for c, idx in enumerate(chunks):
            scalars = [idx[order.index(d)] for d in chunk_params(local)]
            results.append(_call(rt, [values[c][k] for k in part.inputs], scalars, out_params))
        for j, key in enumerate(part.outputs):
            for c in range(len(chunks)):
                values[c][key] = results[c][j]
            if key[0] == "tmp" and part.writers.get(key) in inner:
                # The allreduce the pass inserts between the parts.
                combiner, over = inner[part.writers[key]]
                for group in groups(over):
                    total = combine(combiner, [results[c][j] for c in group])
                    for c in group:
                        values[c][key] = total
    for o in range(num_outputs):
        partial = {d: out for d in order
                   if isinstance(out := dims[d].outputs[o], str)}
        for group in groups(set(partial)):
            idx = chunks[group[0]]
            piece = expected[o]
            for d in order:
                out = dims[d].outputs[o]
                if isinstance(out, int) and not isinstance(out, bool):
                    piece = _chunk(piece, out, idx[order.index(d)], factors[d])
            got = [values[c][("out", o)] for c in group]
            if partial:  # partial results over reduced dims: combined they give the output
                if len(set(partial.values())) > 1:
                    return ChunkCheck(kernel, names, f"output {o}: two combiners")
                got = [combine(next(iter(partial.values())), got)]
            for g in got:
                if err := _mismatch(g, piece):
                    return ChunkCheck(kernel, names, f"output {o} chunk {idx}: {err}")
    return ChunkCheck(kernel, names, None)


def _mismatch(got: np.ndarray, want: np.ndarray) -> str | None:
    if got.shape != want.shape:
        return f"shape {got.shape} vs {want.shape}"
    if want.dtype.kind in "fc":
        bad = ~np.isclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
    else:
        bad = got != want
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        return f"{int(bad.sum())} of {bad.size} elements differ, first at {first}"
    return None


def lowerable_splits(kd: KernelDims, parts: int = 2,
                     pairs: bool = True, halo: bool = False) -> list[dict[int, int]]:
    """Every single dim (and pair of dims, each cut in `parts`) the lowering accepts; with
    `halo`, the single dims read through windows (what only a split in time runs)."""
    if halo:
        return [{d: parts} for d, dim in enumerate(kd.spec.dims)
                if dim.splits(parts) and has_halo(kd, d) and
                lowering_obstacle(kd, d, allow_halo=True) is None]
    ok = [d for d, dim in enumerate(kd.spec.dims)
          if dim.splits(parts) and lowering_obstacle(kd, d) is None]
    out = [{d: parts} for d in ok]
    if pairs:
        out += [{a: parts, b: parts} for a, b in itertools.combinations(ok, 2)]
    return out
