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
