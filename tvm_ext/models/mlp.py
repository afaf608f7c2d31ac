"""`mlp`: a multi-layer perceptron classifier (Linear -> GELU -> ... -> Linear)."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ._nn import export
from .base import Model, TensorSpec

SIZES = {
    # name: batch, in_features, hidden, layers, classes
    "tiny": dict(batch=4, features=16, hidden=32, layers=2, classes=8),
    "small": dict(batch=64, features=256, hidden=512, layers=4, classes=64),
    "medium": dict(batch=256, features=1024, hidden=4096, layers=8, classes=1000),
    # ~3.9 GB of weights: planning only on this machine.
    "large": dict(batch=1024, features=4096, hidden=8192, layers=16, classes=1000),
    "xl": dict(batch=2048, features=8192, hidden=16384, layers=16, classes=1000),
    # 48 layers of 8192: ~12 GB of weights, ~340 fused ops in training: planning only.
    "deep": dict(batch=1024, features=4096, hidden=8192, layers=48, classes=1000),
}


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int, classes: int):
        dims = [features] + [hidden] * (layers - 1) + [classes]
        self.layers = nn.ModuleList(
            [nn.Linear(dims[i], dims[i + 1]) for i in range(len(dims) - 1)]
        )

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = op.gelu(x)
        return x


def build(batch: int, features: int, hidden: int, layers: int, classes: int) -> Model:
    if layers < 1:
        raise ValueError("mlp needs at least one layer")
    config = dict(batch=batch, features=features, hidden=hidden, layers=layers, classes=classes)
    x = TensorSpec("x", (batch, features), "float32")
    return export("mlp", MLP(features, hidden, layers, classes), [x], config)
