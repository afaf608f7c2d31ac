"""Converters of aten ops with PyTorch's semantics where TVM's torch frontend computes
something else, as wrappers of the frontend's own converters (`with_torch_semantics`):

- dtypes: the frontend computes matmuls, linear layers and convolutions with a float32 result
  whatever the input dtype, so the bias add of a float16 / bfloat16 layer mixes dtypes. Those
  ops (and the norms and softmaxes) run in float32 here, as PyTorch accumulates them on CPU,
  with their result cast back. Sums and cumulative sums of bool or small integers accumulate
  in the dtype torch gives their result (the frontend would add bools as bools). Arithmetic
  and math on integer or bool operands whose result PyTorch makes floating point (`ids / 4`,
  `n * 0.5`, `log(n)`) casts those operands first (the frontend divides integers, rounds the
  scalar to an integer, or rejects the op).
- `div` with a rounding mode computes in torch's result dtype (the frontend makes a scalar
  divisor an int32 constant whatever the dividend's dtype).
- `alpha` of add and sub scales the second operand (the frontend ignores it).
- `aten.index` with slices beside two or more index tensors picks with them jointly (the
  frontend took an outer product, or broadcast the slices' ranges with them), and
  `index_put` through slices beside index tensors writes the values in `x[indices]`'s axis
  order (the frontend wrote them transposed where a slice stands between two); values that
  broadcast against the indices are broadcast (relax's index_put reads them out of bounds),
  and fewer indices than axes slice the rest whole (the frontend refused them).
- An integer `arange` counting down gets its true length (TVM types it two too long).
- A negative index of `aten.index` / `index_put` / `select` counts from the end of its axis
  (the frontend reads out of bounds: a Falcon attention picking its key head by `[-2]`, and
  `h[:, -1]`, the last token's state, got garbage).
- Dropout in train mode is applied (the frontend drops it): a seeded mask, `dropout.py`; the
  seed is a variable the import makes an input of `main` (`dropout_seed`).
- `aten.embedding` with a `padding_idx` keeps its value but passes no gradient from the
  positions that hold the padding index, as PyTorch's embedding backward does
  (`relax.grad.no_grad` stops it; tvm_ext registers its gradient as none).

tests/test_torch_import.py runs every aten op the corpus exports against PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from . import dropout

# Ops run in float32 for float16 / bfloat16 inputs: the frontend fixes a float32 result for
# matmuls and convolutions; TVM lowers no bfloat16 layer norm or power; and PyTorch accumulates
# these in float32 on CPU anyway.
_FLOAT32_OPS = (
    "_log_softmax.default",
    "_softmax.default",
    "addmm.default",
    "baddbmm.default",
    "bmm.default",
    "conv1d.default",
    "conv2d.default",
    "conv3d.default",
    "conv_transpose1d.default",
    "conv_transpose2d.input",
    "convolution.default",
    "group_norm.default",
    "layer_norm.default",
    "linear.default",
    "matmul.default",
    "mm.default",
    "native_group_norm.default",
    "native_layer_norm.default",
    "pow.Scalar",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
)
_REDUCED_FLOATS = ("float16", "bfloat16")
# Frontend ops that accumulate in their input dtype where torch promotes (a cumsum of bool
# counts in int64); they run in their result dtype here.
_ACCUMULATING_OPS = ("cumprod.default", "cumsum.default", "prod.default", "prod.dim_int",
                     "sum.default", "sum.dim_IntList")
# Ops PyTorch computes in floating point for integer or bool operands (`ids / 4`, `log(n)`,
# `n * 0.5`), which the frontend computes in the integer dtype or rejects: their integer and
# bool operands are cast to the (floating) result dtype first.
_PROMOTING_OPS = (
    "add.Scalar", "add.Tensor", "cos.default", "cosh.default", "div.Scalar", "div.Tensor",
    "erf.default", "exp.default", "expm1.default", "log.default", "log10.default",
    "log1p.default", "log2.default", "mul.Scalar", "mul.Tensor", "pow.Scalar",
    "pow.Tensor_Scalar", "pow.Tensor_Tensor", "reciprocal.default", "rsqrt.default",
    "rsub.Scalar", "rsub.Tensor", "sigmoid.default", "sin.default", "sinh.default",
    "sqrt.default", "sub.Scalar", "sub.Tensor", "tan.default", "tanh.default",
)
# Ops whose `alpha` scales their second operand, which the frontend ignores.
_ALPHA_OPS = ("add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor",
              "rsub.Scalar")
# torch's grid (N, H_out, W_out, 2), where the frontend passes it to a Relax op that takes it
# as (N, 2, H_out, W_out).
_GRID_SAMPLE_OPS = ("grid_sampler.default", "grid_sampler_2d.default")
# A tensor cut from the gradient (RAFT detaches its flow estimate before each lookup); the
# frontend reads them as the tensor itself.
_DETACH_OPS = ("detach.default", "detach_.default")
# Ops that take a list of index tensors, one per leading axis (None: every index), where
# PyTorch counts a negative index from the end of its axis (the frontend reads out of bounds).
_INDEXING_OPS = ("index.Tensor", "index_put.default", "index_put_.default")


def with_torch_semantics(importer, table: dict) -> dict:
    """The frontend's converter `table` of `importer` with the converters above wrapped."""
    rules = ((_FLOAT32_OPS, _float32_for_reduced, _REDUCED_FLOATS.__contains__),
             (_ACCUMULATING_OPS, _result_dtype, lambda dtype: True),
             (_PROMOTING_OPS, _float_result, _is_integer))
    for names, pick, cast in rules:
        for name in names:
            if name in table:
                table[name] = _computed_in(importer, table[name], pick, cast)
    for name in _ALPHA_OPS:
        if name in table:
            table[name] = _scaled_by_alpha(importer, table[name])
    if "arange.start_step" in table:
        table["arange.start_step"] = _counting_down(importer, table["arange.start_step"])
    if "index.Tensor" in table:
        table["index.Tensor"] = _picking_jointly(importer, table["index.Tensor"])
    for name in ("index_put.default", "index_put_.default"):
        if name in table:
            table[name] = _putting_jointly(importer, table[name])
    for name in _INDEXING_OPS:
        if name in table:
            table[name] = _wrapping_negative_indices(importer, table[name])
    table["embedding.default"] = lambda node: _embedding(importer, node)
    table["select.int"] = lambda node: _select(importer, node)
    table["div.Tensor_mode"] = lambda node: _div_mode(importer, node)
    table["topk.default"] = lambda node: _topk(importer, node)
    table["unfold.default"] = lambda node: _unfold(importer, node)
    for name in _GRID_SAMPLE_OPS:
        table[name] = lambda node: _grid_sample(importer, node)
    for name in _DETACH_OPS:
        table[name] = lambda node: _detach(importer, node)
    for name in _DROPOUT_OPS:
        table[name] = _applying_dropout(importer, table.get(name))
    return table


