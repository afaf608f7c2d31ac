"""`resnet`: a (wide) residual network of basic blocks: conv3x3 -> batch norm -> ReLU, with a
1x1 projection on the shortcut where the shape changes, max-pooled stem, global average pool."""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ._nn import export, relax_op
from .base import Model, TensorSpec, default_param_spec

SIZES = {
    "tiny": dict(batch=2, image=16, widths=(8, 16), blocks=(1, 1), classes=10),
    "small": dict(batch=8, image=32, widths=(16, 32, 64), blocks=(2, 2, 2), classes=10),
    "medium": dict(batch=32, image=64, widths=(64, 128, 256), blocks=(2, 2, 2), classes=100),
    # ResNet-34 layout, widened 4x (WRN-34-4 class): activations of many GB, planning only.
    "large": dict(batch=64, image=224, widths=(256, 512, 1024, 2048), blocks=(3, 4, 6, 3),
                  classes=1000),
    # Wide ResNet in the SwapAdvisor range: WRN-74-10 on 32x32 images (widths 16/32/64 x 10,
    # 12 blocks per stage), ~1,600 fused ops in training: planning only.
    "wide": dict(batch=128, image=32, widths=(160, 320, 640), blocks=(12, 12, 12), classes=100),
}


class BatchNorm2d(nn.Module):
    """Batch norm over NCHW channels; batch statistics when `training`, running ones otherwise."""

    def __init__(self, channels: int, training: bool):
        self.weight = nn.Parameter((channels,), "float32")
        self.bias = nn.Parameter((channels,), "float32")
        self.running_mean = nn.Parameter((channels,), "float32")
        self.running_var = nn.Parameter((channels,), "float32")
        self.training = training

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        out = relax.op.nn.batch_norm(
            x._expr, self.weight._expr, self.bias._expr, self.running_mean._expr,
            self.running_var._expr, axis=1, training=self.training,
        )
        return relax_op(relax.TupleGetItem(out, 0), "bn")


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, training: bool):
        self.conv1 = nn.Conv2D(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = BatchNorm2d(cout, training)
        self.conv2 = nn.Conv2D(cout, cout, 3, padding=1, bias=False)
        self.bn2 = BatchNorm2d(cout, training)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2D(cin, cout, 1, stride=stride, bias=False)
            self.bn_sc = BatchNorm2d(cout, training)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = op.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        skip = x if self.shortcut is None else self.bn_sc(self.shortcut(x))
        return op.relu(y + skip)


class ResNet(nn.Module):
    def __init__(self, widths, blocks, classes: int, training: bool):
        self.stem = nn.Conv2D(3, widths[0], 3, padding=1, bias=False)
        self.bn = BatchNorm2d(widths[0], training)
        layers, cin = [], widths[0]
        for stage, (width, count) in enumerate(zip(widths, blocks, strict=True)):
            for i in range(count):
                stride = 2 if (stage > 0 and i == 0) else 1
                layers.append(BasicBlock(cin, width, stride, training))
                cin = width
        self.layers = nn.ModuleList(layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        x = op.relu(self.bn(self.stem(x)))
        x = relax_op(relax.op.nn.max_pool2d(x._expr, 3, 2, 1), "maxpool")
        for layer in self.layers:
            x = layer(x)
        pooled = relax_op(relax.op.mean(x._expr, axis=[2, 3]), "gap")
        return self.fc(pooled)


def _init(name: str, shape: tuple, dtype: str) -> TensorSpec:
    if "bn" in name and name.endswith("weight"):
        return TensorSpec(name, shape, dtype, init="ones")
    return default_param_spec(name, shape, dtype)


def build(batch: int, image: int, widths, blocks, classes: int, training: bool = False) -> Model:
    widths, blocks = tuple(int(w) for w in widths), tuple(int(b) for b in blocks)
    if len(widths) != len(blocks) or not widths:
        raise ValueError("resnet needs one block count per stage width")
    config = dict(batch=batch, image=image, widths=list(widths), blocks=list(blocks),
                  classes=classes)
    x = TensorSpec("x", (batch, 3, image, image), "float32")
    model = ResNet(widths, blocks, classes, training)
    return export("resnet", model, [x], config, init=_init)
