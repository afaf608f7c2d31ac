"""thread_work: the serial loop iterations one GPU thread runs, read from scheduled TIR."""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

from tvm_ext.schedules.thread_work import kernel_thread_work, serial_iterations


@T.prim_func(s_tir=True)
def _one_thread(A: T.Buffer((64, 32), "float32"), B: T.Buffer((64,), "float32")):
    for _u in T.thread_binding(1, thread="blockIdx.x"):
        for _t in T.thread_binding(1, thread="threadIdx.x"):
            for i, k in T.grid(64, 32):
                with T.sblock("sum"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    with T.init():
                        B[vi] = T.float32(0)
                    B[vi] = B[vi] + A[vi, vk]


@T.prim_func(s_tir=True)
def _threads(A: T.Buffer((64, 32), "float32"), B: T.Buffer((64, 4), "float32")):
    for i in T.thread_binding(64, thread="blockIdx.x"):
        for k0 in T.thread_binding(8, thread="threadIdx.x"):
            for k1 in range(4):
                for v in T.vectorized(4):
                    with T.sblock("sum"):
                        vi, vv = T.axis.remap("SS", [i, v])
                        vk = T.axis.reduce(32, k0 * 4 + k1)
                        with T.init():
                            B[vi, vv] = T.float32(0)
                        B[vi, vv] = B[vi, vv] + A[vi, vk]


@T.prim_func(s_tir=True)
def _library_and_symbolic(A: T.Buffer((64,), "float32"), n: T.int64):
    with T.sblock("tvm_ext_library_gemm"):
        for i in range(1000000):
            A[i % 64] = T.float32(0)
    rounds: T.let[T.int64] = T.Cast("int64", n > T.int64(8)) + T.Cast("int64", n > T.int64(64))
    for r in range(rounds):
        for j in range(3):
            A[r + j] = T.float32(1)


@T.prim_func(s_tir=True)
def _symbolic(A: T.Buffer((64,), "float32"), n: T.int64):
    for j in range(n):
        A[j % 64] = T.float32(1)


def test_a_kernel_on_one_thread_counts_every_iteration():
    work = serial_iterations(_one_thread, "sum")
    assert (work.iterations, work.block, work.serial_loops) == (64 * 32, "sum", ("i", "k"))


def test_thread_bound_and_vectorised_loops_do_not_count():
    assert serial_iterations(_threads).iterations == 4


def test_library_blocks_are_skipped_and_let_bound_extents_are_bounded():
    """The library's loop is not counted; `rounds` is at most 2 through its binding; a loop
    over `n` is unbounded."""
    work = serial_iterations(_library_and_symbolic)
    assert (work.iterations, work.serial_loops) == (2 * 3, ("r", "j"))
    assert math.isinf(serial_iterations(_symbolic).iterations)


def test_kernels_are_listed_busiest_first():
    mod = tvm.IRModule({"a": _threads, "b": _one_thread})
    assert [w.kernel for w in kernel_thread_work(mod)] == ["b", "a"]
