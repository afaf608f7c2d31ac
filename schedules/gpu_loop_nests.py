"""GPU threads for kernels written as plain loop nests, which no schedule rule reads.

Some kernels are not made of schedulable blocks: TVM legalizes an embedding's gradient
(`relax.grad.take_backward`) into one opaque block holding two serial loops, a zero fill of
the table's gradient and a scatter-add of every position's gradient row into it
(`out[idx[i], d] += grad[i, d]`). `parallel_loop_nests` runs each such loop nest over GPU
threads, one thread per iteration of the fused nest, when its iterations can run in any order:

- a nest whose only statement stores a value that reads no buffer the nest writes, at indices
  that are a bijection of the loop variables (`detect_iter_map`), or a constant anywhere: no
  two iterations touch the same element, or they write the same value;
- a nest of loops all marked `parallel` whose only statement stores a value that reads no
  buffer the nest writes, at any indices that read none either: the kernel's author
  declared its iterations free of order (TVM legalizes `index_put` into such a scatter, as
  PyTorch leaves which of two writes to one element wins undefined, and its CPU build runs
  those loops in parallel);
- a nest whose only statement adds a value to an element of a buffer it reads nowhere else
  (`B[I] = B[I] + e`): an accumulation, whose iterations commute up to float rounding. On
  CUDA the add becomes `atomicAdd` (so the sum's rounding order varies from run to run, as
  PyTorch's own scatter-adds do).

Anything else (a recurrence, a read of what another iteration writes) is refused: the caller
keeps another schedule. The nests keep their order: each is a GPU kernel of its own.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.iter_affine_map import IterMapLevel

THREADS = 256
# Element types CUDA's atomicAdd takes, with the compute capability each needs.
_ATOMIC_ADD_ARCH = {"float32": 20, "float64": 60, "int32": 20, "uint32": 20, "uint64": 20,
                    "float16": 70, "bfloat16": 80}


def parallel_loop_nests(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """`func` with every top-level loop nest (inside opaque blocks too) over GPU threads, or
    None when some nest's iterations cannot run in any order (see the module docstring)."""
    body = func.body
    root = body.block if isinstance(body, s_tir.SBlockRealize) else None
    allocs = list(root.alloc_buffers) if root is not None else []
    stmts = _flatten(root.body if root is not None else body, allocs)
    if not stmts:
        return None
    nests = [_parallel_nest(stmt, target) for stmt in stmts]
    if any(n is None for n in nests):
        return None
    seq = nests[0] if len(nests) == 1 else tirx.SeqStmt(nests)
    new_root = s_tir.SBlock([], [], [], "root", seq, alloc_buffers=allocs)
    return func.with_body(s_tir.SBlockRealize([], True, new_root))


def _flatten(stmt, allocs: list) -> list | None:
    """The loop nests and single statements of `stmt` in order, through sequences, pragmas
    and opaque blocks (which have no variables: nothing binds them); None for anything
    else."""
    if isinstance(stmt, tirx.SeqStmt):
        out: list = []
        for child in stmt.seq:
            part = _flatten(child, allocs)
            if part is None:
                return None
            out += part
        return out
    if isinstance(stmt, s_tir.SBlockRealize):
        block = stmt.block
        if block.iter_vars or block.init is not None or block.match_buffers:
            return None
        allocs.extend(block.alloc_buffers)
        return _flatten(block.body, allocs)
    if isinstance(stmt, tirx.AttrStmt) and str(stmt.attr_key).startswith("pragma_"):
        return _flatten(stmt.body, allocs)
    if isinstance(stmt, tirx.For | tirx.BufferStore):
        return [stmt]
    return None


def _parallel_nest(stmt, target) -> tirx.Stmt | None:
    loops = []
    while isinstance(stmt, tirx.For):
        if stmt.kind not in (tirx.ForKind.SERIAL, tirx.ForKind.PARALLEL) \
                or not isinstance(stmt.extent, tirx.IntImm) \
                or not isinstance(stmt.min, tirx.IntImm) or int(stmt.min.value) != 0:
            return None
        loops.append(stmt)
        stmt = stmt.body
    if not isinstance(stmt, tirx.BufferStore):
        return None
    stmt = _simplified(stmt, loops)
    body = _independent_store(stmt, loops) or _declared_parallel(stmt, loops) or \
        _atomic_accumulate(stmt, target)
    if body is None:
        return None
    return _over_threads(body, _contiguous_last(stmt, loops))


def _simplified(store: tirx.BufferStore, loops: list) -> tirx.BufferStore:
    """The store with its indices and value simplified over the loops' ranges (TVM's
    legalizations index through flattened offsets: `(v // 768 * 768 + d) % 768` is `d`)."""
    analyzer = tvm.sym.Analyzer()
    for lp in loops:
        analyzer.bind(lp.loop_var, tvm.ir.Range.from_min_extent(lp.min, lp.extent))
    return tvm_ffi.structural_mutate(store, [
        (tvm.ir.TensorLoad, lambda x, m: tirx.BufferLoad(
            x.source, [analyzer.simplify(i) for i in x.indices])),
        (tirx.BufferStore, lambda x, m: tirx.BufferStore(
            x.buffer, m.mutate(x.value), [analyzer.simplify(i) for i in x.indices]))])


