"""The corpus sweep: every third-party model of tests/corpus in every mode, compiled by
`scripts/compile.py`, run on this CPU, and checked against the unmodified TVM build and against
PyTorch eager (gradients against torch.autograd for the training step).

A cell is "ok" with the largest error against PyTorch, or the clear error a user gets (a swap
budget below the largest operator's working set, a mode with nothing to differentiate), or
FAIL. Writes benchmarks/results/corpus_sweep.json and prints the table in benchmarks/README.md.

Usage: python benchmarks/corpus_sweep.py [--models a,b] [--modes plain,k4] [--shard I/N]
           [--out PATH]
       python benchmarks/corpus_sweep.py --merge PART.json... [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import corpus  # noqa: E402


def sweep(models: list[str], modes: list[str], shard: tuple[int, int]) -> dict:
    cells = [(m, mode) for m in models for mode in modes
             if not (corpus.BY_NAME[m].kind == "op" and mode not in corpus.OP_MODES)]
    cells = cells[shard[0]::shard[1]]
    results: dict = {}
    with tempfile.TemporaryDirectory() as directory:
        for name, mode in cells:
            path, _ = corpus.export(corpus.BY_NAME[name], directory)
            cell = corpus.run_cell(path, corpus.MODES[mode])
            results.setdefault(name, {})[mode] = cell
            print(f"{name:22s} {mode:10s} {cell['result']:8s} {cell['seconds']:6.1f} s "
                  f"{cell.get('message', '')[:120]}", flush=True)
    return results


def table(results: dict) -> str:
    modes = [m for m in corpus.MODES if any(m in r for r in results.values())]
    lines = ["| model | " + " | ".join(modes) + " |", "| --- |" + " --- |" * len(modes)]
    notes: dict[str, int] = {}
    for c in corpus.MODELS:
        if c.name not in results:
            continue
        row = []
        for mode in modes:
            cell = results[c.name].get(mode)
            if cell is None:
                row.append("")
            elif cell["result"] == "ok":
                row.append("ok")
            elif cell["result"] == "refused":
                note = _reason(cell["message"])
                row.append(f"refused ({notes.setdefault(note, len(notes) + 1)})")
            else:
                row.append("**FAIL**")
        lines.append(f"| {c.name} | " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"({n}) {note}" for note, n in notes.items()]
    return "\n".join(lines)


def _reason(message: str) -> str:
    """The kind of refusal, without the model's numbers."""
    if "smallest feasible budget" in message:
        return ("the budget is below one operator's working set: the smallest feasible budget "
                "is printed")
    if "no trainable parameter" in message:
        return "nothing to differentiate"
    return message.split(": ", 1)[-1][:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(m.name for m in corpus.MODELS))
    parser.add_argument("--modes", default=",".join(corpus.MODES))
    parser.add_argument("--shard", default="0/1", help="I/N: run every N-th cell from I")
    parser.add_argument("--merge", nargs="+", help="merge the JSON of shards instead")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/corpus_sweep.json"))
    args = parser.parse_args()
    if args.merge:
        results: dict = {}
        for part in args.merge:
            for name, cells in json.loads(Path(part).read_text())["results"].items():
                results.setdefault(name, {}).update(cells)
    else:
        i, n = (int(x) for x in args.shard.split("/"))
        results = sweep(args.models.split(","), args.modes.split(","), (i, n))
    import torch
    import transformers
    import tvm

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "tvm": tvm.__version__, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(table(results))
    failed = [(m, mode) for m, cells in results.items() for mode, c in cells.items()
              if c["result"] == "FAIL"]
    if failed:
        print(f"{len(failed)} FAILED: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
