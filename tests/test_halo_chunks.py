"""Chunks of a dim read through windows (`tvm_ext.ir.halo_chunks`): a convolution's or a
pooling's output rows computed a chunk at a time from the chunk's input range (halo rows
included, rows outside the tensor never read) equal the rows of the whole kernel."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from kernel_chunks import fused_kernel
from tvm import relax

from tvm_ext.ir.halo_chunks import chunk_rows
from tvm_ext.ir.local_kernels import LoweringError, chunk_params, local_kernel, lowering_obstacle

LLVM = tvm.target.Target("llvm")


_kernel = fused_kernel  # the one fused PrimFunc of build(*params), analysed


def _run(func, arrays, scalars, out_shape):
    f = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), LLVM)
    out = tvm.runtime.empty(out_shape, "float32")
    f["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays], *scalars, out)
    return out.numpy()


def _rows_dim(kd, out_axis: int = 2) -> int:
    (d,) = [d for d, dim in enumerate(kd.spec.dims) if dim.outputs == [out_axis]]
    return d


CASES = {
    # ResNet's stem: 7x7, stride 2, padding 3 (a pad block whose rows are a window variable).
    "conv_stem": (lambda x, w: relax.op.nn.relu(relax.op.nn.conv2d(x, w, strides=2, padding=3)),
                  [(2, 3, 32, 32), (8, 3, 7, 7)]),
    # A ResNet block's 3x3 convolution, stride 1, padding 1, then a bias.
    "conv_3x3": (lambda x, w, b: relax.op.add(relax.op.nn.conv2d(x, w, padding=1), b),
                 [(1, 4, 16, 10), (6, 4, 3, 3), (1, 6, 1, 1)]),
    "max_pool": (lambda x: relax.op.nn.max_pool2d(x, 3, strides=2, padding=1),
                 [(2, 4, 16, 16)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("parts", [2, 4, 8])
def test_each_row_chunk_from_its_input_range_equals_the_kernels_rows(name, parts):
    build, shapes = CASES[name]
    kd = _kernel(build, *shapes)
    d = _rows_dim(kd)
    spec = kd.spec.dims[d]
    assert lowering_obstacle(kd, d) is not None  # across devices: a halo exchange, refused
    assert lowering_obstacle(kd, d, allow_halo=True) is None
    if spec.extent % parts:
        pytest.skip(f"{spec.extent} rows do not divide by {parts}")
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype("float32") for s in shapes]
    params = [p for p in kd.func.params if getattr(p, "shape", None) is not None]
    out_shape = [int(n) for n in params[-1].shape]
    whole = _run(kd.func, inputs, [], out_shape)
    local = local_kernel(kd, {d: parts}, halo=True)
    assert chunk_params(local) == [d]
    (i, cut), = [(i, c) for i, c in enumerate(spec.inputs) if c is not None]
    axis, lo, hi = cut.axis, cut.halo_lo, cut.halo_hi
    n = shapes[i][axis]
    rows = chunk_rows(n, parts, lo, hi)
    step, s = n // parts, out_shape[2] // parts
    for c in range(parts):
        start = c * step - lo
        chunk = np.zeros([*shapes[i][:axis], rows, *shapes[i][axis + 1:]], "float32")
        a, b = max(start, 0), min(start + rows, n)
        chunk[:, :, a - start:b - start] = inputs[i][:, :, a:b]
        args = [chunk if k == i else x for k, x in enumerate(inputs)]
        got = _run(local, args, [c], [*out_shape[:2], s, *out_shape[3:]])
        np.testing.assert_array_equal(got, whole[:, :, c * s:(c + 1) * s])


def test_two_windowed_dims_at_once_are_refused():
    build, shapes = CASES["conv_stem"]
    kd = _kernel(build, *shapes)
    rows, cols = _rows_dim(kd, 2), _rows_dim(kd, 3)
    with pytest.raises(LoweringError, match="more than one windowed dim"):
        local_kernel(kd, {rows: 2, cols: 2}, halo=True)
