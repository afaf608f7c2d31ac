"""gpu_in_place: an in-place update kernel scheduled as if out of place, proved, put back."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.script import tirx as T

from tvm_ext.schedules.gpu_in_place import in_place_buffers, schedule_in_place


@T.prim_func(s_tir=True)
def _update(P: T.Buffer((64,), "float32"), G: T.Buffer((64,), "float32"),
            Q: T.Buffer((64,), "float32")):
    for i in range(64):
        with T.sblock("read"):  # reads old values anywhere: a loop nest that finishes first
            vi = T.axis.spatial(64, i)
            Q[vi] = P[63 - vi]
    for i in range(64):
        with T.sblock("write"):
            vi = T.axis.spatial(64, i)
            P[vi] = P[vi] - G[vi]


@T.prim_func(s_tir=True)
def _sum(A: T.Buffer((64, 8), "float32"), B: T.Buffer((64,), "float32")):
    for i, k in T.grid(64, 8):
        with T.sblock("sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                B[vi] = T.float32(0)
            B[vi] = B[vi] + A[vi, vk]


def test_the_buffers_updated_in_place_are_found():
    assert [p.name for p in in_place_buffers(_update)] == ["P"]
    assert in_place_buffers(_sum) == []  # a reduction reads its own partial sums


def test_an_unchanged_schedule_comes_back_as_the_kernel():
    seen = []

    def identity(split):
        seen.append(split)
        return split

    out = schedule_in_place(_update, identity)
    assert [p.name for p in seen[0].params] == ["P", "G", "Q", "P_old"]
    assert "P_old" not in out.script()
    tvm.ir.assert_structural_equal(out, _update)


def _reader_last(split: tirx.PrimFunc) -> tirx.PrimFunc:
    """A 'schedule' that runs the old-value reader after the writer."""
    root = split.body.block
    seq = list(root.body.seq)[::-1]
    block = s_tir.SBlock([], [], [], "root", tirx.SeqStmt(seq))
    return split.with_body(s_tir.SBlockRealize([], True, block))


def test_a_schedule_that_reads_old_values_late_is_refused():
    assert schedule_in_place(_update, _reader_last) is None
    assert schedule_in_place(_update, lambda split: None) is None
