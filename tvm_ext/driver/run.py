"""Run a compiled module and check it (`tvm_ext.runtime.vm_run`, which needs no compiler, so
that a deployed module is run and checked by the same code)."""

from __future__ import annotations

from ..runtime.vm_run import CheckResult, RunResult, compare, flatten_outputs, run

__all__ = ["CheckResult", "RunResult", "compare", "flatten_outputs", "run"]
