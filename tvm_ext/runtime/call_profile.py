"""Where an iteration's time goes, call by call: every call the VM makes (a kernel, a library
call, a builtin) timed in the order the function runs it, on its real arguments.

A model's measured iteration can be far longer than the sum of its kernels timed alone. Timing
each call in its place tells the two reasons apart: kernels slower in sequence than alone
(their real arguments, caches the kernel before left cold) show in `calls`; time between calls
(the VM's dispatch and allocation, launches the device is not yet busy with) is the iteration's
wall time less the calls' sum, `gap_s`. Each timed call waits for the device before and after
it, so the profiled call is slower than an untimed one; the untimed `wall_s` beside it is
measured first, on its own. Each timed call also carries the instrument's own cost (a Python
callback before and after it, its arguments converted): `overhead_s`, the median time of the
VM's no-op builtin (`vm.builtin.null_value`), estimates it, and `summary` reports the kernels'
times less it.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections import Counter
from collections.abc import Sequence

import tvm

_NOOP = "vm.builtin.null_value"

@dataclasses.dataclass
class CallProfile:
    calls: list[tuple[str, float]]  # (callee, seconds) in the order the VM made them
    wall_s: float  # one untimed call of the function, device waited for

    @property
    def calls_s(self) -> float:
        return sum(s for _, s in self.calls)

    @property
    def overhead_s(self) -> float:
        """The instrument's cost per timed call: the median of the no-op builtin's times (0
        where the function makes no such call)."""
        noop = sorted(s for name, s in self.calls if name == _NOOP)
        return noop[len(noop) // 2] if noop else 0.0

    @property
    def gap_s(self) -> float:
        """The untimed wall time less the sum of the calls in it (negative where the device
        ran calls while the host dispatched later ones)."""
        return self.wall_s - self.calls_s

    def by_callee(self) -> dict[str, tuple[int, float]]:
        """{callee: (calls, seconds in all)}, most time first."""
        counts: Counter = Counter()
        seconds: Counter = Counter()
        for name, s in self.calls:
            counts[name] += 1
            seconds[name] += s
        return {n: (counts[n], seconds[n]) for n, _ in seconds.most_common()}

    def summary(self, top: int = 10) -> dict:
        """Counts and milliseconds: the untimed wall time, the timed calls' sum, the sum less
        the instrument's estimated cost, the calls that are not VM builtins (kernels and
        library calls), and the `top` callees by time."""
        kernels = [(n, s) for n, s in self.calls if not n.startswith("vm.builtin.")]
        overhead = self.overhead_s
        net = sum(max(0.0, s - overhead) for _, s in self.calls)
        return {"calls": len(self.calls), "kernel_calls": len(kernels),
                "wall_ms": self.wall_s * 1e3, "calls_ms": self.calls_s * 1e3,
                "instrument_overhead_us": overhead * 1e6, "calls_net_ms": net * 1e3,
                "kernels_net_ms": sum(max(0.0, s - overhead) for _, s in kernels) * 1e3,
                "gap_ms": (self.wall_s - net) * 1e3,
                "gap_per_kernel_call_us": (self.wall_s - net) * 1e6 / max(1, len(kernels)),
                "slowest": [{"callee": n, "calls": c, "ms": s * 1e3}
                            for n, (c, s) in list(self.by_callee().items())[:top]]}


def profile_calls(vm, args: Sequence, device: tvm.runtime.Device, func: str = "main",
                  warmup: int = 1, repeat: int = 3) -> CallProfile:
    """Profile `vm[func](*args)` (after `warmup` untimed calls; the allocator the VM was made
    with serves them all): each call's time is its median over `repeat` instrumented runs,
    with Python's garbage collector paused (a collection inside a callback would be charged
    to whichever call it landed in)."""
    main = vm[func]
    for _ in range(warmup):
        main(*args)
    device.sync()
    start = time.perf_counter()
    main(*args)
    device.sync()
    wall = time.perf_counter() - start
    runs: list[list[tuple[str, float]]] = []
    started: list[float] = []

    def instrument(_func, symbol, before_run, _ret, *_args):
        device.sync()
        if before_run:
            started.append(time.perf_counter())
        else:
            runs[-1].append((str(symbol), time.perf_counter() - started.pop()))
        return 0

    collecting = gc.isenabled()
    gc.disable()
    vm.set_instrument(tvm.runtime.convert(instrument))
    try:
        for _ in range(repeat):
            runs.append([])
            main(*args)
            device.sync()
    finally:
        vm.set_instrument(tvm.runtime.convert(lambda *a: 0))
        if collecting:
            gc.enable()
    calls = [(name, statistics.median(r[i][1] for r in runs))
             for i, (name, _) in enumerate(runs[0])]
    return CallProfile(calls, wall)
