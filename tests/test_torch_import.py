"""Per-op differential tests of the torch import (`tvm_ext.models.torch_import`): every aten op
the corpus exports (after `run_decompositions`, as the import sees it), in the forms the
corpus uses it and at the edges PyTorch allows (negative indices and dims, integer and bool
operands that PyTorch promotes), imported, built by plain `tvm.compile` and run against
PyTorch eager. An op that imports without error and computes something else fails here, by
name, before it shows as a wrong number in a whole model.

All cases export, import and build as one module (the decompositions cost about 0.6 s per
exported program, whatever its size); each case is its own test.
`test_every_op_the_corpus_exports_has_a_case` (sweep: it exports the whole corpus) keeps
`CORPUS_OPS` true.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from tvm_ext.models.reference import tolerance  # noqa: E402
from tvm_ext.models.torch_import import (  # noqa: E402
    decomposed_ops,
    import_decompositions,
    import_exported_program,
)

F = torch.nn.functional

# The aten ops the corpus models export (tests/corpus), as `decomposed_ops` names them.
CORPUS_OPS = frozenset({
    "_assert_tensor_metadata.default", "_native_batch_norm_legit_no_training.default",
    "_softmax.default", "_to_copy.default", "abs.default", "add.Tensor", "addmm.default",
    "alias.default", "any.dim", "arange.start_step", "avg_pool2d.default",
    "bitwise_and.Tensor", "bitwise_not.default", "bmm.default", "cat.default", "ceil.default",
    "clamp.default", "clone.default", "constant_pad_nd.default", "convolution.default",
    "cos.default", "cumsum.default", "div.Tensor", "embedding.default", "eq.Scalar",
    "expand.default", "full.default", "full_like.default", "gather.default", "ge.Scalar",
    "gelu.default", "gt.Scalar", "hardtanh.default", "index.Tensor", "index_select.default",
    "le.Scalar", "le.Tensor", "linalg_vector_norm.default", "log.default",
    "logical_and.default", "logical_not.default", "lt.Scalar",
    "max_pool2d_with_indices.default", "mean.dim", "minimum.default", "mm.default",
    "mul.Scalar", "mul.Tensor", "native_group_norm.default", "native_layer_norm.default",
    "neg.default", "permute.default", "pow.Tensor_Scalar", "relu.default", "repeat.default",
    "rsqrt.default", "scalar_tensor.default", "select.int", "sigmoid.default", "sign.default",
    "sin.default",
    "slice.Tensor", "split_with_sizes.default", "sqrt.default", "squeeze.dims", "sub.Tensor",
    "tanh.default", "unsqueeze.default", "upsample_bilinear2d.vec", "upsample_nearest2d.vec",
    "view.default", "where.self",
    # Mixtral's routing (tests/corpus `mixtral`).
    "div.Tensor_mode", "empty_permuted.default", "histc.default", "index_put.default",
    "sort.default", "sum.dim_IntList", "topk.default",
})


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # the aten overload the case exercises
    fn: Callable  # fn(*inputs) -> tensor or tuple of tensors
    inputs: Callable  # inputs(generator) -> tuple of tensors


def _f(*shape):
    return lambda g: torch.randn(*shape, generator=g)


def _i(low, high, *shape):
    return lambda g: torch.randint(low, high, shape, generator=g)


def _b(*shape):
    return lambda g: torch.rand(*shape, generator=g) > 0.5


def _pos(*shape):
    return lambda g: torch.rand(*shape, generator=g) + 0.1


def _grid(n, h, w):
    """A grid_sample grid: (x, y) in [-1, 1] per output point."""
    return lambda g: torch.rand(n, h, w, 2, generator=g) * 2 - 1


def _args(*makers):
    return lambda g: tuple(m(g) for m in makers)


def _case(op, fn, *makers):
    return Case(op, fn, _args(*makers))


def _put_between(x, v):
    y = x.clone()
    y[torch.tensor([0, 2, -1]), :, torch.tensor([1, 1, 4])] = v
    return y


def _put_before(x, v):
    y = x.clone()
    y[:, torch.tensor([[0], [2]]), torch.tensor([1, 4, 5])] = v * 2
    return y


def _put_mixed(x, v):
    y = x.clone()
    y[torch.tensor([0, 2, -1], dtype=torch.int32), :, torch.tensor([1, 1, 4])] = v
    return y


def _put_trailing(x, v):
    y = x.clone()
    y[torch.tensor([[1], [3]]), torch.tensor([0, 4, 0])] = v
    return y


def _put_broadcast(x, v):
    y = x.clone()
    y[torch.tensor([[1], [3]]), torch.tensor([0, 4, 0]), torch.tensor([[2, 2, -1]])] = v
    return y


def _bn(x, mean, var, w, b):
    return F.batch_norm(x, mean, var.abs() + 0.5, w, b, training=False, eps=1e-5)


CASES = {
    "assert_tensor_metadata": _case("_assert_tensor_metadata.default",
                                    lambda x: x.to(torch.float32) * 0.5, _i(-4, 4, 3, 5)),
    "batch_norm_eval": _case("_native_batch_norm_legit_no_training.default", _bn,
                             _f(2, 4, 3, 3), _f(4), _f(4), _f(4), _f(4)),
    "softmax_last": _case("_softmax.default", lambda x: x.softmax(-1), _f(2, 3, 8)),
    "softmax_dim1": _case("_softmax.default", lambda x: x.softmax(1), _f(2, 3, 8)),
    "to_float": _case("_to_copy.default", lambda x: x.float(), _i(-9, 9, 3, 4)),
    "to_int_truncates": _case("_to_copy.default", lambda x: (x * 3).long(), _f(3, 4)),
    "to_bool": _case("_to_copy.default", lambda x: x.round().bool(), _f(3, 4)),
    "bool_to_int": _case("_to_copy.default", lambda x: x.long(), _b(3, 4)),
    "abs_float": _case("abs.default", torch.abs, _f(3, 4)),
    "abs_int": _case("abs.default", torch.abs, _i(-9, 9, 3, 4)),
    "add_broadcast": _case("add.Tensor", torch.add, _f(2, 3, 4), _f(4)),
    "add_int": _case("add.Tensor", lambda a, b: a + b, _i(-9, 9, 1, 4), _i(-9, 9, 4, 1)),
    "add_int_float_scalar": _case("add.Tensor", lambda x: x + 0.5, _i(-9, 9, 3, 4)),
    "add_bool_to_float": _case("add.Tensor", lambda m, x: x + m, _b(3, 4), _f(3, 4)),
    "addmm": _case("addmm.default", lambda x, w, b: F.linear(x, w, b),
                   _f(6, 8), _f(5, 8), _f(5)),
    "alias": _case("alias.default", lambda x: torch.ops.aten.alias(x) * 2, _f(3, 4)),
    "any_dim": _case("any.dim", lambda x: (x > 1).any(dim=-1, keepdim=True), _f(3, 4, 5)),
    "arange": _case("arange.start_step", lambda x: x + torch.arange(2, 14, 3), _f(3, 4)),
    "avg_pool2d": _case("avg_pool2d.default", lambda x: F.avg_pool2d(x, 2), _f(2, 3, 8, 8)),
    "avg_pool2d_ceil_overhang": _case("avg_pool2d.default",
                                      lambda x: F.avg_pool2d(x, 4, ceil_mode=True),
                                      _f(2, 3, 6, 6)),
    "bitwise_and": _case("bitwise_and.Tensor", lambda a, b: a & b, _b(3, 4), _b(3, 4)),
    "bitwise_not": _case("bitwise_not.default", lambda a: ~a, _b(3, 4)),
    "bmm": _case("bmm.default", torch.bmm, _f(2, 3, 5), _f(2, 5, 4)),
    "cat_last": _case("cat.default", lambda a, b: torch.cat([a, b], -1), _f(2, 3), _f(2, 5)),
    "cat_empty": _case("cat.default", lambda a: torch.cat([torch.zeros(0), a], -2),
                       _f(2, 1, 4, 3)),
    "ceil": _case("ceil.default", torch.ceil, _f(3, 4)),
    "clamp_float": _case("clamp.default", lambda x: x.clamp(-0.5, 0.7), _f(3, 4)),
    "clamp_int": _case("clamp.default", lambda x: x.clamp(0, 5), _i(-9, 9, 3, 4)),
    "clone": _case("clone.default", lambda x: x.t().contiguous() + 1, _f(3, 4)),
    "constant_pad": _case("constant_pad_nd.default", lambda x: F.pad(x, (0, 1, 2, 1)),
                          _f(1, 2, 4, 4)),
    "constant_pad_value": _case("constant_pad_nd.default",
                                lambda x: F.pad(x, (1, 1), value=-3.0), _f(2, 3)),
    "conv2d_strided": _case("convolution.default",
                            lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
                            _f(2, 3, 8, 8), _f(4, 3, 3, 3), _f(4)),
    "conv2d_depthwise": _case("convolution.default",
                              lambda x, w: F.conv2d(x, w, padding=1, groups=4),
                              _f(2, 4, 6, 6), _f(4, 1, 3, 3)),
    "conv1d_grouped": _case("convolution.default",
                            lambda x, w: F.conv1d(x, w, stride=2, padding=2, groups=2),
                            _f(2, 4, 16), _f(4, 2, 4)),
    "conv_transpose2d": _case("convolution.default",
                              lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1),
                              _f(1, 4, 5, 5), _f(4, 3, 3, 3)),
    "cos": _case("cos.default", torch.cos, _f(3, 4)),
    "cumsum_float": _case("cumsum.default", lambda x: x.cumsum(1), _f(3, 6)),
    "cumsum_bool": _case("cumsum.default", lambda m: m.cumsum(-1), _b(3, 6)),
    "div_float": _case("div.Tensor", torch.div, _f(3, 4), _pos(4)),
    "div_scalar": _case("div.Tensor", lambda x: x / 3, _f(3, 4)),
    "div_int_true": _case("div.Tensor", lambda a, b: a / b, _i(-9, 9, 3, 4), _i(1, 5, 3, 4)),
    "div_int_scalar": _case("div.Tensor", lambda a: a / 4, _i(-9, 9, 3, 4)),
    # A mixture of experts' `ids // top_k` (the frontend divided int64 by an int32 constant).
    "floor_div_int_scalar": _case("div.Tensor_mode", lambda a: a // 2, _i(-9, 9, 3, 4)),
    "trunc_div_int": _case("div.Tensor_mode",
                           lambda a, b: torch.div(a, b, rounding_mode="trunc"),
                           _i(-9, 9, 3, 4), _i(1, 5, 3, 4)),
    "trunc_div_float_scalar": _case("div.Tensor_mode",
                                    lambda a: torch.div(a, 0.3, rounding_mode="trunc"),
                                    _f(3, 4)),
    "floor_div_int32_by_int64": _case("div.Tensor_mode",
                                      lambda a, b: torch.floor_divide(a.int(), b),
                                      _i(-9, 9, 3, 4), _i(1, 5, 4)),
    "mul_int32_by_int64": _case("mul.Tensor", lambda a, b: a.int() * b, _i(-9, 9, 3, 4),
                                _i(-3, 3, 4)),
    "sub_int64_by_int32_scalar_tensor": _case("sub.Tensor", lambda a, b: a - b.int()[0],
                                              _i(-9, 9, 3, 4), _i(-3, 3, 4)),
    # A mixture of experts' routing: top-k of the router's weights, tokens sorted by expert,
    # scattered back by a permutation into a buffer made by `empty_like`.
    "topk": _case("topk.default", lambda x: torch.topk(x, 3, dim=-1), _f(4, 7)),
    # DeepSeek-V3's group routing asks for an unsorted top-k; only the chosen set is specified.
    "topk_unsorted": _case("topk.default", lambda x: torch.zeros_like(x).scatter(
        -1, torch.topk(x, 3, -1, True, False)[1], 1.0), _f(4, 7)),
    "topk_unsorted_values": _case("topk.default", lambda x: torch.topk(
        x, 2, 0, False, False)[0].sum(0), _f(5, 3)),
    "sort": _case("sort.default", lambda x: torch.sort(x, dim=0), _f(9, 3)),
    "sort_ids": _case("sort.default", lambda e: torch.sort(e * 16 + torch.arange(12))[1] * 1,
                      _i(0, 4, 12)),
    "sum_dims": _case("sum.dim_IntList", lambda x: x.sum(dim=(0, 2)) * 1, _f(3, 4, 5)),
    "index_put_permutation": _case(
        "index_put.default",
        lambda x, v: torch.index_put(x, (torch.tensor([3, 0, 2, 1]),), v), _f(4), _f(4)),
    "empty_like_filled": _case("empty_permuted.default",
                               lambda x: torch.empty_like(x).fill_(2.0) * x, _f(3, 4)),
    # A mixture of experts' tokens per expert; values outside the range, and the data's own.
    "histc_expert_counts": _case("histc.default",
                                 lambda e: torch.histc(e.float(), bins=4, min=0, max=3),
                                 _i(0, 4, 16)),
    "histc_range": _case("histc.default", lambda x: torch.histc(x, bins=5, min=-1, max=1),
                         _f(3, 7)),
    "histc_data_range": _case("histc.default", lambda x: torch.histc(x, bins=6), _f(20)),
    "embedding": _case("embedding.default", lambda ids, w: F.embedding(ids, w),
                       _i(0, 10, 2, 5), _f(10, 3)),
    "embedding_padding": _case("embedding.default",
                               lambda ids, w: F.embedding(ids, w, padding_idx=1),
                               _i(0, 10, 2, 5), _f(10, 3)),
    "eq_scalar": _case("eq.Scalar", lambda x: x.masked_fill(x > 1, float("-inf")) == -np.inf,
                       _f(3, 4)),
    # Kept through the decompositions, for a training step's gradient to stop at it.
    "detach": _case("detach.default", lambda x: x * torch.tanh(x).detach(), _f(3, 4)),
    "expand": _case("expand.default", lambda x: x.expand(2, -1, 4) + 0, _f(1, 3, 1)),
    "full": _case("full.default", lambda x: x + torch.full((3, 4), -2.5), _f(3, 4)),
    "full_like": _case("full_like.default", lambda x: torch.full_like(x, 7) - x, _f(3, 4)),
    # torch's grid is (N, H_out, W_out, 2); points outside [-1, 1] take each padding mode.
    "grid_sample_bilinear": _case("grid_sampler_2d.default",
                                  lambda x, g: F.grid_sample(x, g * 1.2, align_corners=False),
                                  _f(2, 3, 8, 6), _grid(2, 7, 5)),
    "grid_sample_nearest_border": _case(
        "grid_sampler_2d.default",
        lambda x, g: F.grid_sample(x, g * 1.2, "nearest", "border", align_corners=True),
        _f(2, 3, 8, 6), _grid(2, 7, 5)),
    "grid_sample_bicubic_reflection": _case(
        "grid_sampler_2d.default",
        lambda x, g: F.grid_sample(x, g * 1.2, "bicubic", "reflection", align_corners=False),
        _f(2, 3, 8, 6), _grid(2, 7, 5)),
    "gather": _case("gather.default", lambda x, i: torch.gather(x, 1, i),
                    _f(3, 6), _i(0, 6, 3, 4)),
    "gather_int": _case("gather.default", lambda x, i: torch.gather(x, -1, i),
                        _i(-9, 9, 1, 16), _i(0, 16, 1, 16)),
    "ge_scalar": _case("ge.Scalar", lambda x: x >= 0.25, _f(3, 4)),
    "ge_int": _case("ge.Scalar", lambda x: x >= 2, _i(-4, 4, 3, 4)),
    "gt_scalar": _case("gt.Scalar", lambda x: x > 0, _f(3, 4)),
    "gelu": _case("gelu.default", F.gelu, _f(3, 4)),
    "gelu_tanh": _case("gelu.default", lambda x: F.gelu(x, approximate="tanh"), _f(3, 4)),
    "hardtanh": _case("hardtanh.default", F.relu6, _f(3, 4)),
    "index_negative": _case("index.Tensor", lambda x: x[:, :, torch.tensor([-2])],
                            _f(2, 3, 6, 4)),
    "index_negative_runtime": _case("index.Tensor", lambda x, i: x[:, i], _f(3, 6),
                                    _i(-6, 6, 4)),
    "index_two_tensors": _case("index.Tensor", lambda x, i, j: x[i, j],
                               _f(4, 6), _i(0, 4, 3, 1), _i(-6, 6, 1, 5)),
    # TVM types an integer range counting down as longer than it is (Funnel's positions).
    "arange_down": _case("arange.start_step",
                         lambda x: x + torch.arange(16, -16, -1)[:, None], _f(32, 3)),
    "arange_down_by_three": _case("arange.start_step",
                                  lambda x: x + torch.arange(5, -6, -3), _f(2, 4)),
    # Slices beside index tensors (ConvBERT's unfold): the tensors pick jointly, their axes
    # in place when adjacent, in front when apart.
    "index_slices_beside_tensors": _case("index.Tensor", lambda x, i, j: x[:, :, i, j],
                                         _f(2, 3, 6, 5), _i(-6, 6, 4), _i(0, 5, 4)),
    "index_slice_between_tensors": _case("index.Tensor", lambda x, i, j: x[:, i, j, :],
                                         _f(2, 6, 5, 3), _i(0, 6, 2, 3, 1), _i(-5, 5, 1, 1)),
    "index_tensors_apart": _case("index.Tensor", lambda x, i, j: x[:, i, :, j],
                                 _f(2, 6, 3, 5), _i(0, 6, 4), _i(0, 5, 4)),
    # Writes through slices beside index tensors: the values in x[indices]'s axis order.
    # PatchTST's patches: windows along an axis, overlapping or not.
    "unfold_patches": _case("unfold.default", lambda x: x.unfold(-2, 4, 4), _f(2, 12, 3)),
    "unfold_overlapping": _case("unfold.default", lambda x: x.unfold(1, 3, 2), _f(2, 8, 4)),
    "unfold_first_axis": _case("unfold.default", lambda x: x.unfold(0, 2, 1) * 1, _f(3, 5)),
    "index_put_slice_between": _case("index_put.default", _put_between,
                                     _f(4, 5, 6), _f(3, 5)),
    "index_put_int32_beside_int64": _case("index_put.default", _put_mixed, _f(4, 3, 6), _f(3)),
    "index_put_slice_before": _case("index_put.default", _put_before, _f(2, 5, 6), _f(3)),
    # Fewer indices than axes (the rest sliced whole), and values broadcast to the indices'
    # joint shape (relax's index_put reads values of that shape only).
    "index_put_trailing_axes": _case("index_put.default", _put_trailing, _f(4, 6, 5), _f(1, 5)),
    "index_put_values_broadcast": _case("index_put.default", _put_broadcast, _f(4, 6, 5),
                                        _f(3)),
    "index_bool_mask": _case("index.Tensor",
                             lambda m: m[torch.arange(4)[:, None], torch.arange(6)[None, :]],
                             _b(4, 6)),
    "index_select": _case("index_select.default",
                          lambda x: torch.index_select(x, 1, torch.tensor([3, 0, 2, 2])),
                          _f(3, 5)),
    "le_scalar": _case("le.Scalar", lambda x: x <= 0.1, _f(3, 4)),
    "le_tensor": _case("le.Tensor", lambda a, b: a <= b, _i(0, 5, 1, 6), _i(0, 5, 6, 1)),
    "vector_norm": _case("linalg_vector_norm.default",
                         lambda x: torch.linalg.vector_norm(x, 2, dim=(0, 1), keepdim=True),
                         _f(3, 4, 5)),
    "log_float": _case("log.default", torch.log, _pos(3, 4)),
    "log_int": _case("log.default", torch.log, _i(1, 40, 3, 4)),
    "logical_and": _case("logical_and.default", torch.logical_and, _b(3, 4), _b(3, 4)),
    "logical_not": _case("logical_not.default", torch.logical_not, _b(3, 4)),
    "lt_scalar": _case("lt.Scalar", lambda x: x < -1, _f(3, 4)),
    "max_pool_stem": _case("max_pool2d_with_indices.default",
                           lambda x: F.max_pool2d(x, 3, 2, 1), _f(2, 3, 9, 9)),
    "max_pool2": _case("max_pool2d_with_indices.default", lambda x: F.max_pool2d(x, 2),
                       _f(2, 3, 8, 8)),
    "mean_dim": _case("mean.dim", lambda x: x.mean(-1, keepdim=True), _f(2, 3, 5)),
    "mean_dims": _case("mean.dim", lambda x: x.mean((2, 3)), _f(2, 3, 4, 5)),
    "minimum_int": _case("minimum.default", torch.minimum, _i(0, 9, 3, 4), _i(0, 9, 3, 4)),
    "mm": _case("mm.default", torch.mm, _f(3, 5), _f(5, 4)),
    "mul_scalar": _case("mul.Scalar", lambda x: torch.ops.aten.mul.Scalar(x, 0.42), _f(3, 4)),
    "mul_tensor": _case("mul.Tensor", torch.mul, _f(3, 4), _f(3, 1)),
    "mul_int_scalar": _case("mul.Tensor", lambda x: x * 4, _i(-9, 9, 3, 4)),
    "mul_int_float_scalar": _case("mul.Tensor", lambda x: x * 0.5, _i(-9, 9, 3, 4)),
    "mul_bool_float": _case("mul.Tensor", lambda m, x: m * x, _b(3, 4), _f(3, 4)),
    "group_norm": _case("native_group_norm.default",
                        lambda x, w, b: F.group_norm(x, 2, w, b), _f(2, 4, 3, 3), _f(4), _f(4)),
    "layer_norm": _case("native_layer_norm.default",
                        lambda x, w, b: F.layer_norm(x, (6,), w, b), _f(2, 3, 6), _f(6), _f(6)),
    "neg": _case("neg.default", torch.neg, _f(3, 4)),
    "permute": _case("permute.default", lambda x: x.permute(2, 0, 1) * 1, _f(2, 3, 4)),
    "pow_square": _case("pow.Tensor_Scalar", lambda x: x ** 2, _f(3, 4)),
    "pow_cube": _case("pow.Tensor_Scalar", lambda x: x ** 3, _f(3, 4)),
    "pow_half": _case("pow.Tensor_Scalar", lambda x: x ** 0.5, _pos(3, 4)),
    "relu": _case("relu.default", F.relu, _f(3, 4)),
    "repeat": _case("repeat.default", lambda x: x.repeat(2, 3), _f(2, 3)),
    "rsqrt": _case("rsqrt.default", torch.rsqrt, _pos(3, 4)),
    "scalar_tensor": _case("scalar_tensor.default",
                           lambda x: torch.where(x > 0, torch.tensor(0.0), float("-inf")),
                           _f(3, 4)),
    "select_first": _case("select.int", lambda x: x[:, 0] * 2, _f(2, 5, 4)),
    "select_last": _case("select.int", lambda x: x[:, :, -1] + 1, _f(2, 5, 4)),
    "sigmoid": _case("sigmoid.default", torch.sigmoid, _f(3, 4)),
    "sign_float": _case("sign.default", torch.sign, _f(3, 4)),
    "sign_int": _case("sign.default", torch.sign, _i(-3, 3, 3, 4)),
    "sin": _case("sin.default", torch.sin, _f(3, 4)),
    "slice_negative": _case("slice.Tensor", lambda x: x[:, 1:-1] * 1, _f(3, 8)),
    "slice_step": _case("slice.Tensor", lambda x: x[:, ::2] * 1, _f(3, 8)),
    "slice_open_end": _case("slice.Tensor", lambda x: x[..., 4:] * 1, _f(2, 3, 8)),
    "split_with_sizes": _case("split_with_sizes.default", lambda x: x.split([2, 4, 2], -1),
                              _f(3, 8)),
    "sqrt_float": _case("sqrt.default", torch.sqrt, _pos(3, 4)),
    "sqrt_int": _case("sqrt.default", torch.sqrt, _i(0, 40, 3, 4)),
    "squeeze_dims": _case("squeeze.dims", lambda x: x.squeeze(-2) * 1, _f(3, 1, 4)),
    "sub_float": _case("sub.Tensor", torch.sub, _f(3, 4), _f(4)),
    "sub_int": _case("sub.Tensor", lambda a, b: a - b, _i(0, 9, 1, 5), _i(0, 9, 5, 1)),
    "sub_alpha": _case("sub.Tensor", lambda a, b: torch.sub(a, b, alpha=2), _f(3, 4), _f(3, 4)),
    "tanh": _case("tanh.default", torch.tanh, _f(3, 4)),
    "unsqueeze": _case("unsqueeze.default", lambda x: x.unsqueeze(-1) * 1, _f(3, 4)),
    "bilinear": _case("upsample_bilinear2d.vec",
                      lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
                      _f(1, 2, 5, 5)),
    "bilinear_size_aligned": _case("upsample_bilinear2d.vec",
                                   lambda x: F.interpolate(x, size=(7, 9), mode="bilinear",
                                                           align_corners=True),
                                   _f(1, 2, 4, 5)),
    "nearest": _case("upsample_nearest2d.vec",
                     lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), _f(1, 2, 4, 4)),
    "view": _case("view.default", lambda x: x.view(4, 3) * 1, _f(3, 4)),
    "where_scalars": _case("where.self", lambda x: torch.where(x > 0, x, 0.1),
                           _f(3, 4)),
    "where_tensors": _case("where.self", lambda c, a, b: torch.where(c, a, b),
                           _b(3, 4), _f(3, 4), _f(1, 4)),
}


class _Module(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


class _AllCases(torch.nn.Module):
    """Every case in one module (one export, one import, one compile): case `name` is the
    submodule `cases.<name>`, which the exported nodes' module stacks name."""

    def __init__(self, names: list[str]):
        super().__init__()
        self.names = names
        self.arity = [len(_inputs(n)) for n in names]
        self.cases = torch.nn.ModuleDict({n: _Module(CASES[n].fn) for n in names})

    def forward(self, *xs):
        outs, k = [], 0
        for name, n in zip(self.names, self.arity, strict=True):
            out = self.cases[name](*xs[k:k + n])
            outs.extend(out if isinstance(out, tuple) else (out,))
            k += n
        return tuple(outs)


