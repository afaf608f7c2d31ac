"""Out-of-core training on a GPU, measured: benchmarks/out_of_core.py's AdamW step (a
Llama-3.2-1B-shaped decoder, 1.24B parameters, batch 4 x 1024, fp32 and bf16 with fp32 master
weights) compiled here unswapped and under budgets of 1/R of its no-swap peak, then run on the
GPU machine beside PyTorch training the same model from the same weights under the same budget
(activation checkpointing, checkpointing with `save_on_cpu`, FSDP2 with `CPUOffloadPolicy`,
alone and with checkpointing: benchmarks/out_of_core_gpu_steps.py).

    python benchmarks/out_of_core_gpu.py prepare DIR [--size real|quick] [--dtypes fp32,bf16]
        [--ratios 4,8] [--target cuda] [--hardware h200] [--time-budget 10]      # here
    python benchmarks/out_of_core_gpu.py run DIR --json J [--dtypes ...] [--rows ...]
        [--steps 4] [--timeout 200] [--site SITE] [--missing]                   # on the GPU
    python benchmarks/out_of_core_gpu.py simulate DIR --json J                   # here
    python benchmarks/out_of_core_gpu.py table J

`run` measures each row in a child process under `--timeout` seconds and writes it into the
JSON as soon as it has it, so one slow or failing row costs only itself. Rows: `tvm:ideal`
(the unswapped step, unbudgeted), `tvm:R` (the swapped module), `torch:eager` (unbudgeted) and
`torch:WAY:R` for each way of out_of_core_gpu_steps.TORCH_WAYS, and `tvm:twin` (the budgeted
builds' unswapped twin timed call by call: its kernels' times in place). `simulate`, here,
runs each swapped module's plan again in the simulator fed those kernel times and the link
measured beside them, for measured against simulated. The table gives each row's
step time, throughput against the unswapped step, device memory, and whether its losses
equal the unswapped build's (fp32 within 1e-5 relative, bf16 within 1%; the unswapped build's
first loss against PyTorch eager's within vs_torch_gpu's tolerance), and for each budget the
link bound (the bytes above the budget out and back over the link measured beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from out_of_core_gpu_prepare import MANIFEST  # noqa: E402
from out_of_core_gpu_steps import TORCH_WAYS  # noqa: E402
from vs_torch_gpu import _read_json, run_child  # noqa: E402

BENCHMARK = "out_of_core_gpu"
# Losses of a budgeted run against the unswapped build's, relative (out_of_core's issue).
LOSS_RTOL = {"fp32": 1e-5, "bf16": 1e-2}
BUDGETED_WAYS = tuple(w for w in TORCH_WAYS if w != "eager")


# Measured against simulated step time, relative (out_of_core's issue).
SIMULATED_RTOL = 0.15


def ratios_of(entry: dict) -> list[str]:
    """The budgets 1/R a dtype was prepared for (the keys R of its swapped modules)."""
    return [k for k in entry["modules"] if k not in ("ideal", "twin")]


def row_keys(entry: dict) -> list[str]:
    """Every row of a prepared dtype, in the order `run` measures them."""
    keys = ["link", "tvm:ideal", "torch:eager"]
    for r in ratios_of(entry):
        keys += [f"tvm:{r}", *(f"torch:{w}:{r}" for w in BUDGETED_WAYS)]
    if "twin" in entry["modules"]:
        keys.append("tvm:twin")
    return keys


def merge_row(path: str, key: str, row: dict) -> dict:
    results = _read_json(path) or {"benchmark": BENCHMARK, "rows": {}}
    if results.get("benchmark") != BENCHMARK:
        raise SystemExit(f"{path} holds no {BENCHMARK} results: choose another --json")
    results["rows"][key] = row
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".partial", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".partial", path)
    return results


def _manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise SystemExit(f"{directory} holds no prepared modules ({MANIFEST}): run `prepare`")
    with open(path) as f:
        return json.load(f)


def run(args) -> int:
    manifest = _manifest(args.directory)
    todo = []
    for dtype in args.dtypes:
        entry = manifest["entries"].get(dtype)
        if entry is None:
            print(f"{dtype}: not prepared in {args.directory}")
            continue
        keys = row_keys(entry)
        unknown = [r for r in args.rows if r not in keys]
        if unknown:
            raise SystemExit(f"{dtype} has no rows {', '.join(unknown)}; its rows: "
                             f"{', '.join(keys)}")
        if args.rows:
            keys = [k for k in keys if k in args.rows]
        todo += [(dtype, k) for k in keys]
    if args.missing:
        done = (_read_json(args.json) or {}).get("rows", {})
        todo = [(d, k) for d, k in todo if f"{d}/{k}" not in done
                or ("error" in done[f"{d}/{k}"] and done[f"{d}/{k}"].get("fits") is not False)]
    results = _read_json(args.json) or {"rows": {}}
    with tempfile.TemporaryDirectory(prefix="out_of_core_gpu_") as tmp:
        for i, (dtype, key) in enumerate(todo):
            out = os.path.join(tmp, f"row{i}.json")
            argv = [sys.executable, os.path.abspath(__file__), "row", args.directory, dtype,
                    key, "--out", out, "--device", args.device, "--steps", str(args.steps),
                    "--seed", str(args.seed)]
            if args.site:
                argv += ["--site", os.path.abspath(args.site)]
            row = run_child(argv, out, os.path.join(tmp, f"row{i}.log"), args.timeout)
            row["timeout_s"] = args.timeout
            results = merge_row(args.json, f"{dtype}/{key}", row)
            print(summary_line(f"{dtype}/{key}", row), flush=True)
    print()
    print(table(results))
    return 0


def row_main(args) -> int:
    """The child: one row, written into --out after each step (whole, by rename)."""
    if args.site:
        sys.path.insert(0, args.site)
    import out_of_core_gpu_steps as steps

    manifest = _manifest(args.directory)
    entry = manifest["entries"][args.dtype]
    side, _, rest = args.key.partition(":")
    row = {"dtype": args.dtype, "row": args.key, "tokens": entry["tokens"], "seed": args.seed}

    def progress(r: dict) -> None:
        with open(args.out + ".partial", "w") as f:
            json.dump(r, f, indent=1)
        os.replace(args.out + ".partial", args.out)

    if side == "link":
        steps.link_row(args.device, row, progress)
    elif args.key == "tvm:twin":
        steps.twin_row(args.directory, entry, entry["modules"]["twin"], args.device, args.seed,
                       row, progress)
    elif side == "tvm":
        module = entry["modules"][rest]
        row.update({k: v for k, v in module.items() if k not in ("plan", "file")})
        steps.tvm_row(args.directory, entry, module, args.device, args.steps, args.seed, row,
                      progress)
    else:
        way, _, ratio = rest.partition(":")
        budget = entry["modules"][ratio]["budget_bytes"] if ratio else None
        row["budget_bytes"] = budget
        steps.torch_row(entry, way, budget, args.device, args.steps, args.seed, row, progress)
    row["complete"] = True
    progress(row)
    return 0


def simulate(args) -> int:
    """Here, after a GPU run: each swapped module's plan simulated again with the kernel
    times of the `tvm:twin` row (the rest keep the roofline's) and the link of the `link` row
    (else the preset's), written into its row as `simulated_s`."""
    import dataclasses
    import gzip

    import numpy as np
    from out_of_core_gpu_prepare import plan_file

    from tvm_ext.swap import SwapPlan, SwapProblem
    from tvm_ext.swap import simulate as simulate_plan

    manifest = _manifest(args.directory)
    results = _read_json(args.json)
    if results is None:
        raise SystemExit(f"{args.json}: no results")
    rows = results["rows"]
    for dtype in args.dtypes:
        entry = manifest["entries"].get(dtype)
        twin = rows.get(f"{dtype}/tvm:twin", {})
        if entry is None or "kernel_s" not in twin:
            print(f"{dtype}: no tvm:twin row with kernel times in {args.json}: nothing to "
                  f"simulate")
            continue
        link = rows.get(f"{dtype}/link", {})
        for ratio in ratios_of(entry):
            key = f"{dtype}/tvm:{ratio}"
            if not rows.get(key, {}).get("step_s"):
                print(f"{key}: not measured in {args.json}: nothing to compare with")
                continue
            with gzip.open(os.path.join(args.directory, plan_file(
                    entry["modules"][ratio]["file"])), "rt") as f:
                data = json.load(f)
            problem = SwapProblem.from_dict(data["problem"])
            durations = np.array(problem.durations, dtype=np.float64)
            kinds = problem.op_kinds or ["kernel"] * problem.num_ops
            kernels = [i for i in range(problem.num_ops) if kinds[i] == "kernel"]
            names = problem.op_kernels or [None] * problem.num_ops
            timed = 0
            for i in kernels:
                seconds = _timed_kernel(twin["kernel_s"], names[i])
                if seconds is not None:
                    durations[i], timed = seconds, timed + 1
            measured_link = "h2d_bytes_per_s" in link
            bandwidths = {"h2d_bandwidth": link["h2d_bytes_per_s"],
                          "d2h_bandwidth": link["d2h_bytes_per_s"]} if measured_link else {}
            problem = dataclasses.replace(problem, durations=durations, **bandwidths)
            sim = simulate_plan(problem, SwapPlan.from_dict(data["plan"]))
            row = rows[key]
            row.update(simulated_s=float(sim.makespan),
                       simulated_kernels_timed=f"{timed} of {len(kernels)}",
                       simulated_link="measured" if measured_link else "preset")
            results = merge_row(args.json, key, row)
            rows = results["rows"]
            print(f"{key}: simulated {sim.makespan * 1e3:.1f} ms ({timed} of "
                  f"{len(kernels)} kernel ops timed in place, link "
                  f"{row['simulated_link']}), measured {row['step_s'] * 1e3:.1f} ms")
    print()
    print(table(results))
    return 0


def _timed_kernel(kernel_s: dict, name: str | None) -> float | None:
    """A kernel op's time in the twin's profile: the build renames a kernel it rewrites (its
    in-place form writing an argument, its broadcast constants at their extent)."""
    for callee in (name, f"{name}_inplace", f"{name}_bc"):
        if name is not None and callee in kernel_s:
            return kernel_s[callee]
    return None


# ------------------------------------------------------------------------------------------
# Reading the results
# ------------------------------------------------------------------------------------------
def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def checks(results: dict) -> dict:
    """Per row: its throughput against the unswapped step, its losses against the unswapped
    build's, and whether it kept to its budget (device memory of the row within it)."""
    from vs_torch_gpu_measure import LOSS_RTOL as TORCH_RTOL

    rows = results["rows"]
    out = {}
    for key, row in rows.items():
        dtype = key.split("/")[0]
        ideal = rows.get(f"{dtype}/tvm:ideal", {})
        c = {}
        if row.get("step_s") and ideal.get("step_s"):
            c["of_ideal"] = ideal["step_s"] / row["step_s"]
        losses, reference = row.get("losses"), ideal.get("losses")
        if key.endswith("tvm:ideal"):
            eager = rows.get(f"{dtype}/torch:eager", {}).get("losses")
            if losses and eager:
                c["loss_vs_torch"] = _rel(losses[0], eager[0])
                c["losses_ok"] = c["loss_vs_torch"] <= TORCH_RTOL[dtype]
        elif "/tvm:" in key and losses and reference:
            c["loss_error"] = max(_rel(a, b) for a, b in zip(losses, reference, strict=False))
            c["losses_ok"] = c["loss_error"] <= LOSS_RTOL[dtype]
        budget = row.get("budget_bytes")
        if budget and row.get("device_row_bytes") is not None:
            c["within_budget"] = row["device_row_bytes"] <= budget
        link = rows.get(f"{dtype}/link", {})
        if "/tvm:" in key and row.get("no_swap_peak_bytes") and "h2d_bytes_per_s" in link:
            # The bytes above the budget out and back, both ways at once.
            excess = row["no_swap_peak_bytes"] - budget
            c["link_bound_s"] = excess / min(link["h2d_bytes_per_s"], link["d2h_bytes_per_s"])
            if row.get("step_s") and ideal.get("step_s"):
                c["of_limit"] = max(ideal["step_s"], c["link_bound_s"]) / row["step_s"]
        if "/tvm:" in key and budget and row.get("step_s"):
            # Against the fastest PyTorch way that ran within the same budget; none: "n/a".
            ratio = key.rsplit(":", 1)[1]
            fitting = [r["step_s"] for k, r in rows.items()
                       if k.startswith(f"{dtype}/torch:") and k.endswith(f":{ratio}")
                       and r.get("step_s") and r.get("fits") and r.get("budget_enforced")
                       and "error" not in r]
            c["vs_best_torch"] = min(fitting) / row["step_s"] if fitting else None
        if row.get("simulated_s") and row.get("step_s"):
            c["measured_over_simulated"] = row["step_s"] / row["simulated_s"]
            c["simulated_ok"] = abs(c["measured_over_simulated"] - 1) <= SIMULATED_RTOL
        out[key] = c
    return out


def summary_line(key: str, row: dict) -> str:
    if row.get("fits") is False:
        return f"{key}: does not fit ({row.get('error', '')[:120]})"
    if "error" in row:
        return f"{key}: error: {row['error'][:200]}"
    if "h2d_bytes_per_s" in row:
        return (f"{key}: host to device {row['h2d_bytes_per_s'] / 1e9:.1f} GB/s, device to "
                f"host {row['d2h_bytes_per_s'] / 1e9:.1f} GB/s")
    if "kernel_s" in row:
        p = row["profile"]
        return (f"{key}: {p['wall_ms']:.1f} ms/step, {p['kernel_calls']} kernel calls "
                f"timed in place ({p['kernels_net_ms']:.1f} ms), {len(row['kernel_s'])} "
                f"kernels")
    used = row.get("device_row_bytes")
    mem = f", device {_size(used)}" if used is not None else ""
    return (f"{key}: {row['step_s'] * 1e3:.1f} ms/step, {row.get('tokens_per_s', 0):.0f} "
            f"tokens/s{mem}, losses {', '.join(f'{x:.6g}' for x in row['losses'])}")


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return ""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def table(results: dict) -> str:
    c = checks(results)
    lines = ["| dtype | row | budget | ms/step | tokens/s | % of ideal | link bound ms | "
             "% of limit | x best torch | simulated ms | measured / simulated | device | "
             "losses | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
             "--- |"]
    for key, row in results["rows"].items():
        dtype, name = key.split("/", 1)
        k = c.get(key, {})
        budget = row.get("budget_bytes")
        used = row.get("device_row_bytes")
        ok = k.get("losses_ok")
        lines.append("| " + " | ".join([
            dtype, name, _size(budget),
            f"{row['step_s'] * 1e3:.1f}" if row.get("step_s") else "",
            f"{row['tokens_per_s']:.0f}" if row.get("tokens_per_s") else "",
            f"{100 * k['of_ideal']:.1f}" if "of_ideal" in k else "",
            f"{k['link_bound_s'] * 1e3:.1f}" if "link_bound_s" in k else "",
            f"{100 * k['of_limit']:.1f}" if "of_limit" in k else "",
            "" if "vs_best_torch" not in k else
            ("n/a" if k["vs_best_torch"] is None else f"{k['vs_best_torch']:.2f}"),
            f"{row['simulated_s'] * 1e3:.1f}" if row.get("simulated_s") else "",
            "" if "measured_over_simulated" not in k else
            f"{k['measured_over_simulated']:.2f}" + ("" if k["simulated_ok"] else " (> 15%)"),
            _size(used),
            "" if ok is None else ("equal" if ok else "DIFFER"),
            "does not fit" if row.get("fits") is False else
            (row["error"][:60] if "error" in row else "")]) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="compile the modules (here)")
    prep.add_argument("directory")
    prep.add_argument("--size", choices=("real", "quick"), default="real")
    prep.add_argument("--dtypes", default="fp32,bf16")
    prep.add_argument("--ratios", default="4,8")
    prep.add_argument("--target", default="cuda")
    prep.add_argument("--hardware", default="h200")
    prep.add_argument("--time-budget", type=float, default=10.0)
    prep.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="measure the rows (on the GPU machine)")
    r.add_argument("directory")
    r.add_argument("--json", required=True)
    r.add_argument("--dtypes", default="fp32,bf16")
    r.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    r.add_argument("--steps", type=int, default=4, help="iterations per row, the first "
                   "untimed (default 4)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeout", type=float, default=200.0)
    r.add_argument("--device", default="cuda")
    r.add_argument("--site", default=None, help="TVM's runtime and tvm_ext's "
                   "(vs_torch_gpu.py site) where TVM is not installed")
    r.add_argument("--missing", action="store_true",
                   help="only rows not yet in --json (or that failed)")
    row = sub.add_parser("row")
    row.add_argument("directory")
    row.add_argument("dtype")
    row.add_argument("key")
    row.add_argument("--out", required=True)
    row.add_argument("--device", default="cuda")
    row.add_argument("--steps", type=int, default=4)
    row.add_argument("--seed", type=int, default=0)
    row.add_argument("--site", default=None)
    sim = sub.add_parser("simulate", help="simulate the swapped modules' plans with the "
                         "kernel times and link measured on the GPU (here)")
    sim.add_argument("directory")
    sim.add_argument("--json", required=True)
    sim.add_argument("--dtypes", default="fp32,bf16")
    t = sub.add_parser("table", help="print the table of a results JSON")
    t.add_argument("json")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "row":
        return row_main(args)
    if args.command == "table":
        results = _read_json(args.json)
        if results is None:
            raise SystemExit(f"{args.json}: no results")
        print(table(results))
        return 0
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in LOSS_RTOL for d in args.dtypes):
        parser.error(f"--dtypes takes {', '.join(LOSS_RTOL)}")
    if args.command == "simulate":
        return simulate(args)
    if args.command == "prepare":
        import warnings

        from out_of_core_gpu_prepare import prepare

        ratios = [int(x) for x in args.ratios.split(",") if x]
        if not ratios or min(ratios) < 2:
            parser.error("--ratios takes integers of at least 2 (budgets of 1/R of the peak)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepare(args.directory, args.size, args.dtypes, ratios, args.target,
                    args.hardware, args.time_budget, args.seed)
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is not timed)")
    args.rows = [x for x in args.rows.split(",") if x]
    with contextlib.suppress(BrokenPipeError):
        return run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
