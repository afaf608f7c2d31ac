"""call_profile: every VM call of one function call timed in order, with the instrument's cost
estimated, beside the untimed wall time."""

from __future__ import annotations

import tvm
from tvm.runtime.vm import VirtualMachine

from tvm_ext import driver
from tvm_ext.runtime.call_profile import profile_calls


def test_every_call_is_timed_in_order(zoo_cache, llvm):
    model = zoo_cache("mlp")
    vm = VirtualMachine(driver.build(model, llvm), tvm.cpu(), memory_cfg="pooled")
    args = [tvm.runtime.tensor(a) for a in model.random_arguments(0)]
    seen: list[str] = []

    def count(_f, symbol, before_run, *_):
        if before_run:
            seen.append(str(symbol))
        return 0

    vm.set_instrument(tvm.runtime.convert(count))
    vm["main"](*args)
    vm.set_instrument(tvm.runtime.convert(lambda *a: 0))
    profile = profile_calls(vm, args, tvm.cpu(), repeat=2)
    assert [name for name, _ in profile.calls] == seen
    assert all(s >= 0 for _, s in profile.calls) and profile.wall_s > 0
    summary = profile.summary(top=3)
    kernels = [n for n in seen if not n.startswith("vm.builtin.")]
    assert summary["kernel_calls"] == len(kernels) > 0
    assert len(summary["slowest"]) == 3
    times = [entry["ms"] for entry in summary["slowest"]]
    assert times == sorted(times, reverse=True)
    assert abs(summary["calls_ms"] - profile.calls_s * 1e3) < 1e-9
