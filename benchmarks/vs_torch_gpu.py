"""Benchmark: tvm_ext against PyTorch eager on a GPU, end to end, on third-party models (issue 17).

The GPU machine has no TVM compiler, so this runs in two halves:

    python benchmarks/vs_torch_gpu.py prepare DIR [--models gpt2,bert,llama,vit,resnet]
    # on the GPU machine, with a GPU bundle's runtime (scripts/gpu_bundle.py out/):
    python3 benchmarks/vs_torch_gpu.py run DIR --site out/site [--json vs_torch_gpu.json]

`prepare` (here) builds each model of benchmarks/vs_torch.py at its benchmark size (the
`transformers` architectures from configs, exported with `torch.export` and loaded from the
.pt2 as `compile.py` does), compiles its inference for `--target cuda --arch sm_90` with the
library kernels on (cuBLAS), and writes the exported module, the model's inputs, its
`transformers` class and config, and for each parameter of the module the name of the torch
parameter or buffer it is (matched here by value against the exported program's state).
Weights do not travel (a 5M-parameter model is 21 MB): `run` builds the same architecture there
from the config, and both sides run that one model's weights.

`run` (there: TVM's runtime, tvm_ext's runtime library, PyTorch and `transformers`) checks the
tvm_ext module's outputs against PyTorch eager on the GPU (rtol 1e-3, atol 1e-4: cuBLAS and
PyTorch pick different GEMM algorithms; float32, no TF32 on either side) and times both in
interleaved rounds (TVM's pooled allocator, weights resident; torch under `inference_mode`),
medians over all timed calls. Writes the JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import numpy as np

MODELS = ("gpt2", "bert", "llama", "vit", "resnet")
# What the corpus wrapper returns (tests/corpus `_Logits.wrap`), and extra constructor
# arguments of the `transformers` class, per model of benchmarks/vs_torch.py.
FIELDS = {"gpt2": "logits", "bert": "last_hidden_state", "llama": "logits",
          "vit": "last_hidden_state", "resnet": "logits"}
INIT_KWARGS = {"bert": {"add_pooling_layer": False}, "vit": {"add_pooling_layer": False}}
RTOL, ATOL = 1e-3, 1e-4
MANIFEST = "manifest.json"


# ------------------------------------------------------------------------------------------
# prepare (here, with TVM's compiler)
# ------------------------------------------------------------------------------------------

def _parameter_sources(exp) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Per parameter of tvm_ext's module: the torch name it is (by value among the exported
    program's parameters, buffers and constants), else the value itself (carried)."""
    program = exp.program
    state = {**program.state_dict, **program.constants}
    named = dict(exp.module.named_parameters(remove_duplicate=False))
    named.update(exp.module.named_buffers(remove_duplicate=False))
    candidates = [s.target for s in program.graph_signature.input_specs
                  if s.target is not None and s.target in state]
    sources, carried, used = [], {}, set()
    for i, weight in enumerate(exp.model.weights):
        match = [n for n in candidates if tuple(state[n].shape) == weight.shape
                 and np.array_equal(state[n].detach().cpu().numpy(), weight)]
        fresh = [n for n in match if n not in used]
        name = (fresh or match or [None])[0]
        if name is not None and name in named:
            used.add(name)
            sources.append({"name": name})
        else:  # a constant the torch module there would not have by this name
            key = f"w{i}"
            carried[key] = np.asarray(weight)
            sources.append({"carried": key})
    return sources, carried