def _inputs(name: str) -> tuple:
    return CASES[name].inputs(torch.Generator().manual_seed(len(name)))


def _export(names: list[str]):
    args = tuple(x for n in names for x in _inputs(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(_AllCases(names).eval(), args)


def _ops_by_case(program) -> dict[str, set[str]]:
    """case name -> the aten ops of its nodes after the import's decompositions."""
    ops: dict[str, set[str]] = {n: set() for n in CASES}
    for node in program.run_decompositions(import_decompositions()).graph.nodes:
        stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        name = stack[-1].removeprefix("cases.") if stack else None
        if node.op == "call_function" and name in ops:
            ops[name].add(str(node.target).removeprefix("aten."))
    return ops


def _imported(names: list[str], program) -> tuple[tvm.IRModule, dict[str, Exception]]:
    """The module of `program` (of the cases `names`), and the import's exception per case it
    refused: where the whole does not import, each case is imported alone to say which."""
    try:
        return import_exported_program(program)[0], {}
    except Exception:
        failed = {}
        for name in names:
            try:
                import_exported_program(_export([name]))
            except Exception as err:
                failed[name] = err
        if not failed:
            raise
        kept = [n for n in names if n not in failed]
        return import_exported_program(_export(kept))[0], failed


@pytest.fixture(scope="module")
def built():
    """(each case's outputs or the import's exception, each case's exported ops)."""
    names = list(CASES)
    program = _export(names)
    ops = _ops_by_case(program)
    mod, failed = _imported(names, program)
    mod, params = relax.frontend.detach_params(mod)
    assert not params.get("main")
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    kept = [n for n in names if n not in failed]
    args = [tvm.runtime.tensor(x.numpy()) for n in kept for x in _inputs(n)]
    outs = iter(_flat(vm["main"](*args)))
    results: dict = dict(failed)
    for name in kept:
        with torch.no_grad():
            expected = CASES[name].fn(*_inputs(name))
        expected = expected if isinstance(expected, tuple) else (expected,)
        results[name] = [(next(outs), e.numpy()) for e in expected]
    return results, ops


def _flat(value) -> list[np.ndarray]:
    if isinstance(value, (list, tuple)) or type(value).__name__ == "Array":
        return [a for v in value for a in _flat(v)]
    return [value.numpy()]


@pytest.mark.parametrize("name", list(CASES))
def test_op_matches_pytorch(built, name):
    results, ops = built
    assert CASES[name].op in ops[name], f"the case exports {sorted(ops[name])}"
    if isinstance(results[name], Exception):
        raise results[name]
    for out, exp in results[name]:
        assert (out.dtype, out.shape) == (exp.dtype, exp.shape)
        np.testing.assert_allclose(out, exp, *tolerance(exp.dtype), err_msg=name)


def test_every_corpus_op_has_a_case():
    assert CORPUS_OPS <= {case.op for case in CASES.values()}


@pytest.mark.sweep
def test_every_op_the_corpus_exports_has_a_case(tmp_path):
    corpus = pytest.importorskip("corpus")
    pytest.importorskip("transformers")
    exported = set()
    for model in corpus.MODELS:
        path, _ = corpus.export(model, str(tmp_path))
        exported |= decomposed_ops(torch.export.load(path))
    assert exported <= CORPUS_OPS, sorted(exported - CORPUS_OPS)
