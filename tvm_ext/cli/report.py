"""What scripts/compile.py writes: outputs replaced whole or not at all, and the JSON report."""

from __future__ import annotations

import contextlib
import json
import os
import sys

from tvm_ext import interrupts
from tvm_ext.units import json_default


@contextlib.contextmanager
def replacing(*paths: str):
    """Temporary names beside `paths` to write to: on success each replaces its path at once
    (os.replace), on failure they are removed, so an existing file is never lost or left half
    written."""
    temps = []
    for path in paths:
        head, tail = os.path.split(os.path.abspath(path))
        # Keep the suffix: export_library and savefig pick the format from it.
        temps.append(os.path.join(head, f".{tail}.{os.getpid()}.tmp{os.path.splitext(tail)[1]}"))
    try:
        # An interrupt removes the temporaries; it waits for the renames (all or none).
        with interrupts.phase("writing", hooked=False), interrupts.writing(*temps):
            yield temps
            interrupts.hook("writing")  # (a test's: the temporaries are written by now)
            with interrupts.critical():
                for temp, path in zip(temps, paths, strict=True):
                    os.replace(temp, path)
    finally:
        for temp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)


def remove_stale_sidecars(output: str, keep: tuple[str, ...]) -> None:
    """Sidecars of an earlier export to the same path that this module does not have: left
    there, they would describe another module."""
    for suffix in (".swap.json", ".partition.json"):
        path = output + suffix
        if suffix not in keep and os.path.isfile(path):
            os.remove(path)
            print(f"export  removed {path} (it described an earlier export)")


def write_report(args, report: dict) -> None:
    if args.report:
        with replacing(args.report) as (temp,), open(temp, "w") as f:
            json.dump(report, f, indent=2, default=json_default)
        print(f"report  {args.report}")


def failed_check(report: dict, reference: str, problems: list[str]) -> int:
    """Record and print a --check that found `problems` against `reference`; the exit status."""
    report["check"] = {"ok": False, "reference": reference, "error": "; ".join(problems)}
    print(f"check   FAILED: {'; '.join(problems)}", file=sys.stderr)
    return 1
