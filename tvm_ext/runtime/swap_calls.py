"""The Relax calls a swap pass emits (see `swap_streams` for the calling convention and the
runtime side). Built with the TVMScript builders, so that they equal hand-written calls exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import relax
from tvm.script import relax as R

from .swap_streams import (
    ALL_STREAMS,
    COPY_ASYNC,
    COPY_CHUNK_ASYNC,
    COPY_WINDOW_ASYNC,
    HOST_EMPTY,
    HOST_STORAGE,
    WAIT,
    WAIT_ALL,
)


def copy_async_call(src: relax.Expr, dst: relax.Expr, stream: int, name: str) -> relax.Call:
    """`R.call_packed("tvm_ext.swap.copy_async", src, dst, stream, name)`: swap-out or -in."""
    return R.call_packed(
        COPY_ASYNC, src, dst, R.prim_value(int(stream)), R.str(name), ty_args=R.Tuple([])
    )


def copy_chunk_async_call(whole: relax.Expr, chunk: relax.Expr, stream: int, axis: int,
                          index: int, to_chunk: bool, name: str) -> relax.Call:
    """`R.call_packed("tvm_ext.swap.copy_chunk_async", whole, chunk, stream, axis, index,
    to_chunk, name)`: a split op's chunk in (`to_chunk`) or out."""
    return R.call_packed(
        COPY_CHUNK_ASYNC, whole, chunk, R.prim_value(int(stream)), R.prim_value(int(axis)),
        R.prim_value(int(index)), R.prim_value(int(bool(to_chunk))), R.str(name),
        ty_args=R.Tuple([])
    )


def copy_window_async_call(whole: relax.Expr, chunk: relax.Expr, stream: int, axis: int,
                           start: int, name: str) -> relax.Call:
    """`R.call_packed("tvm_ext.swap.copy_window_async", whole, chunk, stream, axis, start,
    name)`: a split op's chunk input range, halo rows included, in."""
    return R.call_packed(
        COPY_WINDOW_ASYNC, whole, chunk, R.prim_value(int(stream)), R.prim_value(int(axis)),
        R.prim_value(int(start)), R.str(name), ty_args=R.Tuple([])
    )


def wait_call(tensor: relax.Expr, stream: int) -> relax.Call:
    """`R.call_packed("tvm_ext.swap.wait", tensor, stream)`: before `tensor`'s memory is reused
    (swap-out) or read (swap-in). Passing the tensor also keeps it alive until here."""
    return R.call_packed(WAIT, tensor, R.prim_value(int(stream)), ty_args=R.Tuple([]))


def wait_all_call(stream: int = ALL_STREAMS) -> relax.Call:
    """`R.call_packed("tvm_ext.swap.wait_all", stream)`: before the function returns."""
    return R.call_packed(WAIT_ALL, R.prim_value(int(stream)), ty_args=R.Tuple([]))


def host_storage_call(nbytes: int, host_index: int, device_index: int) -> relax.Call:
    """A host pool of `nbytes` for tensors swapped out of VM device `device_index` (pinned when
    that device is CUDA); place tensors in it with `R.memory.alloc_tensor`."""
    args = (R.shape([int(nbytes)]), R.prim_value(int(host_index)), R.prim_value(int(device_index)))
    return R.call_builtin_with_ctx(HOST_STORAGE, args, ty_args=R.Object)


def host_empty_call(
    shape: Sequence[int], dtype: str, host_index: int, device_index: int
) -> relax.Call:
    """One host tensor for a tensor swapped out of VM device `device_index`."""
    dims = [int(s) for s in shape]
    args = (
        R.shape(dims),
        R.dtype(dtype),
        R.prim_value(int(host_index)),
        R.prim_value(int(device_index)),
    )
    return R.call_builtin_with_ctx(HOST_EMPTY, args, ty_args=R.Tensor(dims, dtype))