def _applying_dropout(importer, frontend: Callable | None) -> Callable:
    return lambda node: _dropout(importer, node, frontend)


_DROPOUT_OPS = tuple(f"{name}.default" for name in dropout.OPS)


def _dropout(importer, node, frontend):
    """`x * mask` with the seeded mask of `dropout.mask_compute`, the mask out of the gradient
    (PyTorch's backward multiplies by the same mask: the multiply's own gradient); the k-th
    active dropout of the program is op k of the mask. `native_dropout` also gives the kept
    elements (bool)."""
    p = dropout.active(node)
    if p is None:
        return frontend(node) if frontend is not None else importer.env[node.args[0]]
    bb, x = importer.block_builder, importer.env[node.args[0]]
    seed = getattr(importer, "dropout_seed", None)
    if seed is None:
        seed = importer.dropout_seed = relax.Var(dropout.SEED_INPUT,
                                                 relax.TensorType((), "int64"))
        importer.dropout_count = 0
    op, importer.dropout_count = importer.dropout_count, importer.dropout_count + 1
    shape = [int(d) for d in x.ty.shape]
    mask = bb.emit_te(dropout.mask_compute, seed, op, shape, p, str(x.ty.dtype),
                      primfunc_name_hint="dropout_mask")
    out = bb.emit(relax.op.multiply(x, bb.emit(relax.op.grad.no_grad(mask))))
    if str(node.target) != "aten.native_dropout.default":
        return out
    kept = bb.emit(relax.op.not_equal(mask, relax.const(0, str(x.ty.dtype))))
    return (out, kept)


