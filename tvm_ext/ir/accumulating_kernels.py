"""Kernels that add to their outputs: a reduction run in chunks along the dim it reduces.

A reduction block states its update (`C = C + x`, `max(C, x)`, ...) and its init (`C = 0`).
Run over a chunk of the reduced dim it computes that chunk's part from the init. A reduction
split in time runs chunk 0 so (`local_kernel`) and every later chunk with
`accumulating_kernel`: the same kernel whose init starts from what the output held, read
through a parameter of its own (`C = C_prev`, the caller passing the output as both). The
block stays a reduction with an init, so every schedule (a local accumulator, `rfactor`, GPU
threads) stays valid: each output element's init reads its own previous value before any
write of it. That holds only where each output is written by one block, a reduction whose init
stores into it (`adds_to_outputs`): a kernel that zeroes an output in a block of its own, or
writes it again after the reduction, would undo the earlier chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock

PREV_SUFFIX = "_prev"


def _blocks(func: tirx.PrimFunc) -> list[SBlock]:
    blocks: list = []
    tvm_ffi.structural_walk(func.body, [(SBlock, blocks.append)])
    return blocks


def _writes(block: SBlock, buffer) -> bool:
    return any(region.source.same_as(buffer) for region in block.writes)


def adds_to_outputs(func: tirx.PrimFunc, outputs: Sequence) -> bool:
    """Whether each of `outputs` (buffer parameters of `func`) is written by exactly one block,
    whose init is one store into it."""
    blocks = _blocks(func)
    for out in outputs:
        writers = [b for b in blocks if _writes(b, out)]
        if len(writers) != 1 or not isinstance(writers[0].init, tirx.BufferStore) or \
                not writers[0].init.buffer.same_as(out):
            return False
    return True


def accumulating_kernel(func: tirx.PrimFunc, outputs: Sequence) -> tirx.PrimFunc:
    """`func` (of which `adds_to_outputs(func, outputs)` holds) starting each output element
    from its previous value: one more buffer parameter per output, `<name>_prev`, after the
    other inputs (and scalars) and before the outputs, which the init reads."""
    if not adds_to_outputs(func, outputs):
        raise ValueError("a kernel adds to its outputs only where one block with an init writes "
                         "each of them")
    prev = {}
    for out in outputs:
        ty = out.ty  # the output's layout, under another name
        prev[out] = tirx.decl_buffer(list(ty.shape), ty.dtype, out.name + PREV_SUFFIX,
                                     elem_offset=ty.elem_offset, scope=ty.storage_scope,
                                     data_alignment=ty.data_alignment,
                                     offset_factor=ty.offset_factor, layout=ty.layout)

    def on_block(block, m):
        block = m.default_mutate(block)
        init = block.init
        source = next((p for out, p in prev.items() if _writes(block, out)), None)
        if source is None or init is None:
            return block
        start = tirx.BufferStore(init.buffer, tirx.BufferLoad(source, init.indices),
                                 init.indices)
        reads = [*block.reads, *(tvm.ir.expr.TensorRegion(source, r.region, r.ty)
                                 for r in block.writes if r.source.same_as(init.buffer))]
        return SBlock(block.iter_vars, reads, block.writes, block.name_hint, block.body, start,
                      block.alloc_buffers, block.match_buffers, block.annotations)

    body = tvm_ffi.structural_mutate(func.body, [(SBlock, on_block)])
    n_out = len(outputs)
    params = [*func.params[:len(func.params) - n_out], *(prev[o] for o in outputs),
              *func.params[len(func.params) - n_out:]]
    return tirx.PrimFunc(params, body, func.ret_type, func.attrs)


def output_params(func: tirx.PrimFunc, num_outputs: int) -> list:
    """The last `num_outputs` buffer parameters of `func` (its outputs)."""
    buffers = [p for p in func.params if getattr(p, "shape", None) is not None]
    return buffers[len(buffers) - num_outputs:]
