"""Operator partitions derived from TIR, against partitions written out by hand.

Every operator kind of the zoo models: each test legalizes one Relax op (or takes a fused kernel
of a zoo model) and lists its dims as (extent, per-input cut, per-output result, combiners of the
allreduces inside the kernel, global index). An input cut is the axis (with halo rows `(axis, lo,
hi)`) or None (needed whole); an output is its cut axis, a partial result ("sum", "max") or None
(replicated).
"""

from __future__ import annotations

import pytest
import tvm
from one_op import one_op_module
from tvm import relax, tirx

from tvm_ext.driver import partition_problem
from tvm_ext.ir.kernel_dims import kernel_spec, reshape_spec
from tvm_ext.models import get_model

F32 = "float32"


def legalized_spec(build, *shapes, dtypes=None):
    """The KernelSpec of the one PrimFunc `LegalizeOps` makes of `build(*params)`."""
    mod = relax.transform.LegalizeOps()(one_op_module(build, *shapes, dtypes=dtypes))
    (gv,) = [gv for gv in mod.functions if isinstance(mod[gv], tirx.PrimFunc)]
    return kernel_spec(mod[gv], 1, gv.name_hint)


def dims(spec) -> list[tuple]:
    """A spec's dims in a hand-writable form, in the analysis' order."""
    out = []
    for d in spec.dims:
        assert d.valid, d.reason
        cuts = tuple(None if c is None else (c.axis if not c.halo else (c.axis, c.halo_lo,
                                                                        c.halo_hi))
                     for c in d.inputs)
        out.append((d.extent, cuts, tuple(d.outputs), tuple(r.combiner for r in d.inner),
                    d.global_index))
    return out


def test_matmul():
    # C[i, j] = sum_k A[i, k] B[k, j]: split rows, columns, or the contraction (partial sums).
    spec = legalized_spec(lambda a, b: relax.op.matmul(a, b), (8, 16), (16, 4))
    assert dims(spec) == [
        (8, (0, None), (0,), (), False),
        (4, (None, 1), (1,), (), False),
        (16, (1, 0), ("sum",), (), False),
    ]


def test_batched_matmul():
    spec = legalized_spec(lambda a, b: relax.op.matmul(a, b), (2, 3, 8, 16), (2, 3, 16, 4))
    assert dims(spec) == [
        (2, (0, 0), (0,), (), False),  # batch
        (3, (1, 1), (1,), (), False),  # heads
        (8, (2, None), (2,), (), False),
        (4, (None, 3), (3,), (), False),
        (16, (3, 2), ("sum",), (), False),
    ]


def test_conv2d_halo():
    # NCHW, 3x3, padding 1: rows and columns are cut with one halo row each side and need the
    # global index (the padding test); input channels and the window give partial sums.
    spec = legalized_spec(lambda x, w: relax.op.nn.conv2d(x, w, padding=1),
                          (2, 4, 8, 8), (6, 4, 3, 3))
    assert dims(spec) == [
        (2, (0, None), (0,), (), False),
        (4, (1, 1), ("sum",), (), False),
        (6, (None, 0), (1,), (), False),
        (8, ((2, 1, 1), None), (2,), (), True),
        (8, ((3, 1, 1), None), (3,), (), True),
        (3, (None, 2), ("sum",), (), True),
        (3, (None, 3), ("sum",), (), True),
    ]


def test_max_pool_halo():
    # 3x3 window, stride 2, padding 1: output row r reads input rows 2r-1 .. 2r+1.
    spec = legalized_spec(lambda x: relax.op.nn.max_pool2d(x, pool_size=3, strides=2,
                                                           padding=1), (2, 4, 8, 8))
    assert dims(spec) == [
        (2, (0,), (0,), (), False),
        (4, (1,), (1,), (), False),
        (4, ((2, 1, 0),), (2,), (), True),
        (4, ((3, 1, 0),), (3,), (), True),
        (3, (None,), ("max",), (), True),
        (3, (None,), ("max",), (), True),
    ]


def test_global_average_pool():
    # The window sums are divided afterwards: splitting H or W needs an allreduce inside.
    spec = legalized_spec(lambda x: relax.op.nn.adaptive_avg_pool2d(x, output_size=1),
                          (2, 4, 8, 8))
    assert dims(spec) == [
        (2, (0,), (0,), (), False),
        (4, (1,), (1,), (), False),
        (8, (2,), (None,), ("sum",), False),
        (8, (3,), (None,), ("sum",), False),
    ]


def test_softmax_over_split_axis():
    # max and sum over the split axis are allreduced inside; the output stays split.
    spec = legalized_spec(lambda x: relax.op.nn.softmax(x, axis=-1), (4, 8))
    assert dims(spec) == [
        (4, (0,), (0,), (), False),
        (8, (1,), (1,), ("max", "sum"), False),
    ]


def test_layer_norm():
    spec = legalized_spec(lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]),
                          (4, 8), (8,), (8,))
    assert dims(spec) == [
        (4, (0, None, None), (0,), (), False),
        (8, (1, 0, 0), (1,), ("sum", "sum"), False),  # mean, then variance
    ]


