"""The artefacts of one suite of a GPU bundle, compiled here: what `tvm_ext.runtime.gpu_checks`
runs there. Each function writes its files under the suite's folder and returns the manifest
entry the checks read (see `tvm_ext.runtime.gpu_checks.bundle` for the layout).

Expected outputs come from the CPU build on this machine (`reference_target`), on arguments
drawn here and shipped in the suite's arrays.npz; a large swapped model is the exception: its
arguments are drawn there from their specs, and its outputs are compared with its unswapped
build on the same device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable

import numpy as np
import tvm
from tvm import tirx

from .. import pipeline
from ..cost.calibration import op_kernels
from ..cost.hardware import get_hardware
from ..ir.library_kernels import find_library_calls, gemm_dims
from ..ir.targets import is_cpu
from ..models import Model, get_model
from ..models.reference import TOLERANCES, tolerance
from ..runtime.gpu_checks.bundle import ARRAYS, ARTIFACTS, sha256
from .build import build, export, fused_graph, resolve_target
from .measure_kernels import compile_kernel, kernel_params
from .partitioned import build_partitioned
from .run import run
from .swap_planning import plan_swap
from .tune import export_tuning_batch

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    """What one suite holds. Zoo modules: each model at `zoo_size`, inference and training
    step. Swapped builds: `swap_model` at each budget. A module partitioned over
    `partition_devices` on a Disco session. The `gemm_count` largest distinct GEMMs of
    `gemm_models` at `gemm_size`; the `conv_count` largest distinct convolutions of
    `conv_models`' training steps at `conv_size` (forward, data and weight gradients). Copies of
    each of `copy_sizes_mib`, and strided chunk copies
    (what a split op cut along a later axis makes) of `strided_rows` rows of each of
    `strided_row_bytes`. An offline tuning batch of `tune_trials` candidates for
    `tune_model`'s kernels (0: none)."""

    zoo: tuple[str, ...] = ("mlp", "gpt", "resnet")
    zoo_size: str = "small"
    swap_model: str = "gpt"
    swap_size: str = "medium"
    swap_training: bool = True
    swap_budgets: tuple[str, ...] = ("50%", "25%", "min")
    swap_time_budget: float = 20.0
    swap_repeat: int = 5
    partition_model: str = "gpt"
    partition_size: str = "small"
    partition_devices: int = 1
    gemm_models: tuple[str, ...] = ("mlp", "gpt")
    gemm_size: str = "large"
    gemm_count: int = 4
    conv_models: tuple[str, ...] = ("resnet",)
    conv_size: str = "medium"
    conv_count: int = 6
    copy_sizes_mib: tuple[int, ...] = (64, 256)
    strided_rows: int = 2048
    strided_row_bytes: tuple[int, ...] = (4, 64, 1024)
    tune_model: str = "gpt"
    tune_size: str = "small"
    tune_trials: int = 64
    library: bool = True  # vendor libraries (cuBLAS): False keeps TVM's code for every kernel


class SuiteWriter:
    """Writes one suite's files under BUNDLE/artifacts/<suite>/ and its arrays (each stored
    once, keyed by content), and records every file it wrote."""

    def __init__(self, root: str, suite: str) -> None:
        self.root, self.suite = root, suite
        self.directory = os.path.join(root, ARTIFACTS, suite)
        os.makedirs(self.directory, exist_ok=True)
        self.arrays: dict[str, np.ndarray] = {}
        self.files: list[str] = []

    def path(self, relative: str) -> tuple[str, str]:
        """(absolute path, path relative to the bundle root) of a file of the suite."""
        full = os.path.join(self.directory, relative)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        self.files.append(full)
        return full, os.path.relpath(full, self.root)

    def add(self, arrays: list[np.ndarray]) -> list[str]:
        keys = []
        for array in arrays:
            array = np.asarray(array)  # (not ascontiguousarray: it makes scalars 1-d)
            digest = hashlib.sha1(array.tobytes() + str((array.shape, array.dtype)).encode())
            key = "a" + digest.hexdigest()[:16]
            self.arrays.setdefault(key, array)
            keys.append(key)
        return keys

    def finish(self) -> dict[str, str]:
        """Write arrays.npz; the sha256 of every file of the suite, by path in the bundle."""
        np.savez_compressed(self.path(ARRAYS)[0], **self.arrays)
        return {os.path.relpath(f, self.root): sha256(f) for f in sorted(set(self.files))
                if os.path.isfile(f)}


def reference_target(target: tvm.target.Target) -> tvm.target.Target:
    """Where expected outputs are computed: this CPU (the target itself for a CPU suite)."""
    return target if is_cpu(target) else resolve_target("llvm")


def _label(model: Model, size: str) -> str:
    return f"{model.name}-{size}-{'training' if model.training else 'inference'}"


def _expected(model: Model, target: tvm.target.Target, library: bool,
              args: list[np.ndarray]) -> list[np.ndarray]:
    ref = reference_target(target)
    return run(build(model, ref, library=library), args, tvm.cpu(0), repeat=0).outputs


