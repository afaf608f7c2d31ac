"""Planning time at real scale: the SwapAdvisor search on the AdamW step of the Llama-3.2-1B-
shaped decoder of benchmarks/out_of_core.py (1665 ops in float32, 2138 in bf16), under 1/2,
1/4 and 1/8 of its no-swap peak on the h200 preset, with several seeds: the wall time of the
whole search (`swapadvisor_phases`: both phases, seeding, deriving the plans) and the
simulated throughput of its plan as a % of the unswapped step's.

With `--against DIR` the same searches run a second time with the `tvm_ext` of another
checkout (e.g. `git worktree add /tmp/before <commit>`), in a child process that imports that
tree instead of this one, with `--against-budget` seconds: the side-by-side comparison of one
search against another (medians over the seeds, each the same seed on both sides).

    python benchmarks/planning_time.py [--budget 10] [--seeds 0,1,2] [--dtypes fp32,bf16]
        [--ratios 2,4,8] [--against DIR --against-budget 10] [--graphs DIR] [--json PATH]

The graphs are out_of_core.py's (`--graphs`: its cache, built there on a first run). Prints a
table, writes benchmarks/results/planning_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DEFAULT_GRAPHS = os.path.expanduser(os.path.join("~", ".cache", "tvm_ext", "out_of_core"))


def search_rows(graphs: str, dtypes: list[str], ratios: list[int], seeds: list[int],
                budget: float) -> list[dict]:
    """One row per (dtype, ratio, seed): the search's wall time and its plan's throughput."""
    sys.path.insert(0, HERE)
    from out_of_core import cached_graph

    from tvm_ext.swap import SwapProblem, plan_swaps
    from tvm_ext.swap.search import swapadvisor_phases

    rows = []
    warm = False
    def log(line):
        print(line, file=sys.stderr)

    for dtype in dtypes:
        graph, _ = cached_graph(graphs, dtype, "real", log)
        base = SwapProblem.from_graph(graph, 1 << 62, "h200", name=f"llama-{dtype}")
        # Budgets and ideal of the step as built without a budget (out_of_core.py's).
        step = SwapProblem.from_graph(cached_graph(graphs, dtype, "real", log, False)[0],
                                      1 << 62, "h200")
        ideal = plan_swaps(step, "ideal").predicted_time
        for ratio in ratios:
            problem = base.with_budget(int(step.no_swap_peak() / ratio))
            if not warm:  # load the compiled core once, outside every timed search
                swapadvisor_phases(problem, 0.01, 0)
                warm = True
            for seed in seeds:
                start = time.perf_counter()
                plans = swapadvisor_phases(problem, budget, seed)
                wall = time.perf_counter() - start
                row = {"dtype": dtype, "ratio": ratio, "seed": seed, "wall_s": round(wall, 2),
                       "pct_ideal": round(100 * ideal / plans[-1].predicted_time, 2),
                       "swap_only_pct": round(100 * ideal / plans[0].predicted_time, 2),
                       "evaluations": plans[-1].info["evaluations"],
                       "generations": plans[-1].info["generations"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def against_rows(src: str, args) -> list[dict]:
    """The rows of the same searches run with the `tvm_ext` of the checkout at `src`."""
    if not os.path.isdir(os.path.join(src, "tvm_ext")):
        raise SystemExit(f"--against {src}: no tvm_ext package there")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", src, "--budget",
           str(args.against_budget), "--seeds", args.seeds, "--dtypes", args.dtypes,
           "--ratios", args.ratios, "--graphs", args.graphs]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _import_from(src: str) -> None:
    """Make `import tvm_ext` load the checkout at `src` rather than the installed package
    (an editable install's finder comes before sys.path, so it is taken out)."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.path.abspath(src))
    import tvm_ext

    if not os.path.abspath(tvm_ext.__file__).startswith(os.path.abspath(src)):
        raise SystemExit(f"could not import tvm_ext from {src} (got {tvm_ext.__file__})")


def _git_head(path: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def summary(rows: list[dict], before: list[dict]) -> list[dict]:
    """Per (dtype, ratio): medians over the seeds, and against `before` where given."""
    out = []
    for key in dict.fromkeys((r["dtype"], r["ratio"]) for r in rows):
        mine = [r for r in rows if (r["dtype"], r["ratio"]) == key]
        line = {"dtype": key[0], "ratio": key[1],
                "wall_s": statistics.median(r["wall_s"] for r in mine),
                "wall_max_s": max(r["wall_s"] for r in mine),
                "pct_ideal": statistics.median(r["pct_ideal"] for r in mine)}
        theirs = [r for r in before if (r["dtype"], r["ratio"]) == key]
        if theirs:
            line["before_wall_s"] = statistics.median(r["wall_s"] for r in theirs)
            line["before_pct_ideal"] = statistics.median(r["pct_ideal"] for r in theirs)
            line["throughput_vs_before"] = round(line["pct_ideal"] / line["before_pct_ideal"],
                                                 4)
        out.append(line)
    return out


def print_table(lines: list[dict]) -> None:
    head = f"{'dtype':5} {'ratio':>5} {'wall s':>7} {'max s':>6} {'SA %':>6}"
    against = any("before_pct_ideal" in line for line in lines)
    if against:
        head += f" {'before s':>8} {'before %':>8} {'x before':>8}"
    print(head)
    print("-" * len(head))
    for line in lines:
        text = (f"{line['dtype']:5} {line['ratio']:>5} {line['wall_s']:7.2f} "
                f"{line['wall_max_s']:6.2f} {line['pct_ideal']:6.2f}")
        if "before_pct_ideal" in line:
            text += (f" {line['before_wall_s']:8.2f} {line['before_pct_ideal']:8.2f} "
                     f"{line['throughput_vs_before']:8.4f}")
        print(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=10.0)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--ratios", default="2,4,8")
    parser.add_argument("--graphs", default=DEFAULT_GRAPHS)
    parser.add_argument("--against", metavar="DIR", default=None)
    parser.add_argument("--against-budget", type=float, default=10.0)
    parser.add_argument("--json", default=os.path.join(RESULTS, "planning_time.json"))
    parser.add_argument("--child", metavar="DIR", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    dtypes = args.dtypes.split(",")
    ratios = [int(r) for r in args.ratios.split(",")]
    if args.child:
        _import_from(args.child)
        search_rows(args.graphs, dtypes, ratios, seeds, args.budget)
        return
    json_dir = os.path.dirname(os.path.abspath(args.json))
    if not os.access(json_dir, os.W_OK):
        raise SystemExit(f"--json {args.json}: cannot write to {json_dir}")
    before = against_rows(args.against, args) if args.against else []
    rows = search_rows(args.graphs, dtypes, ratios, seeds, args.budget)
    lines = summary(rows, before)
    print_table(lines)
    result = {"benchmark": "planning_time", "budget_s": args.budget, "seeds": seeds,
              "commit": _git_head(HERE), "summary": lines, "rows": rows}
    if args.against:
        result.update(against={"commit": _git_head(args.against),
                               "budget_s": args.against_budget, "rows": before})
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