def prepare(directory: str, models: list[str], target_kind: str, arch: str,
            size: str = "bench") -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tempfile

    import vs_torch  # the models, their sizes and export

    from tvm_ext import driver
    from tvm_ext.driver.build import resolve_target

    target = resolve_target(target_kind, arch)
    os.makedirs(directory, exist_ok=True)
    manifest = {"target": str(target), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            start = time.perf_counter()
            exp = vs_torch.export_model(name, vs_torch.SIZES[size], tmp)
            inner = exp.module.inner
            sources, carried = _parameter_sources(exp)
            module = driver.build(exp.model, target, library=True)
            driver.export(module, os.path.join(directory, f"{name}.so"))
            inputs = [t.detach().numpy() for t in exp.inputs]
            # Buffers (BatchNorm statistics) may be folded into the module as constants:
            # the torch model there takes this one's (they are small).
            buffers = {f"buffer:{n}": b.detach().numpy()
                       for n, b in exp.module.named_buffers()}
            np.savez(os.path.join(directory, f"{name}.npz"),
                     **{f"input{i}": a for i, a in enumerate(inputs)}, **carried, **buffers)
            manifest["models"][name] = {
                "class": type(inner).__name__, "config_class": type(inner.config).__name__,
                "config": json.loads(inner.config.to_json_string(use_diff=False)),
                "attn_implementation": getattr(inner.config, "_attn_implementation", None),
                "init_kwargs": INIT_KWARGS.get(name, {}), "field": FIELDS[name],
                "inputs": len(inputs), "parameters": sources,
                "buffers": [k.removeprefix("buffer:") for k in buffers],
                "carried_bytes": int(sum(a.nbytes for a in carried.values())),
                "parameter_count": int(sum(p.numel() for p in inner.parameters())),
                "size": vs_torch.SIZES[size]}
            print(f"{name}: {len(sources)} parameters ({len(carried)} carried, "
                  f"{manifest['models'][name]['carried_bytes']} bytes), "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


# ------------------------------------------------------------------------------------------
# run (there: TVM's runtime, PyTorch, transformers)
# ------------------------------------------------------------------------------------------

def _torch_model(spec: dict, torch, device):
    import transformers

    config = getattr(transformers, spec["config_class"]).from_dict(dict(spec["config"]))
    if spec.get("attn_implementation"):
        config._attn_implementation = spec["attn_implementation"]
    torch.manual_seed(0)
    inner = getattr(transformers, spec["class"])(config, **spec["init_kwargs"]).eval()

    class Wrapped(torch.nn.Module):  # as tests/corpus wraps it: the names start "inner."
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return getattr(self.inner(*args), spec["field"])

    return Wrapped().eval().to(device)


def first_nan_kernel(vm, args) -> dict | None:
    """Run `main` once with every VM call instrumented: the first call after which one of its
    arguments holds a NaN while none of its other arguments did before (the kernel that made
    it from clean inputs, or whose output, its last argument, held NaN before and after: left
    partly unwritten), or None."""
    import tvm

    found: dict = {}
    before: list = []

    def nan_args(values) -> list[int]:
        out = []
        for i, v in enumerate(values):
            try:
                a = v.numpy()
            except Exception:  # not a tensor
                continue
            if a.dtype.kind == "f" and np.isnan(a).any():
                out.append(i)
        return out

    def instrument(func, symbol, before_run, ret, *call_args):
        if found:
            return 0
        nans = nan_args(call_args)
        if before_run:
            before[:] = nans
            return 0
        new = [i for i in nans if i not in before]
        last = len(call_args) - 1
        if (new and not before) or (before == [last] and last in nans):
            found.update(kernel=str(symbol), argument=(new or [last])[0],
                         nan_before=list(before),
                         shapes=[list(a.shape) if hasattr(a, "shape") else None
                                 for a in call_args])
        return 0

    vm.set_instrument(tvm.runtime.convert(instrument))
    try:
        vm["main"](*args)
    finally:
        vm.set_instrument(tvm.runtime.convert(lambda *a: 0))
    return found or None


def _time_interleaved(calls: dict, rounds: int, round_s: float) -> dict[str, list[float]]:
    """Seconds per call of each `calls[name] = (call, sync)`, in rounds that alternate between
    them; each round of each lasts about `round_s`."""
    times = {k: [] for k in calls}
    for r in range(rounds + 1):  # round 0 warms up
        for name, (call, sync) in calls.items():
            sync()
            start = time.perf_counter()
            n = 0
            while True:
                call()
                n += 1
                if n % 5 == 0:
                    sync()
                    if time.perf_counter() - start >= round_s:
                        break
            if r:
                times[name].append((time.perf_counter() - start) / n)
    return times


def _arguments(directory: str, name: str, spec: dict, torch, tdev):
    """(the module's inputs, its parameters taken from the torch model, the torch model)."""
    arrays = np.load(os.path.join(directory, f"{name}.npz"))
    inputs = [arrays[f"input{i}"] for i in range(spec["inputs"])]
    model = _torch_model(spec, torch, tdev)
    with torch.no_grad():
        for buffer, value in dict(model.named_buffers()).items():
            if buffer in spec["buffers"]:
                value.copy_(torch.from_numpy(arrays[f"buffer:{buffer}"]))
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    missing = [s["name"] for s in spec["parameters"] if "name" in s and s["name"] not in named]
    if missing:
        raise RuntimeError(f"the torch model built here lacks {missing[:3]}")
    params = [named[s["name"]].detach().cpu().numpy() if "name" in s else arrays[s["carried"]]
              for s in spec["parameters"]]
    return inputs, params, model


def run_model(directory: str, name: str, spec: dict, device: str, rounds: int,
              round_s: float) -> dict:
    """One model's row: outputs against torch, then both timed."""
    import torch
    import tvm
    from tvm.runtime.vm import VirtualMachine

    dev, tdev = tvm.device(device, 0), torch.device(device)
    torch_sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    row: dict = {}
    inputs, params, model = _arguments(directory, name, spec, torch, tdev)
    vm = VirtualMachine(tvm.runtime.load_module(os.path.join(directory, f"{name}.so")), dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (*inputs, *params)]
    t_inputs = [torch.from_numpy(a).to(tdev) for a in inputs]
    main = vm["main"]

    def tvm_call():
        return main(*args)

    def torch_call():
        with torch.inference_mode():
            return model(*t_inputs)

    out = tvm_call()
    ours = (out if hasattr(out, "numpy") else out[0]).numpy()
    theirs = torch_call().float().cpu().numpy()
    err = np.abs(ours - theirs)
    if np.isnan(ours).any() or np.isnan(theirs).any():
        row["nan"] = {"tvm_ext": int(np.isnan(ours).sum()), "torch": int(np.isnan(theirs).sum())}
        if row["nan"]["tvm_ext"]:
            row["first_nan"] = first_nan_kernel(vm, args)
    row.update(max_abs_error=float(err.max()),
               max_rel_error=float((err / (np.abs(theirs) + 1e-12)).max()),
               ok=bool(np.allclose(ours, theirs, rtol=RTOL, atol=ATOL)))
    times = _time_interleaved({"tvm_ext": (tvm_call, dev.sync),
                               "torch": (torch_call, torch_sync)}, rounds, round_s)
    row["torch_ms"] = statistics.median(times["torch"]) * 1e3
    row["tvm_ext_ms"] = statistics.median(times["tvm_ext"]) * 1e3
    row["ratio"] = row["tvm_ext_ms"] / row["torch_ms"]
    ratios = sorted(a / b for a, b in zip(times["tvm_ext"], times["torch"], strict=True))
    row["round_ratios"] = [round(r, 4) for r in ratios]
    return row


def run_models(directory: str, rounds: int, round_s: float, device: str = "cuda") -> dict:
    import torch
    import tvm

    import tvm_ext  # noqa: F401  (tvm_ext's runtime library: the cuBLAS kernels)
    from tvm_ext.runtime.cuda import ensure_cuda_runtime

    if device == "cuda":
        ensure_cuda_runtime()  # TVM's CUDA module loader (loaded on demand)
    with open(os.path.join(directory, MANIFEST)) as f:
        manifest = json.load(f)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name, spec in manifest["models"].items():
        row = {"model": name, "mode": "inference", "parameters": spec["parameter_count"]}
        try:
            row.update(run_model(directory, name, spec, device, rounds, round_s))
        except Exception as err:  # one model's failure is reported, the others still run
            row["error"] = f"{type(err).__name__}: {err}"
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "round_ratios"}), flush=True)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {"machine": {"host": platform.node(), "device": device, "gpu": gpu,
                        "torch": torch.__version__, "tvm": tvm.__version__,
                        "python": platform.python_version()},
            "rounds": rounds, "round_s": round_s, "tolerance": [RTOL, ATOL], "rows": rows}


