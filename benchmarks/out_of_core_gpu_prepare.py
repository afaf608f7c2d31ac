"""The half of benchmarks/out_of_core_gpu.py that runs here, with TVM's compiler: out_of_core.py's
AdamW step (a Llama-3.2-1B-shaped decoder, batch 4 x 1024, or the quick size), compiled
unswapped and under budgets of 1/R of its no-swap peak, each module exported with its swap
sidecar. The manifest says how `run` rebuilds the same model and batches on the GPU machine
(vs_torch_gpu's entry: the `transformers` class and config, parameter names, input and label
specs, the optimizer and its state), and what each module was planned for. No weight travels.
"""

from __future__ import annotations

import gc
import gzip
import json
import os
import time

MANIFEST = "manifest.json"


def module_name(dtype: str, budget: str) -> str:
    """`budget`: "ideal" (unswapped), "twin" (unswapped, fused as the budgeted builds are:
    their kernels, timed in place for the simulator) or the ratio R of a 1/R budget."""
    return f"llama_{dtype}_{budget}.so"


def plan_file(module_file: str) -> str:
    """Beside a swapped module: its swap problem and plan (gzipped JSON), which `simulate`
    runs again with the kernel times and the link measured on the GPU."""
    return module_file + ".plan.json.gz"


def _write_whole(path: str, write) -> None:
    tmp = f"{path}.{os.getpid()}.partial.so"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_gzip_json(path: str, data: dict) -> None:
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def _step(dtype: str, size_name: str):
    """(the training step Model, its vs_torch_gpu manifest entry) built from the config."""
    import torch
    import vs_torch
    from out_of_core import MODEL, SHAPES
    from vs_torch_gpu_measure import loss_of
    from vs_torch_gpu_prepare import _entry, import_program, training_model

    batch, seq = SHAPES[size_name]
    size = dict(vs_torch.model_size(MODEL, size_name, training=True), batch=batch, seq=seq,
                positions=seq)
    module, inputs = vs_torch.BUILDERS[MODEL](size)
    with torch.no_grad():
        program = torch.export.export(module, inputs)
    imported = import_program(MODEL, program)
    del program
    step = training_model(imported.model, loss_of(MODEL), dtype)
    entry = _entry(MODEL, "training", dtype, size, module, imported, inputs, step)
    entry["tokens"] = batch * seq
    del module, inputs
    gc.collect()
    return step, entry


def prepare(directory: str, size_name: str, dtypes: list[str], ratios: list[int],
            target_name: str, hardware: str, time_budget_s: float, seed: int, log=print) -> dict:
    """Compile and export every module; returns the manifest (also written to DIR)."""
    from tvm_ext import driver
    from tvm_ext.driver.build import resolve_target
    from tvm_ext.units import format_size

    target = resolve_target(target_name)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MANIFEST)
    manifest = {"size": size_name, "target": target.kind.name, "hardware": hardware,
                "entries": {}}
    if os.path.exists(path):
        with open(path) as f:
            manifest["entries"] = json.load(f).get("entries", {})
    for dtype in dtypes:
        start = time.perf_counter()
        step, entry = _step(dtype, size_name)
        modules = {}
        graph = driver.fused_graph(step, target)
        for ratio in ratios:
            planning = driver.plan_swap(step, target, f"{100 / ratio:g}%", hardware=hardware,
                                        seed=seed, time_budget_s=time_budget_s, graph=graph)
            plan, problem = planning.plan, planning.problem
            modules[str(ratio)] = {
                "ratio": ratio, "budget_bytes": int(problem.budget),
                "no_swap_peak_bytes": int(problem.no_swap_peak()),
                "planned_peak_bytes": int(plan.predicted_peak),
                "predicted_s": plan.predicted_time, "ideal_predicted_s": planning.ideal_time(),
                "swapped_bytes": int(plan.bytes_swapped), "planning_s": plan.planning_time,
                "recomputed": plan.info.get("recomputed", 0), "splits": len(plan.splits or []),
                "plan": {"planner": plan.planner, "seed": seed, "hardware": hardware}}
            built = time.perf_counter()
            executable = driver.build(step, target, library=True, swap_plan=plan)
            file = module_name(dtype, str(ratio))
            _write_whole(os.path.join(directory, file),
                         lambda tmp, ex=executable: driver.export(ex, tmp))
            with open(os.path.join(directory, file + ".swap.json"), "w") as f:
                json.dump(planning.sidecar, f)
            _write_whole(os.path.join(directory, plan_file(file)), lambda tmp, p=planning: (
                _write_gzip_json(tmp, {"problem": p.problem.to_dict(),
                                       "plan": p.plan.to_dict()})))
            modules[str(ratio)].update(file=file, build_s=round(time.perf_counter() - built, 1))
            log(f"{dtype} 1/{ratio}: budget {format_size(problem.budget)} of "
                f"{format_size(problem.no_swap_peak())}, predicted "
                f"{100 * planning.ideal_time() / plan.predicted_time:.1f}% of ideal, built in "
                f"{modules[str(ratio)]['build_s']:.0f} s")
            del executable, planning
            gc.collect()
        for name, budgeted in (("ideal", False), ("twin", True)):
            built = time.perf_counter()
            executable = driver.build(step, target, library=True, budgeted=budgeted)
            file = module_name(dtype, name)
            _write_whole(os.path.join(directory, file),
                         lambda tmp, ex=executable: driver.export(ex, tmp))
            modules[name] = {"file": file, "build_s": round(time.perf_counter() - built, 1)}
            del executable
        entry["modules"] = modules
        entry["prepare_s"] = round(time.perf_counter() - start, 1)
        manifest["entries"][dtype] = entry
        tmp = path + ".partial"
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, path)
        log(f"{dtype}: prepared in {entry['prepare_s']:.0f} s")
    return manifest
