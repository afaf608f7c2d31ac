"""Which kernels a swap plan may run in chunks (`tvm_ext.ir.time_splits`): a dim that cuts the
leading axis of every output and of some inputs, nothing reduced over it, no halo; or a dim
every output is reduced over by one block with an init, which cuts some inputs and no output
(the chunks add up in the output: `accumulate`, the option's last field)."""

from __future__ import annotations

import pytest
from one_op import one_op_module
from tvm import relax

from tvm_ext import pipeline
from tvm_ext.driver import resolve_target
from tvm_ext.ir.graph_builder import build_graph
from tvm_ext.ir.time_splits import time_split_options

F32 = "float32"


def _options(build, *shapes):
    """(graph, per kernel op: its options) of `build(*params)` fused as the pipeline does."""
    mod = pipeline.fuse(one_op_module(build, *shapes), resolve_target("llvm"))
    graph = build_graph(mod)
    options = time_split_options(mod, graph)
    return graph, [o for op, o in zip(graph.ops, options, strict=True) if op.kind == "kernel"]


def test_matmul_rows_stream_the_input_columns_the_weight():
    """Rows: chunks of x, w whole; columns: chunks of w (strided, as the output's), x whole;
    the contraction: chunks of both, added up before tanh runs once (`test_a_reduction_with_
    an_epilogue_in_its_kernel_finishes_once`)."""
    graph, (options,) = _options(lambda x, w: relax.op.tanh(relax.op.matmul(x, w)),
                                 (64, 32), (32, 16))
    x, w = (t.id for t in graph.tensors if t.arg_index is not None)
    out = graph.ops[-1].outputs[0]
    assert sorted((o[1], o[2], o[3], o[6]) for o in options) == [
        (16, [w], [x], [w, out]), (32, [x, w], [], [x]), (64, [x], [w], [])]


def test_softmax_rows_split_but_not_its_reduction():
    _, (options,) = _options(lambda x: relax.op.nn.softmax(x), (32, 64))
    assert len(options) == 1 and options[0][1] == 32


def test_convolution_splits_along_the_batch_or_adds_up_its_input_channels():
    graph, kernels = _options(lambda x, w: relax.op.nn.conv2d(x, w, padding=1),
                              (4, 8, 16, 16), (16, 8, 3, 3))
    x, w = (t.id for t in graph.tensors if t.arg_index is not None)
    options = [o for k in kernels for o in k]
    plain = [o for o in options if not o[7] and not o[10]]
    # The batch (chunks of x) and the output channels (chunks of w, strided in the output).
    assert sorted((o[1], o[2], o[3]) for o in plain) == [(4, [x], [w]), (16, [w], [x])]
    # The input channels, summed over: chunks of both x and w, the output whole; and the
    # window's taps (its 3 rows, its 3 columns of w: x whole, each chunk padding other rows).
    assert sorted((o[1], o[2], o[3], o[4]) for o in options if o[7] and not o[10]) == \
        [(3, [w], [x], []), (3, [w], [x], []), (8, [x, w], [], [])]


def test_convolution_rows_stream_their_input_range_with_the_halo_rows():
    """The output rows (and columns): chunks of x's rows read through the 3x3 windows, one
    halo row on each side (2 rows of 8 x 16 x 4 float32 per chunk beyond its own), strided
    (the batch and channels come first), the output's rows cut; w whole."""
    graph, kernels = _options(lambda x, w: relax.op.nn.conv2d(x, w, padding=1),
                              (4, 8, 16, 16), (16, 8, 3, 3))
    x, w = (t.id for t in graph.tensors if t.arg_index is not None)
    out = graph.ops[-1].outputs[0]
    options = [o for k in kernels for o in k]
    windowed = [o for o in options if o[10] and not o[7] and o[11] < 0]
    assert len(windowed) == 2  # rows and columns
    for o in windowed:
        assert (o[1], o[2], o[3], o[4]) == (16, [x], [w], [out])
        assert o[10] == [[x, 2 * 4 * 8 * 16 * 4]] and x in o[6]  # halo bytes, strided