def table(results: dict) -> str:
    lines = ["| model | mode | params | torch ms | tvm_ext ms | tvm_ext / torch | max abs err |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["rows"]:
        if "error" in r or not r.get("ok"):
            why = r.get("error") or f"differs from torch (max abs {r['max_abs_error']:.2e})"
            lines.append(f"| {r['model']} | {r['mode']} | | | | {why} | |")
            continue
        lines.append(f"| {r['model']} | {r['mode']} | {r['parameters'] / 1e6:.2f}M | "
                     f"{r['torch_ms']:.3f} | {r['tvm_ext_ms']:.3f} | {r['ratio']:.2f}x | "
                     f"{r['max_abs_error']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="compile the models here (TVM's compiler)")
    p.add_argument("directory")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--target", default="cuda", choices=("cuda", "llvm"),
                   help="llvm: a CPU build, to try the two halves on one machine")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--size", default="bench", choices=("bench", "quick"),
                   help="quick: the tiny sizes of benchmarks/vs_torch.py --quick")
    r = sub.add_parser("run", help="time them on the GPU (TVM's runtime)")
    r.add_argument("directory")
    r.add_argument("--site", help="a GPU bundle's site/ folder (TVM's runtime, tvm_ext's)")
    r.add_argument("--json", default="vs_torch_gpu.json")
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of both halves (with `prepare --target llvm`), not a "
                        "benchmark: benchmarks/vs_torch.py times the CPU, threads matched")
    r.add_argument("--rounds", type=int, default=7)
    r.add_argument("--round-seconds", type=float, default=0.3)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        unknown = set(args.models.split(",")) - set(MODELS)
        if unknown:
            parser.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepare(args.directory, args.models.split(","), args.target, args.arch, args.size)
        return 0
    if args.site:
        sys.path.insert(0, os.path.abspath(args.site))
    results = run_models(args.directory, args.rounds, args.round_seconds, args.device)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    return 0 if all(r.get("ok") for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
