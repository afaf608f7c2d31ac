"""Export helpers shared by the zoo models built with `tvm.relax.frontend.nn`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.core import wrap_nested

from .base import Model, TensorSpec, default_param_spec, model_from_function

ParamInit = Callable[[str, tuple, str], TensorSpec]


def relax_op(expr: relax.Expr, name: str) -> nn.Tensor:
    """Use a Relax operator that `nn.op` does not wrap (mean, pooling, batch norm...)."""
    return wrap_nested(expr, name)


class Embedding(nn.Embedding):
    """`nn.Embedding` whose lookup clips an id outside the table to its first or last row:
    `nn.op.take` asks for TVM's "fast" mode, which reads outside the table for such an id
    (and says so in a warning at every build). Clipping costs two integer ops per row."""

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        flat = x if x.ndim == 1 else nn.op.reshape(x, shape=[-1])
        rows = relax_op(relax.op.take(self.weight._expr, flat._expr, axis=0, mode="clip"),
                        "take")
        return rows if x.ndim == 1 else nn.op.reshape(rows, shape=[*x.shape,
                                                                   self.weight.shape[1]])


def export(
    name: str,
    module: nn.Module,
    inputs: Sequence[TensorSpec],
    config: dict | None = None,
    init: ParamInit = default_param_spec,
) -> Model:
    """Export `module.forward` as `main(inputs..., params...)`."""
    spec = {"forward": {s.name: nn.spec.Tensor(list(s.shape), s.dtype) for s in inputs}}
    mod, _ = module.export_tvm(spec=spec)
    func = mod["forward"]
    params = [
        init(v.name, tuple(int(d) for d in v.ty.shape.values), str(v.ty.dtype))
        for v in func.params[len(inputs):]
    ]
    return model_from_function(name, func, len(inputs), list(inputs), params, config)
