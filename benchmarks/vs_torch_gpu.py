"""Benchmark: tvm_ext against PyTorch on a GPU, end to end, on third-party models: inference
and the AdamW training step, float32 and bf16 (issues 17, 34, 37).

The GPU machine has no TVM compiler, so this runs in two halves. `prepare` (here, with TVM's
compiler; benchmarks/vs_torch_gpu_prepare.py) builds each model of benchmarks/vs_torch.py at a
size, exports it with `torch.export`, imports it without copying its weights, compiles its
inference or its training iteration (forward, loss, backward, AdamW in place; `bf16`: GEMMs
and convolutions in bfloat16, float32 master weights; bf16 inference with torch.autocast's
policy, checked against eager under bf16 autocast) for `--target cuda --arch sm_90` with the
library kernels on (cuBLAS), and writes DIR/MODEL/: the modules and a manifest (the
`transformers` class and config, the torch name of every parameter, the seed and specs the
inputs and labels are drawn from, the optimizer). No weight travels: `run` builds the same
architecture there, and both sides run its weights.

`run` (there: a GPU bundle's runtime, PyTorch, `transformers`; benchmarks/vs_torch_gpu_measure.py
says what each column runs and checks) measures each (model, mode, dtype) in a child process
under a time limit (`--timeout`, 200 s), so that one slow kernel cannot hide the other rows;
a row cut short keeps what it measured and says where it stopped. Each row is printed as soon
as it is measured and written into the JSON, which accumulates rows across `run` calls (a row
measured again replaces the old one), so that the run can be split into calls of a few
minutes each.

Sizes (`--size`): `quick` (tiny: tests), `bench` (hidden 256, 4 layers, batch 2 x 64), `real`:
GPT-2 124M (12 x 768, vocabulary 50257), BERT-base (vocabulary 30522), a decoder of
Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocabulary
128256, tied embedding), ViT-B/16 (224 x 224), ResNet-50; inference on 8 x 512 tokens or
8 x 3 x 224 x 224, training on 4 x 512 tokens or 8 images (benchmarks/vs_torch.py SIZES).

On this machine, both halves at tiny sizes (a dry run, not a benchmark):

    python benchmarks/vs_torch_gpu.py prepare /tmp/p --target llvm --size quick
    python benchmarks/vs_torch_gpu.py run /tmp/p --device cpu --json /tmp/r.json

For a GPU machine (benchmarks/README.md, "The real-size GPU benchmark", has the measured
prepare times and sizes). Here, once (33 minutes on 2 shared cores, one process per module;
the Llama modules peak at 6.2 GiB of memory):

    python benchmarks/vs_torch_gpu.py prepare gpu_vs_torch/real --size real
    python benchmarks/vs_torch_gpu.py site gpu_vs_torch/site

Then device calls, each carrying gpu_vs_torch/site and gpu_vs_torch/real (58 MiB with the
working tree), with J=vs_torch_gpu_real.json copied back here into benchmarks/results/gpu/
after each call (on an H200 the first call took 427 s, the second 323 s):

    cp benchmarks/results/gpu/$J "$OUT/" 2>/dev/null; R="python3 benchmarks/vs_torch_gpu.py \
        run gpu_vs_torch/real --site gpu_vs_torch/site --json $OUT/$J"

    call 1: $R --missing --modes training --models gpt2,bert,vit,resnet --timeout 60;
            $R --missing --modes training --models llama --timeout 100;
            $R --missing --modes inference --timeout 50
    call 2: $R --modes inference --dtypes fp32 --compile --timeout 90
    call 3: $R --modes training --dtypes fp32 --profile --timeout 90 (where the time goes)
    then one model per call: $R --models M --modes training --compile --timeout 200
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from vs_torch_gpu_measure import DTYPES, MANIFEST, MODELS, MODES, entry_key  # noqa: E402

DEFAULT_TIMEOUT = 200.0
DEFAULT_JSON = os.path.join(HERE, "results", "gpu", "vs_torch_gpu.json")
BENCHMARK = "vs_torch_gpu"


def selected_keys(models: list[str], modes: list[str], dtypes: list[str]) -> list[tuple]:
    """(model, mode, dtype) for each combination asked for (bf16 inference: autocast's
    policy; a bf16 training step: mixed precision with float32 master weights)."""
    return [(m, mode, d) for m in models for mode in modes for d in dtypes]


# ------------------------------------------------------------------------------------------
# run: one child process per row, rows accumulated in the JSON
# ------------------------------------------------------------------------------------------

def load_manifests(directory: str) -> dict[str, tuple[str, dict]]:
    """key -> (the folder holding its module, its entry), from DIR/manifest.json and
    DIR/*/manifest.json; entries whose module is not there (not carried) are left out."""
    found = {}
    for path in sorted(glob.glob(os.path.join(directory, MANIFEST))
                       + glob.glob(os.path.join(directory, "*", MANIFEST))):
        folder = os.path.dirname(path)
        with open(path) as f:
            for key, entry in json.load(f)["entries"].items():
                if os.path.isfile(os.path.join(folder, entry["file"])):
                    found[key] = (folder, entry)
    return found


def _read_json(path: str) -> dict | None:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        with open(path) as f:
            return json.load(f)
    return None


def _tail(path: str, lines: int = 3) -> str:
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        kept = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        return " | ".join(kept[-lines:])[-600:]
    return ""


def run_child(argv: list[str], out_path: str, log_path: str, timeout: float) -> dict:
    """Run one row's child (`argv`, which writes its row so far into `out_path` after each
    phase) under `timeout` seconds: its row, or what it had measured with an "error" saying
    why it stopped (the time limit, or its last lines of output). The child and anything it
    started are killed at the limit."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            error = None if proc.returncode == 0 else \
                f"exited with status {proc.returncode}: {_tail(log_path)}"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            error = f"timed out after {timeout:g} s"
    row = _read_json(out_path) or {}
    if error is None and not row.get("complete"):
        error = f"ended without its row: {_tail(log_path)}"
    if error is not None:
        row["error"] = error
        row["ok"] = False
    row["child_s"] = round(time.perf_counter() - start, 2)
    return row


def merge_row(results_path: str, key: str, row: dict) -> dict:
    """Add `row` under `key` to the results JSON (replacing a row of that key), written
    whole; returns the results."""
    results = _read_json(results_path) or {"benchmark": BENCHMARK, "rows": {}}
    if results.get("benchmark") != BENCHMARK:
        raise SystemExit(f"{results_path} holds no {BENCHMARK} results: choose another --json")
    results["rows"][key] = row
    folder = os.path.dirname(os.path.abspath(results_path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{results_path}.partial"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, results_path)
    return results


def child_argv(args, folder: str, key: str, out_path: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "row", folder, key, "--out", out_path,
            "--device", args.device, "--rounds", str(args.rounds), "--round-seconds",
            str(args.round_seconds), "--seed", str(args.seed)]
    if args.site:
        argv += ["--site", os.path.abspath(args.site)]
    if args.compile:
        argv.append("--compile")
    if args.profile:
        argv.append("--profile")
    return argv


def run(args) -> int:
    """Every selected row of the prepared folder, one child each; returns the exit status
    (0 when every row of this call agreed with torch)."""
    entries = load_manifests(args.directory)
    keys = [entry_key(*k) for k in args.keys]
    todo = [k for k in keys if k in entries]
    if not todo:
        print(f"nothing to run: none of {', '.join(keys)} is prepared in {args.directory}")
        return 1
    if args.missing:  # resuming a split run: what an earlier call measured stays
        done = (_read_json(args.json) or {}).get("rows", {})
        todo = [k for k in todo if k not in done or "error" in done[k]]
        if not todo:
            print(f"every row asked for is in {args.json}")
            return 0
    ok = True
    with tempfile.TemporaryDirectory(prefix="vs_torch_gpu_") as tmp:
        for i, key in enumerate(todo):
            folder, _ = entries[key]
            out_path = os.path.join(tmp, f"row{i}.json")
            row = run_child(child_argv(args, folder, key, out_path), out_path,
                            os.path.join(tmp, f"row{i}.log"), args.timeout)
            row["timeout_s"] = args.timeout
            results = merge_row(args.json, key, row)
            print(summary(key, row), flush=True)
            ok = ok and bool(row.get("ok"))
    print()
    print(table(results))
    return 0 if ok else 1


def row_main(args) -> int:
    """The child: one row, written into --out after each phase (whole, by rename)."""
    if args.site:
        sys.path.insert(0, args.site)
    import vs_torch_gpu_measure as measure

    with open(os.path.join(args.directory, MANIFEST)) as f:
        entry = json.load(f)["entries"][args.key]

    def progress(row: dict) -> None:
        tmp = args.out + ".partial"
        with open(tmp, "w") as f:
            json.dump(row, f, indent=1)
        os.replace(tmp, args.out)

    row = measure.measure_row(args.directory, entry, args.device, args.rounds,
                              args.round_seconds, args.compile, args.seed, progress,
                              args.profile)
    row["machine"] = machine(args.device)
    row["complete"] = True
    progress(row)
    return 0


def machine(device: str) -> dict:
    import platform

    import torch
    import tvm

    return {"host": platform.node(), "device": device,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "torch": torch.__version__, "tvm": tvm.__version__,
            "tvm_from": os.path.dirname(tvm.__file__),
            "python": platform.python_version(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


# ------------------------------------------------------------------------------------------
# Reports
# ------------------------------------------------------------------------------------------

COLUMNS = ("tvm_ext", "eager", "bf16_autocast", "compile", "compile_bf16")


def _ms(row: dict, column: str) -> str:
    value = row.get(f"{column}_ms")
    return f"{value:.2f}" if value is not None else ""


def _ratio(row: dict, column: str) -> str:
    value = row.get(f"ratio_{column}")
    return f"{value:.2f}x" if value is not None else ""


def _check(row: dict) -> str:
    if row.get("mode") == "training" and "loss_error" in row:
        p = row.get("parameters_check", {})
        return (f"loss {row['loss_error']:.1e}, {p.get('beyond_tolerance', 0)} noise flips"
                + ("" if row.get("ok") else " FAILED"))
    if "max_abs_error" in row:
        return f"{row['max_abs_error']:.1e}" + ("" if row.get("ok") else " FAILED")
    return ""


def _mib(row: dict, key: str) -> str:
    value = row.get(key)
    return f"{value / 2**20:.0f}" if value is not None else ""


def summary(key: str, row: dict) -> str:
    """One line per measured row."""
    parts = [f"{c} {row[f'{c}_ms']:.2f} ms" for c in COLUMNS if f"{c}_ms" in row]
    calls = row.get("vm_calls", {})
    text = f"{key}: " + ", ".join(parts)
    if calls:
        text += f"; {calls['kernels']} kernel calls"
    text += f"; check {_check(row) or 'not reached'}"
    if "error" in row:
        text += f"; ERROR {row['error']}"
    return text


def table(results: dict) -> str:
    """The accumulated rows as a markdown table (ratios: tvm_ext's time over each column's)."""
    lines = ["| model | mode | dtype | params | tvm_ext ms | eager ms | bf16 autocast ms | "
             "compile ms | compile bf16 ms | / eager | / bf16 | / compile | / compile bf16 | "
             "check | peak MiB tvm_ext / eager | kernel calls |",
             "|" + " --- |" * 16]
    for key in sorted(results["rows"]):
        r = results["rows"][key]
        cells = [r.get("model", key), r.get("mode", ""), r.get("dtype", ""),
                 f"{r['parameters'] / 1e6:.1f}M" if "parameters" in r else "",
                 *(_ms(r, c) for c in COLUMNS), *(_ratio(r, c) for c in COLUMNS[1:]),
                 _check(r) + (f" ({r['error']})" if "error" in r else ""),
                 f"{_mib(r, 'tvm_ext_peak_bytes')} / {_mib(r, 'eager_peak_bytes')}",
                 str(r.get("vm_calls", {}).get("kernels", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------

def _selection(p) -> None:
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="fp32, bf16 (training only: bf16 GEMMs, float32 master weights)")
    p.add_argument("--keys", help="instead: MODEL/MODE/DTYPE,... (e.g. llama/training/bf16)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="compile the models here (TVM's compiler)")
    p.add_argument("directory")
    _selection(p)
    p.add_argument("--target", default="cuda", choices=("cuda", "llvm"),
                   help="llvm: a CPU build, to try the two halves on one machine")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--size", default="bench", choices=("quick", "bench", "real"))
    p.add_argument("--unfused-attention", action="store_true",
                   help="attention and its backward unfused (cuBLAS products): the A/B of "
                        "the fused kernels, into a folder of its own")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="every kernel launched on its own: the A/B of the CUDA graphs, into "
                        "a folder of its own")
    s = sub.add_parser("site", help="pack TVM's runtime and tvm_ext's for the GPU machine")
    s.add_argument("directory")
    r = sub.add_parser("run", help="check and time them (TVM's runtime, PyTorch)")
    r.add_argument("directory")
    _selection(r)
    r.add_argument("--site", help="a runtime site/ folder (`site`, or a GPU bundle's)")
    r.add_argument("--json", default=DEFAULT_JSON, help="where rows accumulate")
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of both halves (with `prepare --target llvm`), not a "
                        "benchmark: benchmarks/vs_torch.py times the CPU, threads matched")
    r.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds each row may take, torch.compile included")
    r.add_argument("--compile", action="store_true", help="torch.compile columns too")
    r.add_argument("--profile", action="store_true",
                   help="tvm_ext's call timed call by call too (its slowest kernels)")
    r.add_argument("--missing", action="store_true",
                   help="only the rows the JSON lacks or holds an error for")
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--round-seconds", type=float, default=0.3)
    r.add_argument("--seed", type=int, default=0, help="of the inputs and labels")
    c = sub.add_parser("row", help=argparse.SUPPRESS)  # one row, in the child of `run`
    c.add_argument("directory")
    c.add_argument("key")
    c.add_argument("--out", required=True)
    c.add_argument("--site")
    c.add_argument("--device", default="cuda")
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--round-seconds", type=float, default=0.3)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--compile", action="store_true")
    c.add_argument("--profile", action="store_true")
    return parser


def _split(parser, args) -> None:
    """args.keys: the (model, mode, dtype) asked for, from --keys or the other options."""
    if args.keys:
        keys = [tuple(k.split("/")) for k in args.keys.split(",")]
        bad = [k for k in keys if len(k) != 3 or k[0] not in MODELS or k[1] not in MODES
               or k[2] not in DTYPES or k not in selected_keys([k[0]], [k[1]], [k[2]])]
        if bad:
            parser.error(f"unknown keys {['/'.join(k) for k in bad]}: MODEL/MODE/DTYPE with "
                         f"MODEL in {', '.join(MODELS)}, MODE in {', '.join(MODES)}, DTYPE "
                         f"in {', '.join(DTYPES)}")
        args.keys = keys
        return
    given = {"models": args.models.split(","), "modes": args.modes.split(","),
             "dtypes": args.dtypes.split(",")}
    for (what, values), known in zip(given.items(), (MODELS, MODES, DTYPES), strict=True):
        unknown = set(values) - set(known)
        if unknown:
            parser.error(f"unknown {what} {sorted(unknown)}; known: {', '.join(known)}")
    args.keys = selected_keys(given["models"], given["modes"], given["dtypes"])


def pack_site(directory: str) -> int:
    """TVM's runtime (no compiler), tvm-ffi for this Python and the GPU machines', and
    tvm_ext's runtime: what `run --site` needs where TVM is not installed."""
    from tvm_ext.driver import bundle_runtime
    from tvm_ext.driver.gpu_bundle import GPU_PYTHON, tree_size

    if os.path.exists(directory):
        raise SystemExit(f"{directory} exists: choose a new folder")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    partial = directory.rstrip("/") + ".partial"
    try:
        bundle_runtime.copy_tvm(partial)
        bundle_runtime.copy_tvm_ffi(partial, {version, GPU_PYTHON}, bundle_runtime.cache_dir(),
                                    print)
        bundle_runtime.copy_typing_extensions(partial)
        bundle_runtime.copy_tvm_ext(partial, None)
        os.replace(partial, directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    size, files = tree_size(directory)
    print(f"{directory}: {size / 2**20:.1f} MiB in {files} files")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "row":
        return row_main(args)
    if args.command == "site":
        return pack_site(args.directory)
    _split(parser, args)
    if args.command == "run" and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.command == "prepare" and args.unfused_attention and args.target != "cuda":
        parser.error("--unfused-attention does nothing with --target llvm: attention is "
                     "fused on GPU targets only")
    if args.command == "prepare" and not args.cuda_graph and args.target != "cuda":
        parser.error("--no-cuda-graph does nothing with --target llvm: CUDA graphs are a "
                     "CUDA build's")
    if args.command == "prepare":
        import warnings

        from vs_torch_gpu_prepare import prepare

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepare(args.directory, args.keys, args.size, args.target, args.arch,
                    fused_attention=not args.unfused_attention, cuda_graph=args.cuda_graph)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
