"""GPU schedules for kernels that update an argument in place (an optimizer step's updates).

TVM's schedule primitives bind GPU threads only to blocks whose reads and writes do not
overlap, and an update kernel's writer reads the element it overwrites (`p = p - lr * g`
in `p`'s own buffer, made so by `tvm_ext.ir.inplace_kernels`). `schedule_in_place`
schedules such a kernel as if it were out of place: the old values that the writer and the
blocks before it read come from a parameter of their own, a schedule rule schedules that
kernel, and the result is checked with the proof that made the kernel in place
(`inplace_obstacle`: every old value is read before it is overwritten, in the writer's own
iteration or in a loop nest that finishes first; after scheduling, a loop nest is a GPU
kernel and kernels run in order). Only then does that parameter become the argument again.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from tvm_ext.ir.inplace_kernels import block_accesses, inplace_obstacle, leaf_blocks


def in_place_buffers(func: tirx.PrimFunc) -> list:
    """The parameters `func` overwrites after reading them: stored by one leaf block without an
    init (a reduction's init makes its reads of its output its own partial results) that, or
    a block before it, also loads them."""
    if not isinstance(func.body, s_tir.SBlockRealize):
        return []
    leaves = [b for _, b in leaf_blocks(func)]
    found = []
    for param in func.params:
        writers = [i for i, b in enumerate(leaves) if block_accesses(b, param)[1]]
        if len(writers) == 1 and leaves[writers[0]].init is None and any(
                block_accesses(b, param)[0] for b in leaves[:writers[0] + 1]):
            found.append(param)
    return found


def schedule_in_place(func: tirx.PrimFunc,
                      schedule: Callable[[tirx.PrimFunc], tirx.PrimFunc | None]
                      ) -> tirx.PrimFunc | None:
    """`func` scheduled by `schedule` as an out-of-place kernel and checked (see the module
    docstring); None when `func` updates nothing in place, the rule gives nothing, or its
    schedule reads an old value after it may be overwritten."""
    buffers = in_place_buffers(func)
    if not buffers:
        return None
    split, olds = _old_values_apart(func, buffers)
    scheduled = schedule(split)
    if scheduled is None or any(inplace_obstacle(scheduled, old, new) is not None
                                for new, old in olds.items()):
        return None
    return _old_values_in_place(scheduled, olds)


def _old_values_apart(func: tirx.PrimFunc, buffers: list) -> tuple[tirx.PrimFunc, dict]:
    """`func` with the loads of each of `buffers` in its writer and the blocks before it read
    from a new parameter (the old values), and {buffer: that parameter}."""
    leaves = [b for _, b in leaf_blocks(func)]
    olds, readers = {}, {}
    for buf in buffers:
        olds[buf] = tvm.ir.expr.Var(f"{buf.name}_old", buf.ty)
        writer = next(i for i, b in enumerate(leaves) if block_accesses(b, buf)[1])
        for block in leaves[:writer + 1]:
            readers.setdefault(block, []).append(buf)

    def on_block(block, m):
        moved = {buf: olds[buf] for buf in readers.get(block, [])}
        if not moved:
            return m.default_mutate(block)
        body = _loads_from(block.body, moved)
        reads = [tirx.BufferRegion(moved.get(r.source, r.source), r.region) for r in block.reads]
        return s_tir.SBlock(block.iter_vars, reads, block.writes, block.name_hint, body,
                            block.init, block.alloc_buffers, block.match_buffers,
                            block.annotations)

    body = tvm_ffi.structural_mutate(func.body, [(s_tir.SBlock, on_block)])
    split = tirx.PrimFunc([*func.params, *olds.values()], body, func.ret_type, func.attrs)
    return split, olds


def _loads_from(stmt, moved: dict):
    """`stmt` with its loads of each key of `moved` reading the value's buffer instead."""
    def on_load(load, m):
        source = moved.get(load.source)
        indices = [m.mutate(i) for i in load.indices]
        return tirx.BufferLoad(source if source is not None else load.source, indices)

    return tvm_ffi.structural_mutate(stmt, [(tvm.ir.TensorLoad, on_load)])


def _old_values_in_place(func: tirx.PrimFunc, olds: dict) -> tirx.PrimFunc:
    """`func` with each old-value parameter replaced by the buffer it was split from."""
    def on_func(f, m):
        for new, old in olds.items():
            m.var_remap_set(old, new)
        return m.default_mutate(f)

    body = tvm_ffi.structural_mutate(func, [(tirx.PrimFunc, on_func)]).body
    params = [p for p in func.params if not any(p.same_as(o) for o in olds.values())]
    return tirx.PrimFunc(params, body, func.ret_type, func.attrs)
