"""Compiling one PrimFunc for CUDA in a test (nvcc is on the build machine; no GPU needed)."""

from __future__ import annotations

import tvm


def cuda_source(func, target) -> str:
    """The CUDA source `func` compiles to for `target` (compiling it with nvcc on the way)."""
    with target:
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                          target=target)
    return "\n".join(m.inspect_source() for m in [lib.mod, *lib.mod.imports]
                     if m.kind == "cuda")
