"""Converters of the ops a mixture-of-experts layer exports that TVM's torch frontend lacks.

`transformers` (5.x) routes tokens to experts by sorting them by expert, counting each
expert's tokens with `aten.histc`, and multiplying each expert's run of rows by its weight
with its own custom op `transformers::grouped_mm_fallback(input, weight, offs)` (rows
`offs[e-1]:offs[e]` times `weight[e]`; rows past `offs[-1]` zero).

- `histc` counts with PyTorch's binning: bin `floor((x - min) / (max - min) * bins)`, `max`
  itself in the last bin, values outside `[min, max]` not counted; `min == max` takes the
  data's own range.
- `grouped_mm_fallback` is each row's expert found from `offs`, and the sum over experts of
  `mask_e * (input @ weight[e])`. It is made of ops with gradients (a training step
  differentiates it, the planners split it) at the price of computing every expert's product
  for every row: E times the FLOPs of the grouped product, and an (E, S, N) intermediate.
"""

from __future__ import annotations

from tvm import relax

from .torch_converters import node_arg

_REDUCED_FLOATS = ("float16", "bfloat16")


def add_moe_converters(importer, table: dict) -> dict:
    """`table` (the frontend's converters) with the ops above added."""
    table["histc.default"] = lambda node: _histc(importer, node)
    table["grouped_mm_fallback.default"] = lambda node: _grouped_mm(importer, node)
    return table


def _static(expr, what: str) -> list[int]:
    try:
        return [int(d) for d in expr.ty.shape]
    except (TypeError, AttributeError) as err:
        raise ValueError(f"{what}: a symbolic shape {expr.ty.shape}") from err


def _histc(importer, node):
    bb, op = importer.block_builder, relax.op
    x = importer.env[node.args[0]]
    bins = int(node_arg(node, 1, "bins", 100))
    lo, hi = float(node_arg(node, 2, "min", 0)), float(node_arg(node, 3, "max", 0))
    dtype = str(x.ty.dtype)
    size = 1
    for d in _static(x, f"{node.target}"):
        size *= d
    flat = bb.emit(op.astype(op.reshape(x, (size,)), "float32"))
    if lo == hi:  # the data's own range (an empty range widened by one, as torch does)
        low, high = bb.emit(op.min(flat)), bb.emit(op.max(flat))
        same = bb.emit(op.equal(low, high))
        one = relax.const(1.0, "float32")
        low = bb.emit(op.where(same, op.subtract(low, one), low))
        high = bb.emit(op.where(same, op.add(high, one), high))
    else:
        low, high = relax.const(lo, "float32"), relax.const(hi, "float32")
    scaled = op.multiply(op.divide(op.subtract(flat, low), op.subtract(high, low)),
                         relax.const(float(bins), "float32"))
    pos = bb.emit(op.astype(op.floor(scaled), "int64"))
    last = relax.const(bins - 1, "int64")
    pos = bb.emit(op.minimum(pos, last))  # `max` itself falls in the last bin
    inside = bb.emit(op.logical_and(op.greater_equal(flat, low), op.less_equal(flat, high)))
    ids = op.arange(0, bins, 1, "int64")
    hit = op.logical_and(op.equal(op.expand_dims(ids, 1), op.expand_dims(pos, 0)),
                         op.expand_dims(inside, 0))
    counts = op.sum(op.astype(hit, "int64"), axis=[1])
    return bb.emit(op.astype(counts, dtype))


def _grouped_mm(importer, node):
    bb, op = importer.block_builder, relax.op
    x = importer.env[node.args[0]]
    weight = importer.env[node.args[1]]
    offs = importer.env[node.args[2]]
    rows, _ = _static(x, f"{node.target} input")
    experts, depth, _ = _static(weight, f"{node.target} weight")
    dtype = str(x.ty.dtype)
    compute = "float32" if dtype in _REDUCED_FLOATS else dtype
    # Row s belongs to the expert whose run holds it: the number of run ends at or before s.
    row = op.expand_dims(op.arange(0, rows, 1, "int64"), 1)
    ends = op.expand_dims(op.astype(offs, "int64"), 0)
    expert = bb.emit(op.sum(op.astype(op.greater_equal(row, ends), "int64"), axis=[1]))
    mask = op.equal(op.expand_dims(op.arange(0, experts, 1, "int64"), 1),
                    op.expand_dims(expert, 0))
    mask = bb.emit(op.expand_dims(op.astype(mask, compute), 2))  # (E, S, 1)
    lhs = op.broadcast_to(op.expand_dims(op.astype(x, compute), 0), (experts, rows, depth))
    prod = bb.emit(op.matmul(lhs, op.astype(weight, compute)))  # (E, S, N)
    out = bb.emit(op.sum(op.multiply(prod, mask), axis=[0]))
    return bb.emit(op.astype(out, dtype)) if compute != dtype else out
