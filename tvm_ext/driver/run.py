"""Run a compiled module and check its outputs: re-exported from the runtime layer, so
that a deployed module is run and checked the same way without TVM's compiler."""

from __future__ import annotations

from ..runtime.vm_run import (
    CheckResult,
    RunResult,
    compare,
    flatten_outputs,
    place_argument,
    run,
)

__all__ = ["CheckResult", "RunResult", "compare", "flatten_outputs", "place_argument", "run"]
