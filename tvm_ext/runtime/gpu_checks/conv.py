"""The zoo's largest convolutions (forward, data and weight gradients), each compiled alone as a
build compiles it: the vendor library's call (cuDNN on CUDA) against TVM's own code
(`--no-library`) on the same arguments, then both timed. The library's first check on a
device: a wrong descriptor, layout or algorithm shows here before it shows in a model."""

from __future__ import annotations

import numpy as np

from ..kernel_timing import kernel_arguments, kernel_module
from .gemm import time_variants
from .report import Failed
from .suite import SuiteRun


def _outputs(suite: SuiteRun, relative: str, kernel: str, params) -> list[np.ndarray]:
    """Every argument after one call of the kernel on the same random arguments."""
    args = kernel_arguments(params, suite.device, np.random.default_rng(0))
    kernel_module(suite.module(relative), kernel)[kernel](*args)
    suite.device.sync()
    return [a.numpy() for a in args]


def check_conv(suite: SuiteRun, entry: dict) -> dict:
    kernel, params = entry["kernel"], entry["params"]
    data = {"kernel": kernel, "model": entry["model"], "axes": entry["axes"],
            "dtype": entry["dtype"], "gflop": float(entry["flops"]) / 1e9}
    if entry.get("library") and entry.get("tvm"):
        got = _outputs(suite, entry["library"], kernel, params)
        want = _outputs(suite, entry["tvm"], kernel, params)
        scale = max(float(np.abs(w).max()) for w in want if w.size)
        errors = [float(np.abs(g.astype("float64") - w.astype("float64")).max())
                  for g, w in zip(got, want, strict=True) if g.size]
        data["max_abs_error"] = max(errors)
        data["scale"] = scale
        if not all(np.isfinite(g).all() for g in got) or data["max_abs_error"] > 1e-3 * scale:
            raise Failed(f"the library's result differs from TVM's code by "
                         f"{data['max_abs_error']:.3g} (largest value {scale:.3g})", data)
    time_variants(suite, entry, kernel_arguments(params, suite.device,
                                                 np.random.default_rng(0)), data)
    if data.get("library_ms") and data.get("tvm_ms"):
        data["library_vs_tvm"] = data["library_ms"] / data["tvm_ms"]
    return data
