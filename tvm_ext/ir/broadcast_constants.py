"""Constants stored at their distinct extent: a kernel argument that repeats along some axes
is read at index 0 there, and one that holds a single value becomes a literal in the kernel.

FoldConstant materialises `full`, `ones_like` and broadcasts at their full shape (a training
step's seed gradient of a mean is a (batch, tokens, vocab) tensor of 1/n; an attention mask is
repeated over the batch), and the VM keeps every constant on the device for the whole run. Such
a constant costs device memory and bandwidth for values it repeats. `distinct_extent` finds
the axes along which a constant repeats bit for bit (so -0.0 and 0.0, or two NaNs of other
payloads, are not merged), and `broadcast_param` rewrites a kernel to read a smaller
argument: every load of it takes index 0 along those axes, or, where a single value is left,
the value itself. The kernel computes the same bits; each load reads what it read before.

A parameter that the kernel writes, or uses other than by loads and read regions of blocks
(a pointer to it escaping into an extern call), is not rewritten (`BroadcastError`).
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock

from ..errors import InputError

# Dtypes whose single value becomes a literal in the kernel (numpy and TIR agree on them).
LITERAL_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                  "uint64", "float16", "float32", "float64")


class BroadcastError(InputError):
    """A kernel parameter cannot be read at a smaller extent."""


def distinct_extent(value: np.ndarray) -> np.ndarray:
    """`value` with every axis along which it repeats bit for bit cut to extent 1."""
    bits = _bits(value)
    out = value
    for axis in range(value.ndim):
        if bits.shape[axis] > 1:
            first = np.take(bits, [0], axis=axis)
            if np.array_equal(bits, np.broadcast_to(first, bits.shape)):
                bits = first
                out = np.take(out, [0], axis=axis)
    return np.array(out, order="C")  # (ascontiguousarray would make a 0-d array 1-d)


def _bits(value: np.ndarray) -> np.ndarray:
    """The raw bits of each element, as unsigned integers (equality is bitwise)."""
    size = value.dtype.itemsize
    if value.dtype == np.bool_ or size not in (1, 2, 4, 8):
        return value
    return np.ascontiguousarray(value).view(f"u{size}")


def is_literal(value: np.ndarray) -> bool:
    """Whether a constant of this value is inlined into its kernel as a literal."""
    return value.size == 1 and str(value.dtype) in LITERAL_DTYPES


def broadcast_param(func: tirx.PrimFunc, index: int, value: np.ndarray) -> tirx.PrimFunc:
    """`func` reading its `index`-th parameter (a buffer of `value`'s rank, extent 1 or the
    parameter's own along each axis) at `value.shape`: loads take index 0 along the axes cut
    to 1. Where `is_literal(value)`, the parameter leaves the signature and loads read the
    value."""
    buf = func.params[index]
    old = [int(n) for n in buf.ty.shape]
    if value.ndim != len(old) or any(n not in (1, o) for n, o in zip(value.shape, old,
                                                                      strict=True)):
        raise BroadcastError(f"{buf.name}: cannot read a {list(old)} parameter at "
                             f"{list(value.shape)}")
    if str(value.dtype) != str(buf.ty.dtype):
        raise BroadcastError(f"{buf.name}: a {value.dtype} value for a {buf.ty.dtype} buffer")
    obstacle = _obstacle(func, buf)
    if obstacle:
        raise BroadcastError(f"{buf.name}: {obstacle}")
    cut = [n == 1 and o != 1 for n, o in zip(value.shape, old, strict=True)]
    literal = is_literal(value)
    shape = [tirx.IntImm(str(s.ty), n) for s, n in zip(buf.ty.shape, value.shape, strict=True)]
    small = None if literal else tirx.decl_buffer(shape, buf.ty.dtype, buf.name)

    def on_load(load, m):
        load = m.default_mutate(load)
        if not load.source.same_as(buf):
            return load
        if literal:
            return tirx.const(value.reshape(()).item(), str(value.dtype))
        idx = [tirx.IntImm(str(i.ty), 0) if c else i for i, c in zip(load.indices, cut,
                                                                    strict=True)]
        return tirx.BufferLoad(small, idx)

    def on_block(block, m):
        block = m.default_mutate(block)
        if not any(r.source.same_as(buf) for r in block.reads):
            return block
        reads = []
        for r in block.reads:
            if not r.source.same_as(buf):
                reads.append(r)
            elif not literal:
                region = [tvm.ir.Range.from_min_extent(tirx.IntImm(str(rg.min.ty), 0),
                                                       tirx.IntImm(str(rg.min.ty), 1))
                          if c else rg for rg, c in zip(r.region, cut, strict=True)]
                reads.append(tvm.ir.expr.TensorRegion(small, region, r.ty))
        return SBlock(block.iter_vars, reads, block.writes, block.name_hint, block.body,
                      block.init, block.alloc_buffers, block.match_buffers, block.annotations)

    body = tvm_ffi.structural_mutate(func.body, [(tvm.ir.TensorLoad, on_load),
                                                 (SBlock, on_block)])
    params = list(func.params)
    if literal:
        del params[index]
    else:
        params[index] = small
    return tirx.PrimFunc(params, body, func.ret_type, func.attrs)


def _obstacle(func: tirx.PrimFunc, buf) -> str | None:
    """Why `buf` cannot be read at a smaller extent: written, or used other than by loads and
    the read regions of blocks."""
    counts = {"var": 0, "known": 0, "written": False}

    def count_var(v):
        if v.same_as(buf):
            counts["var"] += 1

    def known(source):
        if source.same_as(buf):
            counts["known"] += 1

    def store(x):
        if x.buffer.same_as(buf):
            counts["written"] = True

    def block(b):
        if any(r.source.same_as(buf) for r in b.writes):
            counts["written"] = True

    tvm_ffi.structural_walk(func.body, [
        (tvm.ir.TensorLoad, lambda x: known(x.source)),
        (tvm.ir.expr.TensorRegion, lambda x: known(x.source)),
        (tirx.BufferStore, store), (SBlock, block), (tvm.ir.expr.Var, count_var)])
    if counts["written"]:
        return "the kernel writes it"
    if counts["var"] != counts["known"]:
        return "the kernel uses it other than by loads (a pointer to it escapes)"
    return None