def _contiguous_last(store: tirx.BufferStore, loops: list) -> list:
    """The loops reordered so that the one indexing the store's last axis runs innermost:
    neighbouring threads then touch neighbouring elements (coalesced). Any order is legal: the
    iterations are independent or commute."""
    last = store.indices[-1] if len(store.indices) else None
    inner = [lp for lp in loops if last is not None and last.same_as(lp.loop_var)]
    return [lp for lp in loops if lp not in inner] + inner


def _loads(expr, buffer) -> list:
    found: list = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.TensorLoad, lambda x: found.append(x)
                                    if x.source.same_as(buffer) else None)])
    return found


def _independent_store(store: tirx.BufferStore, loops: list) -> tirx.Stmt | None:
    """The store itself when its iterations are independent: a single iteration, a constant,
    or a value that reads nothing the nest writes at indices that are a bijection of the loop
    variables."""
    if not loops or isinstance(store.value, tirx.IntImm | tirx.FloatImm):
        return store
    if _loads(store.value, store.buffer):
        return None
    iters = {lp.loop_var: tvm.ir.Range.from_min_extent(lp.min, lp.extent) for lp in loops}
    mapped = tvm.sym.detect_iter_map(list(store.indices), iters,
                                     check_level=IterMapLevel.Bijective)
    return store if len(mapped.indices) else None


def _declared_parallel(store: tirx.BufferStore, loops: list) -> tirx.Stmt | None:
    """The store itself when every loop is marked parallel and neither its value nor its
    indices read what the nest writes (see the module docstring)."""
    if loops and all(lp.kind == tirx.ForKind.PARALLEL for lp in loops) \
            and not any(_loads(e, store.buffer) for e in [store.value, *store.indices]):
        return store
    return None


def _atomic_accumulate(store: tirx.BufferStore, target) -> tirx.Stmt | None:
    """`B[I] = B[I] + e` (e not reading B) as an atomic add of e at B[I], on CUDA."""
    value, buffer = store.value, store.buffer
    if not isinstance(value, tirx.Add) or target.kind.name != "cuda":
        return None
    dtype = str(buffer.ty.dtype) if hasattr(buffer.ty, "dtype") else str(value.ty)
    if _ATOMIC_ADD_ARCH.get(dtype, math.inf) > _arch(target):
        return None
    for acc, addend in ((value.a, value.b), (value.b, value.a)):
        if isinstance(acc, tvm.ir.TensorLoad) and acc.source.same_as(buffer) \
                and _same_indices(acc.indices, store.indices) and not _loads(addend, buffer):
            address = tirx.address_of(tirx.BufferLoad(buffer, list(store.indices)))
            return tirx.Evaluate(tirx.call_intrin(addend.ty, "tirx.cuda.atomic_add", address,
                                                  addend))
    return None


def _same_indices(a, b) -> bool:
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b,
                                                                                 strict=True))


def _arch(target) -> int:
    arch = str(target.attrs.get("arch", "sm_50")) if target.attrs is not None else "sm_50"
    digits = "".join(c for c in arch if c.isdigit())
    return int(digits) if digits else 50


def _over_threads(body: tirx.Stmt, loops: list) -> tirx.Stmt:
    """`body` under blockIdx.x x threadIdx.x covering the iterations of `loops` (outermost
    first), one per thread."""
    if not loops:
        loops_dtype, total = "int32", 1
    else:
        loops_dtype, total = str(loops[0].loop_var.ty), math.prod(int(lp.extent) for lp in
                                                                    loops)
    threads = min(THREADS, total)
    blocks = -(-total // threads)

    def const(x: int):
        return tirx.IntImm(loops_dtype, x)

    bx, tx = tirx.Var("bx", loops_dtype), tirx.Var("tx", loops_dtype)
    flat = bx * const(threads) + tx
    values, inner = {}, 1
    for lp in reversed(loops):
        extent = int(lp.extent)
        values[lp.loop_var] = flat // const(inner) if inner * extent == total \
            else (flat // const(inner)) % const(extent)
        inner *= extent
    body = _substitute(body, values)
    if blocks * threads != total:
        body = tirx.IfThenElse(flat < const(total), body, None)
    for var, extent, tag in ((tx, threads, "threadIdx.x"), (bx, blocks, "blockIdx.x")):
        binding = tirx.IterVar(tvm.ir.Range.from_min_extent(const(0), const(extent)),
                               tirx.Var("iter", loops_dtype), tirx.IterVar.ThreadIndex, tag)
        body = tirx.For(var, const(0), const(extent), tirx.ForKind.THREAD_BINDING, body,
                        thread_binding=binding)
    return body


def _substitute(stmt, values: dict):
    return tvm_ffi.structural_mutate(stmt, [(tvm.ir.expr.Var, lambda v, m: values.get(v, v))])