def test_convolution_rows_split_within_each_image_of_the_batch():
    """The batch and the rows at once: each of the 4 images in row chunks, a chunk reading
    one image's rows and halo rows (2 rows of 8 x 16 x 4 float32), every cut tensor strided; the
    output channels do not combine with the batch (they cut w, which the batch reads whole),
    nor do the summed input channels with the rows (one reduces, the other does not)."""
    graph, kernels = _options(lambda x, w: relax.op.nn.conv2d(x, w, padding=1),
                              (4, 8, 16, 16), (16, 8, 3, 3))
    x, w = (t.id for t in graph.tensors if t.arg_index is not None)
    out = graph.ops[-1].outputs[0]
    options = [o for k in kernels for o in k]
    two = [o for o in options if o[11] >= 0]
    assert len(two) == 2  # the batch with the rows, with the columns
    for o in two:
        assert (o[1], o[2], o[3], o[4], o[12]) == (16, [x], [w], [out], 4)
        assert o[10] == [[x, 2 * 8 * 16 * 4]] and sorted(o[6]) == sorted([x, out])
        batch = next(b for b in options if b[11] < 0 and b[1] == 4 and b[2] == [x])
        assert o[11] == batch[0]  # the outer dim is the batch's



def test_a_reduction_with_an_epilogue_in_its_kernel_finishes_once():
    """tanh(x @ w) in one kernel: the product is an intermediate the epilogue reads; its
    reduction over K splits with the epilogue run once after the chunks, in place in the
    output (no scratch); the rows and columns split too."""
    _, (options,) = _options(lambda x, w: relax.op.tanh(relax.op.matmul(x, w)),
                             (64, 32), (32, 16))
    assert sorted((o[7], o[8], o[9]) for o in options) == [
        (False, False, 0), (False, False, 0), (True, True, 0)]


def test_a_weight_gradient_splits_along_the_tokens_it_sums_over():
    _, kernels = _options(lambda x, dy: relax.op.matmul(relax.op.permute_dims(x), dy),
                          (128, 16), (128, 8))
    gemm = [o for o in kernels[-1] if o[7]]
    # x^T (a kernel of its own) is cut along its columns (strided), dy along its rows.
    assert [(o[1], o[4], len(o[2]), len(o[6])) for o in gemm] == [(128, [], 2, 1)]


def test_a_sum_over_the_leading_axis_splits_along_the_columns_or_adds_up_the_rows():
    """The columns split, their chunks strided; the reduced rows split too, each chunk of rows
    adding its sums to the whole output."""
    graph, (options,) = _options(lambda x: relax.op.sum(x, axis=0), (64, 32))
    x = next(t.id for t in graph.tensors if t.arg_index is not None)
    out = next(t.id for t in graph.tensors if t.kind != "input" and t.producer is not None)
    assert [(o[1], o[2], o[4], o[6], o[7]) for o in options] == \
        [(32, [x], [out], [x], False), (64, [x], [], [], True)]


def test_a_kernel_reading_one_tensor_twice_reads_the_same_chunk_twice():
    """Both reads of x cut along its rows: one stream of x's chunks serves both."""
    graph, (options,) = _options(lambda x: relax.op.multiply(x, x), (64, 32))
    (op,) = [o for o in graph.ops if o.kind == "kernel"]
    assert len(op.inputs) == 2 and len(set(op.inputs)) == 1
    assert [(o[1], o[2], o[3], o[6], o[11]) for o in options] == [
        (64, [op.inputs[0]], [], [], -1),
        (32, [op.inputs[0]], [], [op.inputs[0], op.outputs[0]], -1),
        # The columns of each row: strided chunks of both.
        (32, [op.inputs[0]], [], [op.inputs[0], op.outputs[0]], options[0][0])]


