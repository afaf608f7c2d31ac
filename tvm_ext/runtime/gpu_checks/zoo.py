"""Exported zoo modules (inference and training step) against the outputs of the CPU build,
computed where the bundle was built, on the same arguments: the first call's outputs, and the
last timed call's (which replays the kernel graphs the first call captured)."""

from __future__ import annotations

from ..kernel_graphs import graph_stats, reset_graph_stats
from ..vm_run import run
from .suite import SuiteRun, compare_expected

REPEAT = 3


def check_module(suite: SuiteRun, entry: dict) -> dict:
    args = suite.arrays(entry["arguments"])
    expected = suite.arrays(entry["expected"])
    reset_graph_stats()
    result = run(suite.module(entry["module"]), args, suite.device, repeat=REPEAT)
    data = {"latency_ms": result.median_ms, "peak_bytes": result.peak_bytes,
            "argument_bytes": result.argument_bytes, "reference": entry["reference"],
            "cuda_graphs": graph_stats()}
    replayed = compare_expected(result.last_outputs, expected, entry["tolerances"], data,
                                f"{entry['reference']} (a replayed call)")
    return {**data, **compare_expected(result.outputs, expected, entry["tolerances"], data,
                                       entry["reference"]),
            "replay_max_abs_error": replayed["max_abs_error"]}
