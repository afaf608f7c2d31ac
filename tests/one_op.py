"""A Relax module of one operator over fresh parameters, for the tests of what the pipeline
makes of a single op (its legalized kernel, its fusion, its library dispatch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tvm
from tvm import relax


def one_op_module(build: Callable, *shapes, dtypes: Sequence[str] | None = None
                  ) -> tvm.IRModule:
    """`main(x0, x1, ...)` returning `build(x0, x1, ...)`, parameter i of shape `shapes[i]`
    and dtype `dtypes[i]` (float32 by default)."""
    dtypes = dtypes or ["float32"] * len(shapes)
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(s, d))
              for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build(*params))
        bb.emit_func_output(out)
    return bb.get()


def _decoder(a, b):
    a4 = relax.op.reshape(relax.op.permute_dims(a, [0, 2, 1]), (1, 16, 8, 8))
    up = relax.op.image.resize2d(a4, (16, 16), layout="NCHW", method="linear")
    return relax.op.concat([up, relax.op.multiply(b, relax.const(2.0))], axis=1)


def decoder_module() -> tvm.IRModule:
    """SegFormer's decoder in small: a feature map transposed, reshaped and upsampled (a
    bilinear resize reads its input at computed rows) and concatenated along the channels with
    a second map; fusion makes one kernel of it all, which no split in time fits at small
    budgets while its parts do (kernel fission)."""
    return one_op_module(_decoder, (1, 64, 16), (1, 16, 16, 16))
