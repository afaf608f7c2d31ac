"""CPU kernels of transcendental ops under the default schedule: libm calls against the
vectorisable polynomials of `schedules/default_cpu_math.py`, with NaN tested by TVM's `isnan`
call (as before 2026-11-30) and on the bits (today's: the call stopped TVM's vectoriser on
FocalNet's training step, see `_is_nan`).

Each op on one float32 tensor, built through the tvm_ext pipeline for llvm three ways in one
process and timed in interleaved rounds (medians); outputs checked equal to the libm build's
within 1e-5 first.

    python benchmarks/vector_math.py [--rounds 15] [--shape 512x3072]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import numpy as np
import tvm
from tvm import relax, tirx

import tvm_ext.schedules.default_cpu_math as vector_math
from tvm_ext import driver
from tvm_ext.models.base import Model, TensorSpec

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vector_math.json")
OPS = {"exp": relax.op.exp, "tanh": relax.op.tanh, "sigmoid": relax.op.sigmoid,
       "gelu": relax.op.nn.gelu, "erf": relax.op.erf}


@contextlib.contextmanager
def _variant(name: str):
    """The math rewrite as `name` has it: "libm" (no rewrite), "isnan" or "bits"."""
    rules, is_nan = dict(vector_math._RULES), vector_math._is_nan
    if name == "libm":
        vector_math._RULES.clear()
    elif name == "isnan":
        vector_math._is_nan = tirx.isnan
    try:
        yield
    finally:
        vector_math._RULES.update(rules)
        vector_math._is_nan = is_nan


def _build(op, shape):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op(x))
        bb.emit_func_output(out)
    model = Model("op", bb.get(), [TensorSpec("x", shape, "float32")], [])
    return relax.VirtualMachine(driver.build(model, tvm.target.Target("llvm")), tvm.cpu())["main"]


def _time(fn, x) -> float:
    fn(x)
    start = time.perf_counter()
    for _ in range(3):
        fn(x)
    return (time.perf_counter() - start) / 3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--shape", default="512x3072")
    args = p.parse_args(argv)
    shape = tuple(int(d) for d in args.shape.split("x"))
    data = np.random.default_rng(0).uniform(-6, 6, shape).astype("float32")
    x = tvm.runtime.tensor(data)
    rows = []
    print(f"{'op':8s} {'libm ms':>9s} {'isnan ms':>9s} {'bits ms':>9s} {'bits/libm':>10s} "
          f"{'bits/isnan':>11s}")
    for name, op in OPS.items():
        fns = {}
        for variant in ("libm", "isnan", "bits"):
            with _variant(variant):
                fns[variant] = _build(op, shape)
        base = fns["libm"](x).numpy()
        for variant in ("isnan", "bits"):
            np.testing.assert_allclose(fns[variant](x).numpy(), base, rtol=1e-5, atol=1e-5)
        times = {v: [] for v in fns}
        for _ in range(args.rounds):
            for v, fn in fns.items():
                times[v].append(_time(fn, x))
        ms = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        row = {"op": name, **{f"{v}_ms": round(m, 4) for v, m in ms.items()},
               "bits_over_libm": round(ms["bits"] / ms["libm"], 3),
               "bits_over_isnan": round(ms["bits"] / ms["isnan"], 3)}
        rows.append(row)
        print(f"{name:8s} {ms['libm']:9.3f} {ms['isnan']:9.3f} {ms['bits']:9.3f} "
              f"{row['bits_over_libm']:9.3f}x {row['bits_over_isnan']:10.3f}x", flush=True)
    meta = {"shape": list(shape), "rounds": args.rounds, "machine": platform.processor() or
            platform.machine(), "threads": tvm.runtime.num_threads()}
    tmp = RESULTS + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)
    os.replace(tmp, RESULTS)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
