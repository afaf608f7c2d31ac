"""Models from files: a torch `ExportedProgram` (.pt2), an ONNX model (.onnx), or a Python file
(.py) whose `get_model(**kwargs)` returns a `Model`, an `IRModule` with `main`, or a pair
`(nn.Module, {input_name: TensorSpec | (shape, dtype)})`."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import tvm
from tvm import relax

from ..errors import InputError, install_hint
from .base import Model, TensorSpec, model_from_function

SUFFIXES = (".pt2", ".onnx", ".py")


class ModelLoadError(InputError):
    """A model file that is missing, of an unknown kind, does not parse, or parses but the TVM
    frontend cannot import it (or tvm_ext cannot use what it imports)."""


def load_file(path: str, **kwargs) -> Model:
    """Load the model in `path` (its kind from the suffix)."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"model file {path} does not exist")
    suffix = os.path.splitext(path)[1].lower()
    loader = {".pt2": _load_pt2, ".onnx": _load_onnx, ".py": _load_py}.get(suffix)
    if loader is None:
        raise ModelLoadError(f"{path}: unknown model file kind {suffix!r}; expected one of "
                             f"{', '.join(SUFFIXES)}")
    try:
        return loader(path, **kwargs)
    except ModelLoadError:
        raise
    except ImportError as err:
        raise ModelLoadError(f"{path}: {err}; {install_hint('torch')}") from err
    except Exception as err:
        raise ModelLoadError(f"{path} does not parse as a {suffix} model: "
                             f"{type(err).__name__}: {err}") from err


def _cannot_import(path: str, err: Exception) -> ModelLoadError:
    return ModelLoadError(f"{path}: the TVM frontend cannot import this model: "
                          f"{type(err).__name__}: {err}")


def _with_weights(name: str, mod: tvm.IRModule, path: str, config: dict | None = None,
                  aliases: dict[str, str] | None = None,
                  constants: set[str] | None = None) -> Model:
    """A frontend module whose `main` carries its weights in the `params` attribute; each
    parameter `aliases` names becomes the one it is tied to, each `constants` names a
    constant."""
    mod, params = relax.frontend.detach_params(mod)
    weights = [np.asarray(w.numpy()) for w in params.get("main", [])]
    if aliases:
        mod, weights = _without_aliases(mod, weights, aliases)
    if constants:
        mod, weights = _bound_constants(mod, weights, constants)
    func = mod["main"]
    num_input = int(func.attrs["num_input"])
    config = {"file": os.path.abspath(path), **(config or {})}
    try:
        model = model_from_function(name, func, num_input, config=config, module=mod)
    except ValueError as err:  # e.g. a symbolic shape
        raise ModelLoadError(f"{path}: tvm_ext cannot use this model: {err}") from err
    if len(weights) != len(model.params):
        raise ModelLoadError(f"{path}: {len(weights)} weights for {len(model.params)} parameters")
    model.weights = weights
    return model


def _without_aliases(mod: tvm.IRModule, weights: list, aliases: dict[str, str]
                     ) -> tuple[tvm.IRModule, list]:
    """`main` with each parameter `aliases` names replaced by the one it is tied to."""
    func = mod["main"]
    num_input = int(func.attrs["num_input"])
    by_name = {p.name: p for p in func.params[num_input:]}
    merge = {by_name[a]: by_name[k] for a, k in aliases.items()
             if a in by_name and k in by_name}
    if not merge:
        return mod, weights
    kept = [k for k, p in enumerate(func.params[num_input:]) if p not in merge]
    mod = mod.clone()
    mod["main"] = func.bind_params(merge)
    return mod, [weights[k] for k in kept]


def _bound_constants(mod: tvm.IRModule, weights: list, names: set[str]
                     ) -> tuple[tvm.IRModule, list]:
    """`main` with the parameters `names` names bound to their weights, as constants."""
    func = mod["main"]
    num_input = int(func.attrs["num_input"])
    params = func.params[num_input:]
    # The dtype given: `relax.const` makes int64 arrays int32 by default.
    bound = {p: relax.const(w, str(w.dtype)) for p, w in zip(params, weights, strict=True)
             if p.name in names}
    if not bound:
        return mod, weights
    mod = mod.clone()
    mod["main"] = func.bind_params(bound)
    return mod, [w for p, w in zip(params, weights, strict=True) if p not in bound]


