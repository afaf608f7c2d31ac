"""Which kernels a swap plan may run in chunks (`tvm_ext.ir.time_splits`): a dim that cuts the
leading axis of every output and of some inputs, nothing reduced over it, no halo."""

from __future__ import annotations

from tvm import relax

from tvm_ext import pipeline
from tvm_ext.driver import resolve_target
from tvm_ext.ir.graph_builder import build_graph
from tvm_ext.ir.time_splits import time_split_options

F32 = "float32"


def _options(build, *shapes):
    """(graph, per kernel op: its options) of `build(*params)` fused as the pipeline does."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(s, F32)) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build(*params))
        bb.emit_func_output(out)
    mod = pipeline.fuse(bb.get(), resolve_target("llvm"))
    graph = build_graph(mod)
    options = time_split_options(mod, graph)
    return graph, [o for op, o in zip(graph.ops, options, strict=True) if op.kind == "kernel"]


def test_matmul_rows_stream_the_input_and_keep_the_weight_whole():
    graph, (options,) = _options(lambda x, w: relax.op.tanh(relax.op.matmul(x, w)),
                                 (64, 32), (32, 16))
    x, w = (t.id for t in graph.tensors if t.arg_index is not None)
    assert [(o[1], o[2], o[3]) for o in options] == [(64, [x], [w])]


def test_softmax_rows_split_but_not_its_reduction():
    _, (options,) = _options(lambda x: relax.op.nn.softmax(x), (32, 64))
    assert len(options) == 1 and options[0][1] == 32


def test_convolution_splits_along_the_batch_only():
    graph, kernels = _options(lambda x, w: relax.op.nn.conv2d(x, w, padding=1),
                              (4, 8, 16, 16), (16, 8, 3, 3))
    x, w = (t.id for t in graph.tensors if t.arg_index is not None)
    options = [o for k in kernels for o in k]
    assert options and all(o[1] == 4 for o in options)  # the batch: output channels cut axis 1
    assert any(o[2] == [x] and o[3] == [w] for o in options)


def test_a_sum_over_the_leading_axis_has_no_split_along_it():
    _, (options,) = _options(lambda x: relax.op.sum(x, axis=0), (64, 32))
    assert options == []


def test_a_kernel_reading_one_tensor_twice_is_not_split():
    """Its chunks would stream one tensor into two buffers (or one into both of its reads);
    no split is offered rather than one not shown to be right."""
    graph, (options,) = _options(lambda x: relax.op.multiply(x, x), (64, 32))
    (op,) = [o for o in graph.ops if o.kind == "kernel"]
    assert len(op.inputs) == 2 and len(set(op.inputs)) == 1
    assert options == []


def test_a_kernel_reading_the_row_index_as_a_value_is_not_split_along_rows():
    """A causal mask compares row and column indices: each chunk would need its rows' global
    index, which the corpus transformers showed is not passed right; not offered."""
    _, (options,) = _options(lambda x: relax.op.tril(x), (64, 32))
    assert options == []