@pytest.mark.parametrize(("op", "result"), [
    (relax.op.sum, "sum"), (relax.op.max, "max"), (relax.op.min, "min")])
def test_reductions(op, result):
    spec = legalized_spec(lambda x: op(x, axis=[1]), (4, 8))
    assert dims(spec) == [(4, (0,), (0,), (), False), (8, (1,), (result,), (), False)]


def test_mean_divides_after_the_sum():
    spec = legalized_spec(lambda x: relax.op.mean(x, axis=[1]), (4, 8))
    assert dims(spec) == [(4, (0,), (0,), (), False), (8, (1,), (None,), ("sum",), False)]


def test_broadcasting_add():
    spec = legalized_spec(lambda a, b: relax.op.add(a, b), (2, 4, 8), (8,))
    assert dims(spec) == [
        (2, (0, None), (0,), (), False),
        (4, (1, None), (1,), (), False),
        (8, (2, 0), (2,), (), False),
    ]


def test_transpose():
    spec = legalized_spec(lambda x: relax.op.permute_dims(x, [1, 0]), (4, 8))
    assert dims(spec) == [(8, (1,), (0,), (), False), (4, (0,), (1,), (), False)]


def test_reshape_split_and_merge():
    # (8, 8) -> (4, 2, 8): only the outer part of the split axis cuts the input by chunks; the
    # inner part reads the input whole, so a chunk of it must index it globally.
    spec = legalized_spec(lambda x: relax.op.reshape(x, (4, 2, 8)), (8, 8))
    assert dims(spec) == [
        (4, (0,), (0,), (), False),
        (2, (None,), (1,), (), True),
        (8, (1,), (2,), (), False),
    ]
    # (2, 16, 32) -> (32, 32): rows are cut by batch only (2 chunks at most).
    view = reshape_spec((2, 16, 32), (32, 32))
    assert dims(view) == [(32, (0,), (0,), (), False), (32, (2,), (1,), (), False)]
    assert [d.divisor for d in view.dims] == [2, 32]
    assert view.dims[0].splits(2) and not view.dims[0].splits(4)


def test_take_embedding():
    # out[i, j] = table[idx[i], j]: the table can be cut by columns, never by the gathered rows.
    spec = legalized_spec(lambda t, i: relax.op.take(t, i, axis=0), (16, 8), (4,),
                          dtypes=[F32, "int32"])
    assert dims(spec) == [(4, (None, 0), (0,), (), False), (8, (1, None), (1,), (), False)]


@pytest.fixture(scope="module")
def gpt_problem():
    return partition_problem(get_model("gpt", "tiny", training=True))


def test_fused_matmul_bias_needs_allreduce_inside(gpt_problem):
    # matmul then bias add: a split contraction is allreduced before the add.
    spec = gpt_problem.specs["fused_matmul_add2"]
    assert dims(spec)[-1] == (32, (2, 0, None), (None,), ("sum",), False)


def test_fused_head_merge_keeps_the_head_split(gpt_problem):
    # transpose + reshape [b, h, t, d] -> [b, t, h * d]: heads stay a split of the output.
    spec = gpt_problem.specs["fused_transpose3_reshape3"]
    heads = [d for d in spec.dims if d.valid and d.inputs[0] is not None
             and d.inputs[0].axis == 1]
    assert len(heads) == 1 and heads[0].outputs == [2] and heads[0].extent == 2
    # The head-dim part of the merged axis is not a chunk of it: reported, never split.
    assert any("read across chunks" in (d.reason or "") for d in spec.dims)


def test_one_hot_needs_global_index(gpt_problem):
    # pred_grad[i, j] = (j == label[i]) ...: the class index is a value.
    # (named with `_bc` where BroadcastConstants passed it a constant at a smaller extent)
    spec = next(s for k, s in gpt_problem.specs.items()
                if k.startswith("te_nll_loss_backward_no_weight"))
    (classes,) = [d for d in spec.dims if d.outputs == [1]]
    assert classes.valid and classes.global_index


def test_unanalysable_kernels_are_reported(gpt_problem):
    # take's gradient is a scatter written as plain loops: replicated and reported.
    spec = gpt_problem.specs["take_backward"]
    assert spec.opaque and "loops" in spec.notes[0]
    reported = dict(gpt_problem.unsupported())
    assert "take_backward" in reported


def test_every_zoo_kernel_is_read(gpt_problem):
    resnet = partition_problem(get_model("resnet", "tiny", training=True))
    for problem in (gpt_problem, resnet):
        opaque = {s.kernel for s in problem.specs.values() if s.opaque}
        assert opaque <= {"take_backward", "take_backward1"}, opaque
        for op in problem.graph.ops:
            spec = problem.spec(op.id)
            assert spec.num_inputs == len(op.inputs) and spec.num_outputs == len(op.outputs)


def test_kernel_spec_takes_a_primfunc():
    with pytest.raises(TypeError, match="PrimFunc"):
        kernel_spec(tvm.IRModule(), 1)