def _computed_in(importer, convert: Callable, pick: Callable, cast: Callable) -> Callable:
    """`convert` with its tensor arguments whose dtype satisfies `cast` cast to `pick(node)`
    (None: unchanged), and its result cast back to the node's dtype."""

    def wrapped(node):
        dtype, compute = _result_dtype(node), pick(node)
        if compute is None:
            return convert(node)
        casts = {}
        for arg in node.all_input_nodes:
            var = importer.env.get(arg)
            ty = getattr(var, "ty", None)
            if (isinstance(ty, relax.TensorType) and str(ty.dtype) != compute
                    and cast(str(ty.dtype))):
                casts[arg] = relax.op.astype(var, compute)
        if not casts:
            return convert(node)
        out = _with_env(importer, casts, convert, node)
        if isinstance(out.ty, relax.TensorType) and str(out.ty.dtype) != dtype:
            out = importer.block_builder.emit(relax.op.astype(out, dtype))
        return out

    return wrapped


def _scaled_by_alpha(importer, convert: Callable) -> Callable:
    """`convert` of `a op alpha * b` where the node has an `alpha` other than 1."""

    def wrapped(node):
        alpha = node.kwargs.get("alpha", 1)
        other = node.args[1]
        if alpha == 1:
            return convert(node)
        var = importer.env.get(other) if not isinstance(other, (int, float)) else None
        if not isinstance(var, relax.Expr):  # a Python number
            node.args = (node.args[0], other * alpha, *node.args[2:])
            return convert(node)
        const = relax.const(alpha, str(var.ty.dtype))
        return _with_env(importer, {other: relax.op.multiply(var, const)}, convert, node)

    return wrapped


def _wrapping_negative_indices(importer, convert: Callable) -> Callable:
    """`convert` with each integer index tensor `i` of axis `a` read as
    `where(i < 0, i + extent(a), i)`, as PyTorch indexes."""

    def wrapped(node):
        data = importer.env[node.args[0]]
        wrapped_indices = {}
        for axis, index in enumerate(node.args[1]):
            var = importer.env.get(index) if index is not None else None
            dtype = str(var.ty.dtype) if var is not None else "bool"
            if dtype == "bool" or not _is_integer(dtype):
                continue
            extent = data.ty.shape[axis]
            if not isinstance(extent, (int, tvm.tirx.IntImm)):
                raise ValueError(f"{node.target}: indices into axis {axis}, of symbolic "
                                 f"extent {extent}")
            negative = relax.op.less(var, relax.const(0, dtype))
            shifted = relax.op.add(var, relax.const(int(extent), dtype))
            wrapped_indices[index] = relax.op.where(negative, shifted, var)
        return _with_env(importer, wrapped_indices, convert, node)

    return wrapped


def _counting_down(importer, convert: Callable) -> Callable:
    """`arange(start, end, step)` of integers with a negative step as `start + step * arange(n)`:
    TVM types `relax.op.arange` as ceil((end - start + step - 1) / step) long, right only for
    a positive step (Funnel's `arange(16, -16, -1)`: typed 34 long, computed 32). Other
    ranges go to `convert`."""

    def converted(node):
        start, end, step = (node_arg(node, i, name, default) for i, (name, default) in
                            enumerate((("start", 0), ("end", None), ("step", 1))))
        dtype = str(node.kwargs.get("dtype") or "torch.int64").removeprefix("torch.")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step)) \
                or step >= 0 or not _counts(dtype):
            return convert(node)
        count = len(range(start, end, step))
        steps = relax.op.arange(relax.prim_value(0), relax.prim_value(count),
                                relax.prim_value(1), dtype)
        return importer.block_builder.emit(relax.op.add(
            relax.op.multiply(steps, relax.const(step, dtype)), relax.const(start, dtype)))

    return converted


