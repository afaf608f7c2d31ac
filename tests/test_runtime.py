"""Measured device memory: the tracked allocators against allocations of known size."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from tvm_ext import runtime

N = 256 * 256 * 4  # bytes of one (256, 256) float32 tensor


@tvm.script.ir_module
class Chain:
    @R.function
    def main(x: R.Tensor((256, 256), "float32")):
        with R.dataflow():
            # Matmuls do not fuse with each other: three kernels, three allocations.
            a = R.matmul(x, x)
            b = R.matmul(a, a)
            c = R.matmul(b, x)
            R.output(c)
        return c


def test_library_loads_and_registers():
    assert runtime.load_library().endswith(runtime.LIBRARY_NAME)
    assert runtime.get_function("tvm_ext.memory.stats") is not None


def test_empty_counts_exact_bytes_and_frees():
    dev = tvm.cpu(3)  # a device no other test uses
    before = runtime.memory_stats(dev)
    t = runtime.empty((10, 7), "float64", dev)
    after = runtime.memory_stats(dev)
    assert after.in_use - before.in_use == 560
    assert after.num_allocs >= 1
    del t
    assert runtime.memory_stats(dev).in_use == before.in_use


def test_peak_and_reset():
    dev = tvm.cpu(4)
    runtime.reset_peak(dev)
    with runtime.measure_peak(dev) as m:
        a = runtime.empty((1000,), "float32", dev)
        b = runtime.empty((500,), "float32", dev)
        del a
        c = runtime.empty((100,), "float32", dev)
    assert m.peak_above_baseline == 6000
    del b, c
    runtime.reset_peak(dev)
    assert runtime.memory_stats(dev).peak_in_use == runtime.memory_stats(dev).in_use


def test_to_device_round_trip():
    arr = np.arange(12, dtype="int64").reshape(3, 4)
    t = runtime.to_device(arr, tvm.cpu(3))
    np.testing.assert_array_equal(t.numpy(), arr)


def _build(memory_planning: bool):
    target = tvm.target.Target("llvm")
    return tvm.compile(Chain, target, relax_pipeline=relax.get_pipeline(
        "tvm_ext", target=target, memory_planning=memory_planning))


def test_vm_naive_allocator_peak_is_two_tensors():
    """Unplanned, the chain holds at most two of its (256,256) intermediates at once: `a` while
    `b` is computed, `b` while `c` is. The input was not allocated by the VM."""
    ex = _build(memory_planning=False)
    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(ex, dev, memory_cfg="naive")
    assert runtime.is_tracked(dev, "naive")
    x = tvm.runtime.tensor(np.eye(256, dtype="float32") * 2, dev)
    with runtime.measure_peak(dev) as m:
        out = vm["main"](x)
    assert m.peak_above_baseline == 2 * N
    np.testing.assert_allclose(out.numpy(), np.eye(256) * 2**5)  # a = 4I, b = 16I, c = 32I


def test_pooled_allocator_reserves_and_reuses():
    """The pooled allocator keeps freed blocks for reuse. The VM holds a call's result until
    the next call, so the second call needs one block more than the first (3 x N); from then
    on every call is served from the pool."""
    ex = _build(memory_planning=False)
    dev = tvm.cpu(5)
    vm = relax.VirtualMachine(ex, dev, memory_cfg="pooled")
    assert runtime.is_tracked(dev, "pooled")
    x = tvm.runtime.tensor(np.eye(256, dtype="float32"), dev)
    vm["main"](x)
    first = runtime.memory_stats(dev)
    assert first.reserved >= 2 * N and first.peak_in_use >= 2 * N
    vm["main"](x)
    second = runtime.memory_stats(dev)
    assert second.peak_reserved == 3 * N
    vm["main"](x)
    third = runtime.memory_stats(dev)
    assert third.peak_reserved == second.peak_reserved
    assert third.in_use == N  # only the retained result is held


def test_preload_finds_what_the_loader_finds_and_says_when_nothing_is_there():
    from tvm_ext.runtime.vendor_libraries import preload

    assert preload("libc.so.6") == "libc.so.6"
    assert preload("libtvm_ext_no_such_library.so.1") is None


def test_random_arrays_follow_their_specs():
    from tvm_ext.runtime.random_arrays import sample_all

    specs = [{"shape": [64], "dtype": "int64", "init": "randint", "high": 3},
             {"shape": [2, 3], "dtype": "float32", "init": "ones"},
             {"shape": [1000], "dtype": "float32", "init": "uniform", "scale": 0.5}]
    ids, ones, uniform = sample_all(specs, seed=1)
    assert ids.dtype == np.int64 and set(np.unique(ids)) <= {0, 1, 2}
    np.testing.assert_array_equal(ones, np.ones((2, 3), "float32"))
    assert uniform.dtype == np.float32 and np.abs(uniform).max() <= 0.5
    np.testing.assert_array_equal(sample_all(specs, seed=1)[2], uniform)  # seeded