def _checked_entry(writer: SuiteWriter, model: Model, target, library: bool, seed: int) -> dict:
    args = model.random_arguments(seed)
    expected = _expected(model, target, library, args)
    return {"arguments": writer.add(args), "expected": writer.add(expected),
            "tolerances": [list(tolerance(o.dtype)) for o in expected],
            "reference": f"the {reference_target(target).kind.name} build where the bundle "
                         "was built"}


def zoo_entries(writer: SuiteWriter, cfg: SuiteConfig, target, log: Log, seed: int = 0
                ) -> list[dict]:
    entries = []
    for name in cfg.zoo:
        for training in (False, True):
            model = get_model(name, cfg.zoo_size, training=training)
            label = _label(model, cfg.zoo_size)
            path, rel = writer.path(f"zoo/{label}.so")
            export(build(model, target, library=cfg.library), path)
            entries.append({"name": label, "module": rel,
                            **_checked_entry(writer, model, target, cfg.library, seed)})
            log(f"  zoo {label}")
    return entries


def swap_entry(writer: SuiteWriter, cfg: SuiteConfig, target, hardware: str, log: Log,
               seed: int = 0) -> dict:
    """The unswapped build and one swapped build per budget, with sidecars, the swap problem
    (for the simulator) and the kernels to time."""
    model = get_model(cfg.swap_model, cfg.swap_size, training=cfg.swap_training)
    label = _label(model, cfg.swap_size)
    graph = fused_graph(model, target)
    path, unswapped = writer.path(f"swap/{label}.so")
    # The swapped builds' unswapped twin (the same fused kernels: outputs compare bit for bit).
    export(build(model, target, library=cfg.library, budgeted=True), path)
    budgets, problem = [], None
    for budget in cfg.swap_budgets:
        # No fission: the checks time the fused kernels and simulate every budget's plan with
        # those times, on the one problem written below.
        planning = plan_swap(model, target, budget, hardware=hardware, seed=seed,
                             time_budget_s=cfg.swap_time_budget,
                             reserved=None if cfg.library else 0, fission=False, graph=graph)
        plan, problem = planning.plan, planning.problem
        tag = budget.replace("%", "pct")
        path, rel = writer.path(f"swap/{label}-{tag}.so")
        export(build(model, target, swap_plan=plan, library=cfg.library), path)
        side, side_rel = writer.path(f"swap/{label}-{tag}.so.swap.json")
        with open(side, "w") as f:
            json.dump(planning.sidecar, f)
        # Ops run in chunks may round differently (`swap.exactness`).
        budgets.append({"label": budget, "module": rel, "sidecar": side_rel,
                        "budget": int(plan.budget),
                        "inexact_splits": planning.inexact_splits,
                        "tolerances": {k: list(v) for k, v in TOLERANCES.items()}})
        log(f"  swap {label} at {budget}: budget {plan.budget} bytes")
    prob_path, prob_rel = writer.path(f"swap/{label}.problem.json")
    with open(prob_path, "w") as f:
        json.dump({"problem": problem.to_dict(), "op_kernels": op_kernels(graph)}, f)
    graphs = None
    if target.kind.name == "cuda":  # the unswapped step as deployed: its kernels in graphs
        path, graphs = writer.path(f"swap/{label}-graphs.so")
        export(build(model, target, library=cfg.library), path)
    return {"model": label, "seed": seed, "repeat": cfg.swap_repeat, "unswapped": unswapped,
            "graphs": graphs,
            "arguments": [_spec(s) for s in model.specs], "problem": prob_rel,
            "budgets": budgets, "constants_bytes": int(graph.bytes_of_kind("constant")),
            "no_swap_peak": int(problem.no_swap_peak()), "kernels": _kernels(model, target,
                                                                              graph),
            "link": swap_link(hardware)}


def swap_link(hardware: str) -> dict:
    """The copy bandwidths of a hardware preset (what swap plans for it assume)."""
    hw = get_hardware(hardware)
    return {"hardware": hardware, "h2d_bytes_per_s": hw.host_to_device.bandwidth,
            "d2h_bytes_per_s": hw.device_to_host.bandwidth}


def _spec(spec) -> dict:
    data = dataclasses.asdict(spec)
    data["shape"] = list(data["shape"])
    return data


def _kernels(model: Model, target, graph) -> list[dict]:
    calls: dict[str, int] = {}
    for op in graph.ops:
        if op.kind == "kernel":
            calls[op.kernel] = calls.get(op.kernel, 0) + 1
    fused = pipeline.fuse(model.mod, target)
    return [{"name": gv.name_hint, "params": kernel_params(f), "calls": calls[gv.name_hint]}
            for gv, f in fused.functions.items()
            if isinstance(f, tirx.PrimFunc) and gv.name_hint in calls]


def partition_entry(writer: SuiteWriter, cfg: SuiteConfig, target, hardware: str, log: Log,
                    seed: int = 0) -> dict:
    model = get_model(cfg.partition_model, cfg.partition_size, training=True)
    k = cfg.partition_devices
    label = f"{_label(model, cfg.partition_size)}-k{k}"
    built = build_partitioned(model, target, k, hardware=hardware, library=cfg.library)
    path, rel = writer.path(f"partition/{label}.so")
    export(built.executable, path)
    side, _ = writer.path(f"partition/{label}.so.partition.json")
    with open(side, "w") as f:
        json.dump(built.sidecar(), f)
    log(f"  partition {label}")
    return {"name": label, "module": rel, "devices": k,
            **_checked_entry(writer, model, target, cfg.library, seed)}