def _picking_jointly(importer, convert: Callable) -> Callable:
    """`aten.index` with slices (None) beside two or more index tensors, as PyTorch reads
    it: the index tensors broadcast together and pick jointly, and their result axes stand
    where the first of them is if they are adjacent, in front otherwise (NumPy's rule). The
    frontend takes them one after another (an outer product) or broadcasts the slices'
    `arange`s with them (ConvBERT's `unfold`, `x[:, :, rows, cols]`, did not import). Other
    index lists go to `convert`."""

    def converted(node):
        data = importer.env[node.args[0]]
        indices = [None if i is None else importer.env[i] for i in node.args[1]]
        layout = _joint_layout(indices, data)
        if layout is None or len(layout[0]) < 2:  # one index tensor: the frontend's `take`
            return convert(node)
        picked, rest, order = layout
        bb = importer.block_builder
        moved = _permuted(bb, data, picked + rest)
        result = bb.emit(relax.op.index_tensor(moved, [indices[a] for a in picked]))
        return _permuted(bb, result, order)

    return converted


def _joint_layout(indices, data) -> tuple[list[int], list[int], list[int]] | None:
    """For an index list with slices (None) and index tensors (relax vars, integer): (the
    indexed axes, the other axes, the order that puts the axes of `index_tensor` over the
    indexed axes moved to the front, [*joint, *others], into PyTorch's: the joint axes where
    the first indexed axis is if the indexed axes are adjacent, in front otherwise); None
    where there is no slice or a mask is among the indices."""
    picked = [axis for axis, index in enumerate(indices) if index is not None]
    if not picked or len(picked) == len(indices):
        return None
    if not all(_counts(str(indices[a].ty.dtype)) for a in picked):  # a mask: its nonzeros
        return None
    rest = [axis for axis in range(len(data.ty.shape)) if axis not in picked]
    joint = max(len(indices[a].ty.shape) for a in picked)
    before = sum(axis < picked[0] for axis in rest)
    if picked != list(range(picked[0], picked[-1] + 1)) or not before:
        return picked, rest, list(range(joint + len(rest)))
    return picked, rest, [*range(joint, joint + before), *range(joint),
                          *range(joint + before, joint + len(rest))]


def _permuted(bb, x, order: list[int]):
    return x if order == sorted(order) else bb.emit(relax.op.permute_dims(x, order))


def _inverse(order: list[int]) -> list[int]:
    """The permutation that undoes `order`."""
    return [order.index(k) for k in range(len(order))]


def _putting_jointly(importer, convert: Callable) -> Callable:
    """`index_put` with slices (None) beside index tensors, as PyTorch reads it (the values
    broadcast to what `x[indices]` would be, in its axis order; see `_picking_jointly`): the
    frontend broadcasts the slices' `arange`s with the indices, which writes the values
    transposed where a slice stands between two index tensors (`y[i, :, j] = v`), and the
    functional `index_put` with a slice did not import. Index lists with every axis indexed
    take the same path (their values broadcast); masks and shapes not known at compile time
    go to `convert`."""

    def converted(node):
        data = importer.env[node.args[0]]
        indices = [None if i is None else importer.env[i] for i in node_arg(node, 1, "indices",
                                                                              [])]
        # Axes past the last index are sliced whole (`y[i, j] = v` of a 3-D y).
        indices += [None] * (len(data.ty.shape) - len(indices))
        values = importer.env.get(node_arg(node, 2, "values", None))
        shapes = [data.ty.shape, *(i.ty.shape for i in indices if i is not None)]
        if values is None or not all(
                isinstance(d, (int, tvm.tirx.IntImm)) for shape in shapes for d in shape):
            return convert(node)
        if all(i is not None and _counts(str(i.ty.dtype)) for i in indices):
            # Every axis indexed: no slice to place, but relax's index_put still reads the
            # values at the indices' joint shape (broadcast values out of bounds), so they
            # are broadcast below as in the sliced case.
            layout = (list(range(len(indices))), [],
                      list(range(max(len(i.ty.shape) for i in indices))))
        else:
            layout = _joint_layout(indices, data)
        if layout is None:
            return convert(node)
        picked, rest, order = layout
        bb = importer.block_builder
        joint = [int(d) for d in np.broadcast_shapes(
            *(tuple(int(d) for d in indices[a].ty.shape) for a in picked))]
        front = [*joint, *(int(data.ty.shape[a]) for a in rest)]  # index_tensor's axes
        torch_shape = [front[k] for k in order]
        values = bb.emit(relax.op.broadcast_to(
            relax.op.astype(values, str(data.ty.dtype)), torch_shape))
        values = _permuted(bb, values, _inverse(order))
        moved = _permuted(bb, data, picked + rest)
        # relax's index_put takes an index per axis: the others' ranges, all broadcasting
        # to [*joint, *others].
        ones = [1] * len(rest)
        every = [bb.emit(relax.op.reshape(indices[a], [*indices[a].ty.shape, *ones]))
                 if ones else indices[a] for a in picked]
        for k, axis in enumerate(rest):
            extent = int(data.ty.shape[axis])
            every.append(bb.emit(relax.op.reshape(
                relax.op.arange(relax.prim_value(0), relax.prim_value(extent),
                                relax.prim_value(1), str(indices[picked[0]].ty.dtype)),
                [extent, *ones[k + 1:]])))
        put = bb.emit(relax.op.index_put(moved, relax.Tuple(every), values,
                                         bool(node_arg(node, 3, "accumulate", False))))
        return _put_in_place(importer, node, data, _permuted(bb, put, _inverse(picked + rest)))

    return converted


