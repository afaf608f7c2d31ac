"""Timing a batch of tuning candidates built elsewhere: the measuring step of offline tuning.

`tvm_ext.schedules.offline.export_batch` builds the candidates of a MetaSchedule search on a
machine that cannot run them (CUDA without a GPU) into one library plus `batch.json`;
`measure_batch` times each candidate where they can run, with TVM's runtime alone (the GPU
bundle runs it), and writes `measurements.json`; `tvm_ext.schedules.offline.import_measurements`
brings the times back into the tuning database. The batch, as this step reads it:

    DIR/batch.json      {"format", "id", "target_key", "library": "candidates.so",
                         "candidates": [{"function", "task", "params": [[shape, dtype], ...]}],
                         ...what the import step needs (workloads, traces)}
    DIR/candidates.so   one function per candidate
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np
import tvm

from .kernel_timing import kernel_arguments, time_kernel

FORMAT = 1
BATCH_FILE = "batch.json"
LIBRARY_FILE = "candidates.so"
MEASUREMENTS_FILE = "measurements.json"
# How a candidate is timed, here and by MetaSchedule's runner (schedules/measure.py): repeats
# of at least 40 ms each; the median of the repeats is the candidate's time.
EVALUATOR = dict(number=1, repeat=3, min_repeat_ms=40, enable_cpu_cache_flush=False)


def read_batch(batch_dir: str) -> dict:
    path = os.path.join(batch_dir, BATCH_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{batch_dir} holds no tuning batch (no {BATCH_FILE})")
    with open(path) as f:
        batch = json.load(f)
    if batch.get("format") != FORMAT:
        raise ValueError(f"{path}: batch format {batch.get('format')}, expected {FORMAT}")
    return batch


def measure_batch(batch_dir: str, device: tvm.runtime.Device, *, seed: int = 0,
                  time_budget_s: float | None = None) -> dict:
    """Time every candidate of the batch in `batch_dir` on `device`; the measurements (also
    written to `batch_dir/measurements.json` when that directory is writable).

    Each candidate gets its repeats' seconds, or an error (a candidate that fails to run, or
    one not reached within `time_budget_s`, is recorded as such and never imported).
    """
    batch = read_batch(batch_dir)
    module = tvm.runtime.load_module(os.path.join(batch_dir, batch["library"]))
    rng = np.random.default_rng(seed)
    arguments: dict[str, list] = {}
    start = time.perf_counter()
    rows = []
    for cand in batch["candidates"]:
        row = {"function": cand["function"], "task": cand["task"], "seconds": None}
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            row["error"] = f"not timed: the time budget of {time_budget_s:.0f} s was spent"
            rows.append(row)
            continue
        try:
            if cand["task"] not in arguments:  # one set per kernel: every candidate reads it
                arguments[cand["task"]] = kernel_arguments(cand["params"], device, rng)
            row["seconds"] = time_kernel(module, cand["function"], arguments[cand["task"]],
                                         device, number=EVALUATOR["number"],
                                         repeat=EVALUATOR["repeat"],
                                         min_repeat_ms=EVALUATOR["min_repeat_ms"])
        except Exception as err:  # one failing candidate must not lose the others' times
            row["error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1]}"
        rows.append(row)
    measurements = {"format": FORMAT, "batch": batch["id"], "target_key": batch["target_key"],
                    "device": device_description(device), "host": platform.node(),
                    "candidates": rows}
    _write_if_possible(os.path.join(batch_dir, MEASUREMENTS_FILE), measurements)
    return measurements


def device_description(device: tvm.runtime.Device) -> str:
    """The device and its name (a GPU's model; the CPU's architecture)."""
    if device.dlpack_device_type() == tvm.cpu().dlpack_device_type():
        return f"{device} ({platform.machine()})"
    return f"{device} ({device.device_name})"


def _write_if_possible(path: str, data: dict) -> None:
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a read-only bundle: the caller keeps the returned measurements