def _write_variants(writer: SuiteWriter, entry: dict, stem: str, func, kernel: str, target,
                    library: bool) -> None:
    """`entry["library"]`, `entry["tvm"]`: the kernel compiled alone with the vendor library
    (where `library` and a library computes part of it) and with TVM's own code, written as
    `<stem>-<variant>.so`."""
    for variant in (("library", "tvm") if library else ("tvm",)):
        lib, dispatched = compile_kernel(func, kernel, target, variant == "library")
        if variant == "library" and not dispatched:
            continue
        path, entry[variant] = writer.path(f"{stem}-{variant}.so")
        lib.export_library(path)


def gemm_entries(writer: SuiteWriter, cfg: SuiteConfig, target, log: Log) -> list[dict]:
    """The largest distinct GEMMs (by FLOPs) of the models, each compiled alone with the
    vendor library (where `cfg.library`) and with TVM's own code."""
    found = {}
    for name in cfg.gemm_models:
        fused = pipeline.fuse(get_model(name, cfg.gemm_size).mod, target)
        for gv, func in fused.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            for call in find_library_calls(func):
                if call.kind == "gemm" and call.flops:
                    key = (gemm_dims(call), call.dtypes)
                    if key not in found or call.flops > found[key][0]:
                        found[key] = (call.flops, name, gv.name_hint, func, call)
    entries = []
    for flops, name, kernel, func, call in sorted(found.values(), key=lambda f: -f[0])[
            :cfg.gemm_count]:
        batch, m, n, k, batched_b = gemm_dims(call)
        entry = {"name": f"{name}-{kernel}", "model": f"{name}-{cfg.gemm_size}",
                 "kernel": kernel, "dims": [batch, m, n, k], "batched_b": batched_b,
                 "dtype": str(call.dtypes[0]), "flops": int(flops),
                 "params": kernel_params(func), "library": None}
        _write_variants(writer, entry, f"gemm/{name}-{kernel}", func, kernel, target,
                        cfg.library)
        entries.append(entry)
        log(f"  gemm {entry['name']}: {batch}x{m}x{n}x{k}")
    return entries


def conv_entries(writer: SuiteWriter, cfg: SuiteConfig, target, log: Log) -> list[dict]:
    """The largest distinct convolutions (by FLOPs) of the models' training steps, each
    compiled alone with the vendor library (where `cfg.library`) and with TVM's own code;
    every storage order of their operands (a weight gradient's, a transposed convolution's)
    among them before a second of one order."""
    found = {}
    for name in cfg.conv_models:
        fused = pipeline.fuse(get_model(name, cfg.conv_size, training=True).mod, target)
        for gv, func in fused.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            for call in find_library_calls(func):
                if call.kind == "gemm" or not call.flops:
                    continue
                shapes = tuple(tuple(int(d) for d in b.shape) for b in call.operands)
                key = (shapes, call.conv, call.conv_axes, call.dtypes)
                if key not in found or call.flops > found[key][0]:
                    found[key] = (call.flops, name, gv.name_hint, func, call)
    ranked, orders = [], {}
    for item in sorted(found.values(), key=lambda f: -f[0]):
        orders.setdefault(item[4].conv_axes, []).append(item)
    while any(orders.values()) and len(ranked) < cfg.conv_count:
        for items in orders.values():
            if items and len(ranked) < cfg.conv_count:
                ranked.append(items.pop(0))
    entries = []
    for flops, name, kernel, func, call in ranked:
        entry = {"name": f"{name}-{kernel}", "model": f"{name}-{cfg.conv_size}",
                 "kernel": kernel, "flops": int(flops), "axes": [list(a) for a in call.conv_axes],
                 "dtype": str(call.dtypes[0]), "params": kernel_params(func), "library": None}
        _write_variants(writer, entry, f"conv/{name}-{kernel}", func, kernel, target,
                        cfg.library)
        entries.append(entry)
        log(f"  conv {entry['name']}: axes {entry['axes']}, {flops / 1e9:.2f} GFLOP")
    return entries


def tuning_entry(writer: SuiteWriter, cfg: SuiteConfig, target, work_dir: str, log: Log
                 ) -> dict | None:
    """An offline tuning batch of the tune model's kernels (None when no trials are asked)."""
    if cfg.tune_trials <= 0:
        return None
    model = get_model(cfg.tune_model, cfg.tune_size)
    batch_dir = os.path.join(writer.directory, "tuning")
    exported = export_tuning_batch(model.mod, target, work_dir, batch_dir, cfg.tune_trials,
                                   log=log, library=cfg.library)
    for name in sorted(os.listdir(batch_dir)):
        writer.path(os.path.join("tuning", name))
    return {"batch": os.path.relpath(batch_dir, writer.root), "model": _label(model,
                                                                             cfg.tune_size),
            "candidates": exported.candidates}