def _put_in_place(importer, node, data, output):
    """`output`, the result of an index_put into `data`; for the in-place `index_put_` its
    aliases see it too."""
    if str(node.target).startswith("aten.index_put_"):
        for env_node, expr in list(importer.env.items()):
            if expr is data:
                importer.env[env_node] = output
    return output


def node_arg(node, index: int, name: str, default):
    """Argument `index` of an fx call node, given by position or by `name`, else `default`."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _detach(importer, node):
    """`x.detach()` as `relax.grad.no_grad(x)`: the same values, no gradient through it (a
    training step's Gradient stops there; every build legalizes it to `x`)."""
    return importer.block_builder.emit(relax.op.grad.no_grad(importer.env[node.args[0]]))


def _select(importer, node):
    """`x.select(dim, i)` as a `take` of the scalar index, a negative `i` counted from the end
    of the axis."""
    x = importer.env[node.args[0]]
    dim, index = int(node.args[1]), int(node.args[2])
    extent = x.ty.shape[dim]
    if index < 0:
        if not isinstance(extent, (int, tvm.tirx.IntImm)):
            raise ValueError(f"{node.target}: index {index} into axis {dim}, of symbolic "
                             f"extent {extent}")
        index += int(extent)
    return importer.block_builder.emit(relax.op.take(x, relax.const(index, "int64"), dim))


def _topk(importer, node):
    """`torch.topk` in sorted order whatever `sorted` asks: an unsorted topk's order is
    unspecified, and the sorted one is one of its orders (the frontend refused `sorted=False`)."""
    x = importer.env[node.args[0]]
    k = int(node_arg(node, 1, "k", 1))
    dim = int(node_arg(node, 2, "dim", -1))
    largest = bool(node_arg(node, 3, "largest", True))
    return importer.block_builder.emit(
        relax.op.topk(x, k=k, axis=dim, largest=largest, ret_type="both", dtype="int64"))


def _unfold(importer, node):
    """`x.unfold(dim, size, step)`: the windows `x[..., i * step : i * step + size, ...]` along
    `dim`, counted at `dim`, each window's elements on a new last axis; one `take` of an
    (n, size) index table, so the gradient is take's (overlapping windows add up)."""
    bb, op = importer.block_builder, relax.op
    x = importer.env[node.args[0]]
    rank = len(x.ty.shape)
    dim, size, step = (int(a) for a in node.args[1:4])
    dim %= max(rank, 1)
    extent = x.ty.shape[dim] if rank else 1
    if not isinstance(extent, (int, tvm.tirx.IntImm)):
        raise ValueError(f"{node.target}: windows along axis {dim}, of symbolic extent {extent}")
    if size > int(extent) or step <= 0:
        raise ValueError(f"{node.target}: windows of {size} every {step} along an axis of "
                         f"{int(extent)}")
    if rank == 0:  # one window of the one element
        return bb.emit(op.reshape(x, (1,)))
    count = (int(extent) - size) // step + 1
    starts = op.multiply(op.arange(0, count, 1, "int64"), relax.const(step, "int64"))
    table = op.add(op.expand_dims(starts, 1), op.arange(0, size, 1, "int64"))
    picked = bb.emit(op.take(x, bb.emit(table), dim))  # (..., count, size, ...)
    order = [a for a in range(rank + 1) if a != dim + 1] + [dim + 1]
    return _permuted(bb, picked, order)


def _div_mode(importer, node):
    """`torch.div(a, b, rounding_mode=...)` in torch's result dtype, a scalar `b` a constant of
    that dtype; "trunc" of integers is their (truncating) integer division."""
    bb, op = importer.block_builder, relax.op
    dtype = _result_dtype(node)
    a, b = importer.env[node.args[0]], node.args[1]
    b = importer.env[b] if b in importer.env else relax.const(b, dtype)
    a, b = (x if str(x.ty.dtype) == dtype else bb.emit(op.astype(x, dtype)) for x in (a, b))
    mode = node_arg(node, 2, "rounding_mode", None)
    if mode == "floor":
        return bb.emit(op.floor_divide(a, b))
    if mode == "trunc" and _is_integer(dtype):
        return bb.emit(op.divide(a, b))
    if mode == "trunc":
        return bb.emit(op.trunc(op.divide(a, b)))
    if mode is None:
        return bb.emit(op.divide(a, b))
    raise ValueError(f"{node.target}: rounding mode {mode!r}")


def _grid_sample(importer, node):
    """`F.grid_sample` of an image: torch's grid is (N, H_out, W_out, 2), the Relax op's (and
    TVM's kernel's) (N, 2, H_out, W_out), so the grid is permuted first; the frontend passed
    it as it is and sampled at the wrong points, into the wrong shape."""
    bb, op = importer.block_builder, relax.op
    data, grid = importer.env[node.args[0]], importer.env[node.args[1]]
    if len(grid.ty.shape) != 4:
        raise ValueError(f"{node.target}: a volumetric (5-D) grid_sample")
    modes = [node_arg(node, i, name, 0) for i, name in
             ((2, "interpolation_mode"), (3, "padding_mode"))]
    align = bool(node_arg(node, 4, "align_corners", False))
    method = ("bilinear", "nearest", "bicubic")[modes[0]]
    padding = ("zeros", "border", "reflection")[modes[1]]
    grid = bb.emit(op.permute_dims(grid, [0, 3, 1, 2]))
    return bb.emit(op.image.grid_sample(data, grid, method=method, layout="NCHW",
                                        padding_mode=padding, align_corners=align))


def _with_env(importer, values: dict, convert: Callable, node):
    """`convert(node)` with the fx nodes in `values` bound to those expressions."""
    saved = {n: importer.env[n] for n in values}
    for n, expr in values.items():
        importer.env[n] = importer.block_builder.emit(expr)
    try:
        return convert(node)
    finally:
        importer.env.update(saved)


def _embedding(importer, node):
    """The frontend's lookup, with the positions holding `padding_idx` cut off from the
    gradient (PyTorch gives the padding row none from them): `where(is_pad, no_grad(e), e)` is
    `e` in value, and its gradient reaches `e` only elsewhere."""
    bb, op = importer.block_builder, relax.op
    ids = importer.env[node.args[1]]
    out = importer._embedding_impl(ids, importer.env[node.args[0]])
    pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    if pad is None or pad < 0:  # aten's -1: no padding row
        return out
    is_pad = bb.emit(op.equal(ids, relax.const(pad, str(ids.ty.dtype))))
    is_pad = bb.emit(op.expand_dims(is_pad, -1))
    return bb.emit(op.where(is_pad, bb.emit(op.grad.no_grad(out)), out))


def _float_result(node) -> str | None:
    dtype = _result_dtype(node)
    return dtype if dtype is not None and dtype.startswith(("float", "bfloat")) else None


def _is_integer(dtype: str) -> bool:
    return dtype == "bool" or dtype.startswith(("int", "uint"))


def _counts(dtype: str) -> bool:
    """An integer dtype that counts (an index, a range), not bool (which `_is_integer` takes
    in: a mask)."""
    return dtype != "bool" and _is_integer(dtype)


def _float32_for_reduced(node) -> str | None:
    return "float32" if _result_dtype(node) in _REDUCED_FLOATS else None


def _result_dtype(node) -> str | None:
    """The dtype of the node's (first) result."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)) and val:
        val = val[0]
    dtype = getattr(val, "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")
