"""The tvm_ext model zoo and model loading.

`get_model(name, size, training=False, **overrides)` builds a zoo model (`mlp`, `gpt`,
`resnet`) at a named size, with any size field overridden; `load_model(spec)` also accepts a
model file (.pt2, .onnx, .py). Every model is one Relax function `main(inputs..., params...)`;
its training step is `main(inputs..., labels, params...) -> (loss, grads...)`.
"""

from __future__ import annotations

import os

from . import gpt, mlp, resnet
from .base import Model, TensorSpec, make_training_step
from .loaders import SUFFIXES, ModelLoadError, load_file

ZOO = {"mlp": mlp, "gpt": gpt, "resnet": resnet}

__all__ = [
    "ZOO",
    "Model",
    "ModelLoadError",
    "TensorSpec",
    "get_model",
    "list_models",
    "load_model",
    "make_training_step",
]


def list_models() -> dict[str, list[str]]:
    """Zoo model names and their sizes."""
    return {name: list(module.SIZES) for name, module in ZOO.items()}


def get_model(name: str, size: str = "tiny", training: bool = False, *,
              loss_scale: bool = False, **overrides) -> Model:
    """A zoo model at a named size, fields overridden by keyword (e.g. `layers=24`); with
    `training`, its training step (`loss_scale`: see `make_training_step`)."""
    if name not in ZOO:
        raise ModelLoadError(f"unknown model {name!r}; zoo models: {', '.join(ZOO)}, "
                             f"or a file ending in {', '.join(SUFFIXES)}")
    module = ZOO[name]
    if size not in module.SIZES:
        raise ModelLoadError(f"unknown size {size!r} for {name}; sizes: "
                             f"{', '.join(module.SIZES)}")
    config = dict(module.SIZES[size])
    unknown = set(overrides) - set(config)
    if unknown:
        raise ModelLoadError(f"{name} has no field {', '.join(sorted(unknown))}; fields: "
                             f"{', '.join(config)}")
    config.update(overrides)
    extra = {"training": training} if name == "resnet" else {}
    model = module.build(**config, **extra)
    model.config["size"] = size
    return make_training_step(model, loss_scale=loss_scale) if training else model


def load_model(spec: str, size: str = "tiny", training: bool = False, *,
               loss_scale: bool = False, **overrides) -> Model:
    """A zoo model by name, or a model file by path."""
    if spec in ZOO:
        return get_model(spec, size, training, loss_scale=loss_scale, **overrides)
    if spec.lower().endswith(SUFFIXES) or os.path.sep in spec:
        model = load_file(spec, **overrides)
        return make_training_step(model, loss="mse", loss_scale=loss_scale) if training \
            else model
    # raises the unknown-model error
    return get_model(spec, size, training, loss_scale=loss_scale, **overrides)
