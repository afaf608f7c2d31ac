"""The half of benchmarks/vs_torch_gpu.py that runs here, with TVM's compiler: each model of
benchmarks/vs_torch.py built at a size, exported with `torch.export`, imported into Relax in
memory (the parameters stay DLPack views of the torch module's: no copy of the weights is
made, and all of them are freed once the Relax module exists), its inference or its training
step with AdamW compiled, and exported. What `run` needs beside the module goes into the
folder's manifest: the `transformers` class and config, the torch name of every parameter the
module takes (from the export's graph signature), the specs and seed its inputs and labels are
drawn from, the optimizer, and the buffers (they are folded into the module as constants, and
the torch model there must hold the same). No weight travels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import resource
import time

import numpy as np
from vs_torch_gpu_measure import (
    FIELDS,
    INIT_KWARGS,
    INPUT_KINDS,
    MANIFEST,
    OPTIMIZER,
    entry_key,
    loss_of,
    module_file,
)


@dataclasses.dataclass
class Imported:
    """A model imported for tvm_ext: the forward `Model`, and per parameter it takes the
    torch name (tied parameters appear once, under the first name the export gives them)."""

    model: object  # tvm_ext.models.Model
    parameters: list[str]
    tied: dict[str, str]  # a tied parameter's other names -> the name kept


def import_program(name: str, program) -> Imported:
    """`program` (a torch ExportedProgram) as a tvm_ext forward model, parameters as
    arguments. Tied parameters (one tensor under two names: GPT-2's embedding and head)
    become one argument, as they are one parameter to torch and to its optimizer."""
    from torch.export.graph_signature import InputKind
    from tvm import relax

    from tvm_ext.models import pt2_files
    from tvm_ext.models.base import model_from_function
    from tvm_ext.models.torch_import import import_exported_program

    mod, _ = import_exported_program(program)
    mod, params = relax.frontend.detach_params(mod)
    del params  # DLPack views of the torch parameters; nothing here reads their values
    func = mod["main"]
    num_input = int(func.attrs["num_input"])
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    variables = list(func.params[num_input:])
    if [v.name for v in variables] != [s.arg.name for s in specs]:
        raise RuntimeError(f"{name}: the module's parameters are not the export's "
                           "parameters in signature order")
    aliases = pt2_files.tied_aliases(program)  # placeholder -> the earlier one it is tied to
    var_of = {spec.arg.name: var for var, spec in zip(variables, specs, strict=True)}
    target_of = {spec.arg.name: spec.target for spec in specs}
    merge = {var_of[a]: var_of[k] for a, k in aliases.items()}
    names = [spec.target for spec in specs if spec.arg.name not in aliases]
    tied = {target_of[a]: target_of[k] for a, k in aliases.items()}
    func = func.bind_params(merge) if merge else func
    return Imported(model_from_function(name, func, num_input), names, tied)


def training_model(forward, loss: str, dtype: str):
    """The AdamW training iteration of `forward`: forward, `loss`, backward and the update of
    every parameter and its state in place; bf16: GEMMs and convolutions in bfloat16 with
    float32 master weights and state (tvm_ext.models.mixed_precision)."""
    from tvm_ext.models.base import make_training_step
    from tvm_ext.models.mixed_precision import low_precision_step
    from tvm_ext.models.optimizer import Optimizer, make_optimizer_step

    step = make_training_step(forward, loss=loss)
    if dtype != "fp32":
        step = low_precision_step(step, dtype)
    return make_optimizer_step(step, Optimizer(**OPTIMIZER))


def _input_specs(name: str, inputs, size: dict) -> list[dict]:
    """How `run` draws each input again (`vs_torch_gpu_measure.draw_inputs`): token ids
    uniformly over the vocabulary, a padding mask as tests/corpus makes it, images from a
    standard normal."""
    specs = []
    for kind, t in zip(INPUT_KINDS[name], inputs, strict=True):
        spec = {"kind": kind, "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch.")}
        if kind == "ids":
            spec["high"] = int(size["vocab"])
        specs.append(spec)
    return specs


def _entry(name: str, mode: str, dtype: str, size: dict, module, imported: Imported,
           inputs, step) -> dict:
    """The manifest entry of one prepared module (without its timings)."""
    inner = module.inner
    entry = {
        "model": name, "mode": mode, "dtype": dtype, "size": size,
        "class": type(inner).__name__, "config_class": type(inner.config).__name__,
        "config": json.loads(inner.config.to_json_string(use_diff=False)),
        "attn_implementation": getattr(inner.config, "_attn_implementation", None),
        "init_kwargs": INIT_KWARGS.get(name, {}), "field": FIELDS[name],
        "inputs": _input_specs(name, inputs, size), "parameters": imported.parameters,
        "tied": imported.tied,
        "parameter_count": int(sum(p.numel() for p in inner.parameters())),
        "buffers": [n for n, _ in module.named_buffers()],
    }
    if step is not None:
        labels = step.inputs[-1]
        entry["labels"] = {"shape": list(labels.shape), "dtype": labels.dtype,
                           "init": labels.init, "scale": labels.scale, "high": labels.high}
        entry["loss"] = step.config["loss"]
        by_name = {v: i for i, v in enumerate(p.name for p in step.params)}
        entry["trainable"] = [by_name[n] for n in step.config["gradients"]]
        entry["optimizer"] = step.config["optimizer"]
        entry["state"] = [{"name": x.name, "shape": list(x.shape), "dtype": x.dtype}
                          for x in step.params[len(imported.parameters):]]
    return entry


def _peak_rss() -> int:
    """The largest resident set of this process so far, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prepare_one(directory: str, name: str, mode: str, dtype: str, size_name: str,
                target, log, fused_attention: bool = True, cuda_graph: bool = True) -> dict:
    """Build, compile and export one (model, mode, dtype); returns its manifest entry.
    `fused_attention=False`: each attention and its backward as the unfused graph computes
    them (cuBLAS products), to time against the fused kernels. `cuda_graph=False`: every
    kernel launched on its own (the A/B of the CUDA graphs)."""
    import torch
    import vs_torch

    from tvm_ext import driver
    from tvm_ext.ir.kernel_graphs import graph_coverage
    from tvm_ext.models.autocast import autocast_inference

    start = time.perf_counter()
    training = mode == "training"
    size = vs_torch.model_size(name, size_name, training)
    module, inputs = vs_torch.BUILDERS[name](size)
    buffers = {f"buffer:{n}": b.detach().numpy() for n, b in module.named_buffers()}
    with torch.no_grad():
        program = torch.export.export(module, inputs)
    exported_s = time.perf_counter() - start
    imported = import_program(name, program)
    del program
    step = training_model(imported.model, loss_of(name), dtype) if training else None
    entry = _entry(name, mode, dtype, size, module, imported, inputs, step)
    del module, inputs
    gc.collect()  # the weights: nothing below needs them
    built = time.perf_counter()
    model = step if training else autocast_inference(imported.model, dtype)
    finalized: list = []
    executable = driver.build(model, target, library=True, fused_attention=fused_attention,
                              cuda_graph=None if cuda_graph else False,
                              on_finalized=finalized.append)
    launches = graph_coverage(finalized[0])
    path = os.path.join(directory, module_file(name, mode, dtype))
    _write_whole(path, lambda tmp: driver.export(executable, tmp))
    if buffers:
        _write_whole(path.removesuffix(".so") + ".npz",
                     lambda tmp: np.savez(tmp, **buffers), suffix=".npz")
    entry.update(target=str(target.kind.name), fused_attention=fused_attention,
                 kernel_launches={"graphs": launches.regions, "in_graphs": launches.captured,
                                  "outside": launches.uncaptured,
                                  "per_call": launches.launches},
                 file=os.path.basename(path),
                 module_bytes=os.path.getsize(path),
                 buffer_bytes=int(sum(b.nbytes for b in buffers.values())),
                 export_s=round(exported_s, 1), build_s=round(time.perf_counter() - built, 1),
                 prepare_s=round(time.perf_counter() - start, 1), peak_rss_bytes=_peak_rss())
    log(f"{entry_key(name, mode, dtype)}: {len(imported.parameters)} parameters "
        f"({entry['parameter_count'] / 1e6:.1f}M), module {entry['module_bytes'] / 2**20:.1f} "
        f"MiB, {entry['prepare_s']:.0f} s (build {entry['build_s']:.0f} s), peak RSS "
        f"{entry['peak_rss_bytes'] / 2**30:.2f} GiB")
    return entry


def _write_whole(path: str, write, suffix: str = ".so") -> None:
    """`write(tmp)` then rename to `path`: the file is there whole or not at all."""
    tmp = path.removesuffix(suffix) + ".partial" + suffix
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def update_manifest(directory: str, entries: dict) -> None:
    """Add `entries` to the folder's manifest (written whole), keeping the others."""
    path = os.path.join(directory, MANIFEST)
    manifest = {"entries": {}}
    if os.path.isfile(path):
        with open(path) as f:
            manifest = json.load(f)
    manifest["entries"].update(entries)
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, path)


def prepare(directory: str, keys: list[tuple[str, str, str]], size_name: str,
            target_kind: str, arch: str, log=print, fused_attention: bool = True,
            cuda_graph: bool = True) -> None:
    """Prepare every (model, mode, dtype) of `keys` into `directory`/MODEL (one folder per
    model, so that a GPU call can carry some models and not others), each folder's manifest
    updated after each module."""
    from tvm_ext.driver.build import resolve_target

    target = resolve_target(target_kind, arch)
    for name, mode, dtype in keys:
        folder = os.path.join(directory, name)
        os.makedirs(folder, exist_ok=True)
        entry = prepare_one(folder, name, mode, dtype, size_name, target, log,
                            fused_attention, cuda_graph)
        update_manifest(folder, {entry_key(name, mode, dtype): entry})
