"""Kernel time of the zoo's largest GEMMs, each compiled alone as a build compiles it (calling
the vendor library through tvm_ext's runtime library, and TVM's own code with `--no-library`),
against `torch.matmul` on the same (batch, M, N, K) where PyTorch is importable."""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..kernel_timing import kernel_arguments, time_kernel
from .report import Failed
from .suite import SuiteRun

REPEAT = 5
MIN_REPEAT_MS = 20  # each repeat runs the kernel until it lasts this long


def check_gemm(suite: SuiteRun, entry: dict) -> dict:
    args = kernel_arguments(entry["params"], suite.device, np.random.default_rng(0))
    flops = float(entry["flops"])
    batch, m, n, k = entry["dims"]
    data = {"kernel": entry["kernel"], "model": entry["model"], "dims": entry["dims"],
            "dtype": entry["dtype"], "gflop": flops / 1e9}
    time_variants(suite, entry, args, data)
    torch_s = _torch_matmul(suite, batch, m, n, k, entry["dtype"], entry.get("batched_b", False))
    if isinstance(torch_s, str):
        data["torch"] = torch_s
    else:
        data["torch_ms"] = torch_s * 1e3
        data["torch_tflops"] = flops / torch_s / 1e12
        for variant in ("library", "tvm"):
            if data.get(f"{variant}_ms"):
                data[f"{variant}_vs_torch"] = data[f"{variant}_ms"] / data["torch_ms"]
    return data


def time_variants(suite: SuiteRun, entry: dict, args, data: dict) -> None:
    """`<variant>_ms` and `<variant>_tflops` in `data` for the entry's library and TVM builds of
    its kernel (None where it has no such build), timed on `args`."""
    for variant in ("library", "tvm"):
        if not entry.get(variant):
            data[f"{variant}_ms"] = None
            continue
        secs = time_kernel(suite.module(entry[variant]), entry["kernel"], args, suite.device,
                           number=1, repeat=REPEAT, min_repeat_ms=MIN_REPEAT_MS)
        median = statistics.median(secs)
        if not np.isfinite(median) or median <= 0:
            raise Failed(f"{variant} kernel: no valid time ({secs})", data)
        data[f"{variant}_ms"] = median * 1e3
        data[f"{variant}_tflops"] = float(entry["flops"]) / median / 1e12


def _torch_matmul(suite: SuiteRun, batch: int, m: int, n: int, k: int, dtype: str,
                  batched_b: bool):
    """Seconds of `torch.matmul` on [batch,] M x K by [batch,] K x N, or why it was not
    timed."""
    try:
        import torch
    except ImportError:
        return "skipped: torch is not importable here"
    device = "cuda" if suite.name == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        return "skipped: torch sees no CUDA device"
    kind = getattr(torch, dtype)
    lead = (batch,) if batch > 1 else ()
    a = torch.randn(*lead, m, k, dtype=kind, device=device)
    b = torch.randn(*(lead if batched_b else ()), k, n, dtype=kind, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def batch_of(number: int) -> float:  # as TVM's time_evaluator: sync once per repeat
        sync()
        start = time.perf_counter()
        for _ in range(number):
            torch.matmul(a, b)
        sync()
        return time.perf_counter() - start

    number = 1
    while batch_of(number) * 1e3 < MIN_REPEAT_MS:
        number *= 2
    return statistics.median(batch_of(number) / number for _ in range(REPEAT))
