"""Kernels that write an output into the buffer of one of their arguments (in-place updates).

A kernel in destination-passing form takes its arguments, then its outputs. `inplace_kernel`
returns the same kernel with some outputs written into argument buffers: the output's buffer
variable becomes the argument's (and leaves the signature), or, for an argument the kernel does
not read, moves into the argument list (the caller passes the buffer to overwrite there). TVM's
`R.call_tir_inplace` calls such a kernel, and so does a destination-passing call that passes the
argument and omits the output.

Writing an output over an argument the kernel reads is exact only if no element is read after it
is written. `inplace_obstacle` proves it on the kernel's TIR or says why it cannot: the output
is stored by exactly one block, a spatial one whose store and every load of the argument in it
are at one index, made of the block's own variables (each iteration reads and writes the one
element it owns); blocks before it may read the argument anywhere if they finish first (a
different loop nest), blocks after it may not read it at all; and the argument appears nowhere
else (no pointer to it escapes). Kernels are checked as fusion leaves them, before scheduling
(each block in its own loop nest); the schedules after see the in-place buffer and keep its
order.
"""

from __future__ import annotations

from collections.abc import Mapping

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir import SBlock

from ..errors import InputError


class InPlaceError(InputError):
    """A kernel cannot be made to write an output over one of its arguments."""


def leaf_blocks(func: tirx.PrimFunc) -> list[tuple[int, SBlock]]:
    """(index of the root's top-level statement holding it, block) for every block without
    nested blocks, in program order."""
    root = func.body.block
    body = root.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    out = []
    for k, stmt in enumerate(stmts):
        blocks: list = []
        tvm_ffi.structural_walk(stmt, [(SBlock, blocks.append)])
        for block in blocks:
            nested: list = []
            tvm_ffi.structural_walk(block.body, [(SBlock, nested.append)])
            if not nested:
                out.append((k, block))
    return out


def block_accesses(block: SBlock, buf) -> tuple[list, list]:
    """(indices of each load of `buf`, indices of each store into `buf`) in a block."""
    loads: list = []
    stores: list = []
    tvm_ffi.structural_walk(block.body, [
        (tvm.ir.TensorLoad, lambda x: loads.append(list(x.indices)) if x.source.same_as(buf)
         else None),
        (tirx.BufferStore, lambda x: stores.append(list(x.indices)) if x.buffer.same_as(buf)
         else None)])
    return loads, stores


def _escapes(func: tirx.PrimFunc, buf) -> bool:
    """Whether `buf` is used other than by loads, stores and read/write regions of blocks."""
    counts = {"var": 0, "known": 0}

    def count_var(v):
        if v.same_as(buf):
            counts["var"] += 1

    def known(x, source):
        if source.same_as(buf):
            counts["known"] += 1

    tvm_ffi.structural_walk(func.body, [
        (tvm.ir.TensorLoad, lambda x: known(x, x.source)),
        (tirx.BufferStore, lambda x: known(x, x.buffer)),
        (tvm.ir.expr.TensorRegion, lambda x: known(x, x.source)),
        (tvm.ir.expr.Var, count_var)])
    return counts["var"] != counts["known"]


def _own_element(block: SBlock, indices: list, shape) -> bool:
    """Whether `indices` pick a different element of a buffer of `shape` in every iteration of
    the block: each index one of the block's spatial variables, every variable of extent
    above 1 exactly once, or 0 on an axis of extent 1 (schedules drop unit variables: a
    [512, 128, 1, 1] update is indexed [v0, v1, 0, 0]; a scalar has no index)."""
    ivs = list(block.iter_vars)
    if any(int(iv.iter_type) != 0 for iv in ivs):  # 0: data parallel
        return False
    used = []
    for index, extent in zip(indices, shape, strict=True):
        if _is_int(index, 0) and _is_int(extent, 1):
            continue
        var = next((iv.var for iv in ivs if index.same_as(iv.var)), None)
        if var is None or any(var.same_as(u) for u in used):
            return False
        used.append(var)
    return all(any(iv.var.same_as(u) for u in used) or _is_int(iv.dom.extent, 1)
               for iv in ivs)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.same_as(y) or (_is_int(x, 0) and _is_int(y, 0))
                                    for x, y in zip(a, b, strict=True))


def _is_int(x, value: int) -> bool:
    return isinstance(x, tirx.IntImm) and int(x.value) == value


def inplace_obstacle(func: tirx.PrimFunc, arg, out) -> str | None:
    """Why the kernel cannot write buffer `out` over buffer `arg` (None: it can; see the module
    docstring)."""
    if _escapes(func, arg) or _escapes(func, out):
        return "the buffer is used other than by loads and stores of blocks"
    leaves = leaf_blocks(func)
    writers = [(k, b) for k, b in leaves if block_accesses(b, out)[1]]
    if len(writers) != 1:
        return f"the output is written by {len(writers)} blocks, not one"
    w_stmt, writer = writers[0]
    loads, stores = block_accesses(writer, arg)[0], block_accesses(writer, out)[1]
    accesses = [*stores, *loads]
    if not all(_own_element(writer, ix, out.ty.shape) for ix in accesses) or \
            any(not _same(ix, accesses[0]) for ix in accesses):
        return (f"block {writer.name_hint} does not read and write each element at its own "
                "position (a reduction, a broadcast or a shifted index)")
    seen_writer = False
    for k, block in leaves:
        if block.same_as(writer):
            seen_writer = True
            continue
        if not block_accesses(block, arg)[0]:
            continue
        if seen_writer:
            return f"block {block.name_hint} reads the argument after it is overwritten"
        if k == w_stmt:
            return f"block {block.name_hint} reads the argument in the writer's loop nest"
    return None


def inplace_kernel(func: tirx.PrimFunc, num_args: int,
                   writes: Mapping[int, int | None]) -> tirx.PrimFunc:
    """`func` (arguments, then outputs) with output `j` written over argument `writes[j]`, or,
    where `writes[j]` is None, into a buffer passed after the arguments (in output order).
    Parameters: the arguments, those passed buffers, then the other outputs. Raises
    `InPlaceError` where an output cannot overwrite an argument the kernel reads."""
    params = list(func.params)
    args, outs = params[:num_args], params[num_args:]
    remap = {}
    for j, i in writes.items():
        if i is None:
            continue
        problem = inplace_obstacle(func, args[i], outs[j])
        if problem is not None:
            raise InPlaceError(f"cannot write output {j} of the kernel over its argument "
                               f"{i}: {problem}")
        remap[outs[j]] = args[i]

    def on_func(f, m):
        for old, new in remap.items():
            m.var_remap_set(old, new)
        return m.default_mutate(f)

    body = tvm_ffi.structural_mutate(func, [(tirx.PrimFunc, on_func)]).body if remap \
        else func.body
    passed = [outs[j] for j in sorted(writes) if writes[j] is None]
    rest = [o for j, o in enumerate(outs) if j not in writes]
    kernel = tirx.PrimFunc([*args, *passed, *rest], body, func.ret_type, func.attrs)
    # Fresh buffers and variables: the kernel it came from may stay in the module.
    return s_tir.renew_defs(kernel)


def drop_unused(mod: tvm.IRModule, kernels: list) -> tvm.IRModule:
    """`mod` without those of `kernels` (GlobalVars) that no Relax function calls any more:
    the kernels an in-place form replaced."""
    used: set = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func, [(tvm.ir.GlobalVar, lambda gv: used.add(
                gv.name_hint))])
    for name in dict.fromkeys(gv.name_hint for gv in kernels):
        if name not in used:
            del mod[name]
    return mod