def _load_pt2(path: str, **_) -> Model:
    from . import pt2_files
    from .torch_import import import_exported_program, reorder_outputs

    try:
        program = pt2_files.load_program(path)
    except pt2_files.Pt2ParseError as err:
        raise ModelLoadError(f"{path} does not parse as a .pt2 model: {err}") from err
    container, names = pt2_files.output_names(program)
    order = pt2_files.logits_first(names)
    try:
        with pt2_files.quiet_torch():
            mod, mode = import_exported_program(program)
        mod = reorder_outputs(mod, order)
    except Exception as err:
        raise _cannot_import(path, err) from err
    # The training step follows the mode the module was exported in.
    config = {"export_mode": mode} if mode else {}
    if container is not None:  # said by the CLI: which tensors of the container are outputs
        config.update(returns=container, outputs=[names[i] for i in order])
    aliases = pt2_files.tied_aliases(program)
    if aliases:  # one argument, trained as PyTorch trains the one tensor
        config["tied_parameters"] = aliases
    return _with_weights(os.path.basename(path), mod, path, config, aliases)


def _load_onnx(path: str, **_) -> Model:
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    from . import onnx_files
    from .onnx_converters import onnx_converters

    try:
        proto = onnx.load(path)
        onnx.checker.check_model(proto)
    except Exception as err:
        raise ModelLoadError(f"{path} does not parse as a .onnx model: "
                             f"{type(err).__name__}: {err}") from err
    proto, weight_names = onnx_files.with_identifier_names(proto)
    proto, negative_perms = onnx_files.with_perms_in_range(proto)
    constants = onnx_files.torch_non_parameters(proto)
    config: dict = {"onnx_weight_names": weight_names} if weight_names else {}
    notes = [f"{negative_perms} Transpose perms count dims from the end, which ONNX Runtime "
             "and ONNX's shape inference refuse: read as counted from the start (as torch's "
             "permute reads them), here and for --check"] if negative_perms else []
    def frontend(proto):
        with onnx_converters():
            return from_onnx(proto, keep_params_in_input=True)

    try:
        mod = frontend(proto)
        unknown = _unknown_shapes(mod)
        if unknown:
            raise ModelLoadError(f"{unknown} has a shape known only at run time")
    except Exception as err:
        # Exporters compute reshapes, pads and slices from `Shape` ops (torch's TorchScript
        # exporter does for BART, Swin, MobileNetV1, GEGLU's chunk): at static shapes they are
        # constants, which onnxsim folds where TVM's frontend would need them folded already
        # (or imports them as shapes known at run time only, which no planner can size).
        simplified = onnx_files.simplified(proto)
        if simplified is None:
            raise _cannot_import(path, err) from err
        try:
            mod = frontend(simplified)
        except Exception:
            raise _cannot_import(path, err) from err
        if _unknown_shapes(mod):
            raise _cannot_import(path, err) from err
        notes.append(
            f"the TVM frontend cannot import the file as written ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160]}); imported after onnxsim folded its constant "
            "subgraphs (batch norms left unfused)")
    if notes:
        config["import_note"] = "; ".join(notes)
    # What torch's exporter marks as buffers and constants is what a .pt2 of the same module
    # holds as constants: neither trained nor counted among the parameters.
    return _with_weights(os.path.basename(path), mod, path, config, constants=constants)


def _unknown_shapes(mod: tvm.IRModule) -> str | None:
    """The name of the first value of `mod`'s Relax functions whose tensor shape is not all
    constants where their parameters' are, or None (a model with inputs of symbolic shape is
    refused by name later)."""
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr) \
                or not all(_static(p.ty) for p in func.params):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                if not _static(binding.var.ty):
                    return binding.var.name
    return None


def _static(ty) -> bool:
    """A type that is not a tensor, or a tensor of constant shape."""
    return not isinstance(ty, relax.TensorType) or (
        isinstance(ty.shape, relax.ShapeExpr)
        and all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values))


def _load_py(path: str, **kwargs) -> Model:
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"tvm_ext_user_model_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    get_model = getattr(module, "get_model", None)
    if get_model is None:
        raise ModelLoadError(f"{path} defines no get_model()")
    result = get_model(**kwargs)
    if isinstance(result, Model):
        return result
    if isinstance(result, tvm.IRModule):
        if "main" not in [gv.name_hint for gv in result.functions]:
            raise ModelLoadError(f"{path}: get_model() returned an IRModule without 'main'")
        func = result["main"]
        num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs \
            else len(func.params)
        return model_from_function(name, func, num_input, config={"file": path})
    if isinstance(result, tuple) and len(result) == 2:
        from ._nn import export

        module_, inputs = result
        specs = [s if isinstance(s, TensorSpec) else TensorSpec(k, tuple(s[0]), s[1])
                 for k, s in inputs.items()]
        return export(name, module_, specs, {"file": path})
    raise ModelLoadError(f"{path}: get_model() returned {type(result).__name__}; expected a "
                         "Model, an IRModule or (nn.Module, input specs)")
