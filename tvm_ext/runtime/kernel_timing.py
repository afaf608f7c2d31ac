"""Timing one kernel of a compiled module on a device, with TVM's runtime alone.

The same code times kernels where they were compiled (`tvm_ext.driver.measure_kernels`) and
where they are deployed: the GPU bundle times the kernels of an exported model (to feed the swap
simulator measured times) and the candidates of an offline tuning batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tvm

ArgSpec = tuple[Sequence[int], str]  # (shape, dtype) of one kernel parameter


def kernel_params(func) -> list[ArgSpec]:
    """(shape, dtype) of each parameter of a kernel (a `tirx.PrimFunc` with static shapes)."""
    return [([int(s) for s in p.shape], str(p.dtype)) for p in func.params]


def kernel_arguments(params: Sequence[ArgSpec], device: tvm.runtime.Device,
                     rng: np.random.Generator) -> list[tvm.runtime.Tensor]:
    """Arguments for timing a kernel: standard normal floats, random booleans, and zeros for
    integer tensors, which are indices (take, embedding lookups): zero is valid for any table,
    where random values would read out of bounds."""
    args = []
    for shape, dtype in params:
        shape = tuple(int(s) for s in shape)
        dtype = str(dtype)
        if dtype.startswith(("int", "uint")):
            data = np.zeros(shape, dtype)
        elif dtype == "bool":
            data = rng.random(size=shape) < 0.5
        else:
            data = rng.standard_normal(size=shape).astype(dtype)
        args.append(tvm.runtime.tensor(data, device))
    return args


def kernel_module(module: tvm.runtime.Module, name: str) -> tvm.runtime.Module:
    """The module (`module` or one it imports: an exported model keeps its kernels in an
    imported library) that defines kernel `name`."""
    stack = [module]
    while stack:
        mod = stack.pop()
        if mod.implements_function(name, False):
            return mod
        stack.extend(mod.imports)
    raise KeyError(f"no kernel {name!r} in {module}")


def time_kernel(module: tvm.runtime.Module, name: str, args: Sequence[tvm.runtime.Tensor],
                device: tvm.runtime.Device, *, number: int = 3, repeat: int = 3,
                min_repeat_ms: int = 0) -> list[float]:
    """Seconds per call of kernel `name` of `module`, one figure per repeat (each the mean of
    `number` calls, with the device synchronised around them)."""
    evaluator = kernel_module(module, name).time_evaluator(
        name, device, number=number, repeat=repeat, min_repeat_ms=min_repeat_ms)
    return [float(s) for s in evaluator(*args).results]