def test_a_kernel_reading_the_row_index_as_a_value_splits_along_rows():
    """A causal mask compares row and column indices: each chunk gets its rows' global index
    as an argument (test_swap_offload runs such a split exactly)."""
    graph, (options,) = _options(lambda x: relax.op.tril(x), (64, 32))
    x = next(t.id for t in graph.tensors if t.arg_index is not None)
    assert [(o[1], o[2], o[3]) for o in options] == [(64, [x], []), (32, [x], [])]
    assert next(o[6] for o in options) == []  # rows: contiguous; columns: strided


def test_a_view_is_cut_as_its_base():
    """A reshape view read in chunks is cut as the bytes of its base (the view holds none)."""
    graph, kernels = _options(
        lambda x, g, b, w: relax.op.matmul(
            relax.op.reshape(relax.op.nn.layer_norm(x, g, b, axes=[-1]), (64, 32)), w),
        (4, 16, 32), (32,), (32,), (32, 16))
    options = [o for k in kernels for o in k]
    views = {t.id: t.alias_of for t in graph.tensors if t.alias_of is not None}
    assert views and any(set(o[2]) & set(views.values()) for o in options)
    assert all(not set(o[2]) & set(views) for o in options)  # bases only


def test_the_leading_axis_is_the_first_that_is_not_one():
    """Rows of (1, 1, 96, 63) are contiguous byte ranges: softmax over the last axis splits
    along the rows, though they are not axis 0 and their bytes are not aligned."""
    graph, (options,) = _options(lambda x: relax.op.nn.softmax(x), (1, 1, 96, 63))
    x = next(t.id for t in graph.tensors if t.arg_index is not None)
    assert [(o[1], o[2]) for o in options] == [(96, [x])]
    assert options[0][5] == [[x, 96 * 63 * 4]]  # unaligned bytes, for chunks read in place


def test_a_tensor_read_along_two_axes_is_not_cut_by_its_reduction():
    """x @ x: the reduced dim cuts x's columns for one read and its rows for the other; one
    stream of chunks cannot serve both (nor can a split of the rows, which reads x whole)."""
    _, (options,) = _options(lambda x: relax.op.matmul(x, x), (16, 16))
    assert not any(o[7] for o in options)


@pytest.mark.sweep  # test_halo_chunks and test_kernel_chunks lower the same splits
def test_every_chunk_count_an_option_allows_lowers(zoo_cache):
    """Each split option of a training step's kernels (the zoo resnet: convolutions, their
    input and weight gradients, strided and windowed) lowers at every chunk count it allows:
    the option's divisor covers every buffer the chunk kernel cuts (a strided convolution's
    gradient has buffers shorter than the dim)."""
    from tvm_ext.ir.epilogue_kernels import reduction_epilogue
    from tvm_ext.ir.kernel_dims import kernel_dims
    from tvm_ext.ir.local_kernels import has_halo, local_kernel
    from tvm_ext.swap.split import SplitOption

    model = zoo_cache("resnet", training=True)
    mod = pipeline.fuse(model.mod, resolve_target("llvm"))
    graph = build_graph(mod)
    checked = two_dims = 0
    for op, options in zip(graph.ops, time_split_options(mod, graph), strict=True):
        for data in options:
            option = SplitOption.from_list(data)
            kd = kernel_dims(mod[op.kernel], len(op.outputs), op.kernel)
            part = reduction_epilogue(kd, option.dim).reduction if option.epilogue else None
            outer = {option.outer_dim: option.outer_chunks} if option.outer_dim >= 0 else {}
            for chunks in range(2, option.divisor + 1):
                if option.divisor % chunks == 0:
                    local_kernel(kd, {option.dim: chunks, **outer},
                                 func=part.func if part else None,
                                 num_outputs=len(part.outputs) if part else None,
                                 halo=has_halo(kd, option.dim))
                    checked += 1
                    two_dims += bool(outer)
    assert checked > 100 and two_dims > 10
