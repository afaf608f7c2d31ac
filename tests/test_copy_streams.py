"""The swap runtime (src/swap/copy_streams.cc, tvm_ext/runtime/swap_streams.py): asynchronous
copies on copy streams, waits, host buffers, failure reporting, and the calls a swap pass emits,
run on the Relax VM. CPU stand-in: cpu:0 is the device, cpu:1 the host."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_ext import pipeline
from tvm_ext.runtime import cuda as cuda_support
from tvm_ext.runtime import empty, memory_stats, swap_calls, swap_streams, to_device

DEV = tvm.cpu(0)
HOST = tvm.cpu(1)
BIG = 8 << 20  # float32 elements: a 32 MiB copy takes milliseconds, long enough to observe


@pytest.fixture(autouse=True)
def _clean_streams():
    swap_streams.reset()
    swap_streams.set_tracing(True)
    yield
    swap_streams.set_tracing(False)
    swap_streams.set_emulated_link(0.0)
    swap_streams.reset()


def _random(shape, dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) > 0.5
    if dtype.startswith(("int", "uint")):
        return rng.integers(-100 if dtype.startswith("int") else 0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


# ------------------------------------------------------------------------------------------------
# Copies
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "float64", "int8", "int64", "uint8", "bool"]
)
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (257,), (0, 4)])
def test_round_trip_is_exact(dtype, shape):
    data = _random(shape, dtype)
    x = to_device(data, DEV)
    x_host = swap_streams.host_empty(shape, dtype, HOST, DEV)
    assert x_host.device == HOST
    swap_streams.copy_async(x, x_host, 0, "x")
    back = empty(shape, dtype, DEV)
    swap_streams.copy_async(x_host, back, 0, "x")  # FIFO: runs after the swap-out
    swap_streams.wait(back, 0)
    np.testing.assert_array_equal(back.numpy(), data)
    swap_streams.wait_all(0)  # the statistics are final once the stream is empty
    assert swap_streams.stats(0).copies == 2
    assert swap_streams.stats(0).bytes == 2 * data.nbytes


def test_copy_runs_while_the_caller_computes():
    """The copy's [start, end] (worker timestamps) intersects a compute step of the caller, and
    the stats count the whole copy as overlapped: the caller never blocked."""
    src = to_device(np.ones(BIG, "float32"), DEV)
    dst = swap_streams.host_empty((BIG,), "float32", HOST, DEV)
    work = np.random.default_rng(0).standard_normal((64, 64))
    attempts = 0
    for _ in range(5):  # only a caller descheduled for the whole copy misses it
        attempts += 1
        swap_streams.reset_stats()
        swap_streams.copy_async(src, dst, 0, "src")
        steps = []
        while not swap_streams.is_idle(0):
            t0 = swap_streams.now_ns()
            work = np.tanh(work @ work.T)  # compute while the copy runs
            steps.append((t0, swap_streams.now_ns()))
        (copy,) = [r for r in swap_streams.trace() if isinstance(r, swap_streams.CopyRecord)]
        if any(t0 < copy.end_ns and t1 > copy.start_ns for t0, t1 in steps):
            break
    else:
        pytest.fail("the copy never ran while the caller computed in 5 attempts")
    stats = swap_streams.stats(0)
    assert copy.enqueued_ns <= copy.start_ns < copy.end_ns
    assert stats.busy_ns == copy.end_ns - copy.start_ns > 0
    assert stats.overlap_ns == stats.busy_ns, "the caller never blocked, so all of it overlapped"
    assert stats.wait_ns == 0
    swap_streams.wait(dst, 0)
    assert dst.numpy()[-1] == 1.0
    print(f"overlap observed at attempt {attempts}, copy {stats.busy_ns / 1e6:.1f} ms")


def test_blocking_wait_is_not_counted_as_overlap():
    src = to_device(np.ones(BIG, "float32"), DEV)
    dst = swap_streams.host_empty((BIG,), "float32", HOST, DEV)
    swap_streams.copy_async(src, dst, 0, "src")
    swap_streams.wait(src, 0)  # at once: the caller blocks for (most of) the copy
    records = swap_streams.trace()
    (copy,) = [r for r in records if isinstance(r, swap_streams.CopyRecord)]
    waits = [r for r in records if isinstance(r, swap_streams.WaitRecord)]
    assert all(w.end_ns >= copy.end_ns for w in waits), "a wait returned before its copy ended"
    blocked = sum(
        max(0, min(copy.end_ns, w.end_ns) - max(copy.start_ns, w.start_ns)) for w in waits
    )
    stats = swap_streams.stats(0)
    assert stats.overlap_ns == (copy.end_ns - copy.start_ns) - blocked
    assert stats.wait_ns == sum(w.end_ns - w.start_ns for w in waits)


# ------------------------------------------------------------------------------------------------
# The emulated link (src/swap/link_emulation.h)
# ------------------------------------------------------------------------------------------------

SLOW_LINK = (64e6, 2e-3)  # 64 MB/s, 2 ms per copy: 1 MiB takes 2 + 16.4 ms


def _paced(nbytes: int) -> float:
    bandwidth, latency = SLOW_LINK
    return latency + nbytes / bandwidth


def test_emulated_link_paces_each_copy_on_its_stream():
    """A copy of N bytes at B bytes/s (+ latency L) takes about L + N/B on its stream (never
    less: the worker sleeps to that deadline), the caller does not wait for it, and the two
    directions are two links (a swap-out and a swap-in overlap)."""
    swap_streams.set_emulated_link(*SLOW_LINK)
    assert swap_streams.emulated_link() == swap_streams.EmulatedLink(*SLOW_LINK)
    n = 1 << 18  # float32: 1 MiB
    x = to_device(np.ones(n, "float32"), DEV)
    x_host = swap_streams.host_empty((n,), "float32", HOST, DEV)
    y_host = to_device(np.full(n, 2.0, "float32"), HOST)
    y = empty((n,), "float32", DEV)
    start = swap_streams.now_ns()
    swap_streams.copy_async(x, x_host, 0, "x")  # device -> host
    swap_streams.copy_async(y_host, y, 1, "y")  # host -> device, on the other stream
    issued = swap_streams.now_ns() - start
    swap_streams.wait_all()
    wall = (swap_streams.now_ns() - start) * 1e-9
    expected = _paced(4 * n)
    assert issued * 1e-9 < expected / 4, "copy_async blocked its caller"
    copies = [r for r in swap_streams.trace() if isinstance(r, swap_streams.CopyRecord)]
    assert sorted(c.stream for c in copies) == [0, 1]
    for c in copies:
        took = (c.end_ns - c.start_ns) * 1e-9
        assert expected * 0.999 <= took < expected * 3 + 0.05, (c.name, took, expected)
    assert wall < 2 * expected, "the two streams' copies ran one after the other"
    np.testing.assert_array_equal(x_host.numpy(), 1.0)
    np.testing.assert_array_equal(y.numpy(), 2.0)
    stats = swap_streams.stats(0)
    assert (stats.paced, stats.copies) == (1, 1)
    assert stats.overshoot_ns >= 0


def test_emulated_link_sleeps_instead_of_spinning():
    """While a paced copy waits for its deadline the process uses almost no CPU."""
    swap_streams.set_emulated_link(*SLOW_LINK)
    n = 1 << 20  # 4 MiB: 2 + 65.5 ms
    x = to_device(np.ones(n, "float32"), DEV)
    x_host = swap_streams.host_empty((n,), "float32", HOST, DEV)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    swap_streams.copy_async(x, x_host, 0, "x")
    swap_streams.wait_all()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert wall >= _paced(4 * n) * 0.999
    assert cpu < wall / 3, f"{cpu * 1e3:.1f} ms of CPU over {wall * 1e3:.1f} ms: spinning?"


def test_emulated_link_paces_only_copies_between_two_devices():
    swap_streams.set_emulated_link(1e6, 0.5)  # would take > 0.5 s per copy
    n = 1 << 10
    a = to_device(np.ones(n, "float32"), HOST)
    b = swap_streams.host_empty((n,), "float32", HOST, DEV)
    start = time.perf_counter()
    swap_streams.copy_async(a, b, 0, "host to host")
    swap_streams.wait_all()
    assert time.perf_counter() - start < 0.4
    assert swap_streams.stats(0).paced == 0


def test_emulated_link_is_off_by_default_and_refuses_bad_values():
    assert swap_streams.emulated_link() is None
    for bad in ((-1.0, 0.0), (1e9, -1e-6), (float("inf"), 0.0)):
        with pytest.raises(ValueError, match="finite and >= 0"):
            swap_streams.set_emulated_link(*bad)
    assert swap_streams.emulated_link() is None


@pytest.mark.parametrize(("env", "expected"), [
    ({"TVM_EXT_LINK_GBPS": "0.5", "TVM_EXT_LINK_LATENCY_US": "20"}, "0.5 GB/s, 20 us"),
    ({"TVM_EXT_LINK_GBPS": "fast"}, "TVM_EXT_LINK_GBPS=fast is not a number >= 0"),
])
def test_emulated_link_of_an_exported_module_comes_from_the_environment(env, expected):
    """A module run without tvm_ext's Python takes the link from the environment; a malformed
    variable is an error naming it."""
    code = ("from tvm_ext.runtime import swap_streams as s\n"
            "try:\n    link = s.emulated_link()\n"
            "    print(link if link is None else link.describe())\n"
            "except ValueError as err:\n    print(err)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TVM_EXT_LINK")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert expected in out.stdout, out.stdout + out.stderr


def test_one_stream_is_fifo():
    """Later copies read what earlier ones wrote: a chain h0 -> h1 -> ... -> h5 enqueued without
    waits ends with h0's data only if the stream runs them in order, one at a time."""
    n = 1 << 18
    data = _random((n,), "float32")
    chain = [to_device(data, HOST)] + [
        swap_streams.host_empty((n,), "float32", HOST, DEV) for _ in range(5)
    ]
    for i in range(5):
        swap_streams.copy_async(chain[i], chain[i + 1], 3, f"h{i + 1}")
    swap_streams.wait_all(3)
    np.testing.assert_array_equal(chain[-1].numpy(), data)
    copies = [r for r in swap_streams.trace() if isinstance(r, swap_streams.CopyRecord)]
    assert [c.name for c in copies] == [f"h{i + 1}" for i in range(5)]
    for before, after in itertools.pairwise(copies):
        assert before.end_ns <= after.start_ns


def test_copies_on_different_streams_touching_the_same_memory_are_ordered():
    """Swap-out on stream 0, swap-in of the same host buffer on stream 1: the swap-in waits."""
    data = _random((BIG,), "float32")
    x = to_device(data, DEV)
    x_host = swap_streams.host_empty((BIG,), "float32", HOST, DEV)
    back = empty((BIG,), "float32", DEV)
    swap_streams.copy_async(x, x_host, 0, "x")
    swap_streams.copy_async(x_host, back, 1, "x")
    swap_streams.wait(back, 1)
    np.testing.assert_array_equal(back.numpy(), data)
    (out, into) = sorted(
        (r for r in swap_streams.trace() if isinstance(r, swap_streams.CopyRecord)),
        key=lambda r: r.stream,
    )
    assert out.end_ns <= into.start_ns


def test_copy_keeps_its_tensors_alive():
    data = _random((1 << 16,), "float32")
    x_host = swap_streams.host_empty(data.shape, "float32", HOST, DEV)
    swap_streams.copy_async(to_device(data, DEV), x_host, 0, "temp")  # source dropped at once
    swap_streams.wait(x_host, 0)
    np.testing.assert_array_equal(x_host.numpy(), data)


# ------------------------------------------------------------------------------------------------
# Failures name the tensor and poison the stream
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dst_shape", "dst_dtype", "reason"),
    [((4, 5), "float32", "shape mismatch"), ((4, 4), "float16", "dtype mismatch")],
)
def test_mismatch_is_refused_naming_the_tensor(dst_shape, dst_dtype, reason):
    x = to_device(np.zeros((4, 4), "float32"), DEV)
    with pytest.raises(ValueError, match=rf"'layer3.out'.*{reason}"):
        swap_streams.copy_async(x, empty(dst_shape, dst_dtype, HOST), 2, "layer3.out")


def test_refused_copy_poisons_its_stream_until_reset():
    x = to_device(np.zeros((4, 4), "float32"), DEV)
    ok_host = swap_streams.host_empty((4, 4), "float32", HOST, DEV)
    swap_streams.copy_async(x, ok_host, 2, "fine")
    with pytest.raises(ValueError, match=r"'bad'"):
        swap_streams.copy_async(x, empty((3,), "float32", HOST), 2, "bad")
    with pytest.raises(RuntimeError, match=r"'bad'.*poisoned"):
        swap_streams.wait(ok_host, 2)
    with pytest.raises(RuntimeError, match=r"'bad'"):
        swap_streams.wait(x, 2)
    with pytest.raises(RuntimeError, match=r"'bad'"):
        swap_streams.wait_all()
    with pytest.raises(RuntimeError, match=r"'bad'"):
        swap_streams.copy_async(x, ok_host, 2, "later")
    other_host = swap_streams.host_empty((4, 4), "float32", HOST, DEV)
    swap_streams.copy_async(x, other_host, 5, "other stream")  # other streams are unaffected
    swap_streams.wait_all(5)
    swap_streams.reset()
    swap_streams.copy_async(x, ok_host, 2, "after reset")
    swap_streams.wait_all()


def test_failure_while_running_is_reported_and_later_copies_do_not_run():
    data = _random((64,), "float32")
    x = to_device(data, DEV)
    first, second = (swap_streams.host_empty((64,), "float32", HOST, DEV) for _ in range(2))
    second.copyfrom(np.zeros(64, "float32"))
    # A large copy ahead keeps the worker busy, so both copies below are enqueued before the
    # first fails (on a loaded machine it could fail first, and the second enqueue be refused).
    big = to_device(np.zeros(BIG, "float32"), DEV)
    swap_streams.copy_async(big, swap_streams.host_empty((BIG,), "float32", HOST, DEV), 4, "big")
    swap_streams.inject_failure(4)
    swap_streams.copy_async(x, first, 4, "block7.attn")  # accepted; fails in the worker
    swap_streams.copy_async(x, second, 4, "block8.mlp")
    with pytest.raises(RuntimeError, match=r"'block7\.attn'.*injected failure"):
        swap_streams.wait(second, 4)
    with pytest.raises(RuntimeError, match=r"'block7\.attn'"):
        swap_streams.wait_all(4)
    np.testing.assert_array_equal(second.numpy(), 0)  # skipped: nothing computed after it
    assert swap_streams.stats(4).copies == 1  # "big" alone


def test_copy_that_depends_on_a_failed_copy_fails_too():
    data = _random((64,), "float32")
    x_host = swap_streams.host_empty((64,), "float32", HOST, DEV)
    back = empty((64,), "float32", DEV)
    back.copyfrom(np.zeros(64, "float32"))
    big = to_device(np.zeros(BIG, "float32"), DEV)
    swap_streams.copy_async(big, swap_streams.host_empty((BIG,), "float32", HOST, DEV), 0, "big")
    swap_streams.inject_failure(0)
    swap_streams.copy_async(to_device(data, DEV), x_host, 0, "x")  # fails behind "big"
    swap_streams.copy_async(x_host, back, 1, "x_in")  # stream 1 reads what "x" should write
    with pytest.raises(RuntimeError, match=r"'x_in'.*failed copy.*'x'"):
        swap_streams.wait(back, 1)
    np.testing.assert_array_equal(back.numpy(), 0)


# ------------------------------------------------------------------------------------------------
# Host memory
# ------------------------------------------------------------------------------------------------


def test_host_buffers_are_counted_on_the_host_device():
    before = memory_stats(HOST).in_use
    dev_before = memory_stats(DEV).in_use
    buf = swap_streams.host_empty((1000, 3), "float32", HOST, DEV)
    assert buf.device == HOST
    assert memory_stats(HOST).in_use - before == 12000
    assert memory_stats(DEV).in_use == dev_before
    del buf
    assert memory_stats(HOST).in_use == before


# ------------------------------------------------------------------------------------------------
# From Relax: the calls a swap pass emits, run on the VM
# ------------------------------------------------------------------------------------------------


# A (64, 64) float32 tensor is 16384 bytes; `a` is swapped out so that `b` can reuse its place in
# the 32 KiB device pool, and swapped back in (to offset 16384) for its last use.
@I.ir_module
class Swapped:
    I.module_global_infos({"vdevice": [I.vdevice("llvm", 0), I.vdevice("llvm", 1)]})

    @T.prim_func(private=True, s_tir=True)
    def add_one(A: T.Buffer((64, 64), "float32"), B: T.Buffer((64, 64), "float32")):
        for i, j in T.grid(64, 64):
            with T.sblock("B"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, vj] + T.float32(1)

    @T.prim_func(private=True, s_tir=True)
    def square(A: T.Buffer((64, 64), "float32"), B: T.Buffer((64, 64), "float32")):
        for i, j in T.grid(64, 64):
            with T.sblock("B"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, vj] * A[vi, vj]

    @T.prim_func(private=True, s_tir=True)
    def mul_add(
        A: T.Buffer((64, 64), "float32"),
        B: T.Buffer((64, 64), "float32"),
        C: T.Buffer((64, 64), "float32"),
    ):
        for i, j in T.grid(64, 64):
            with T.sblock("C"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = A[vi, vj] * B[vi, vj] + A[vi, vj]

    @R.function
    def main(x: R.Tensor((64, 64), "float32")) -> R.Tensor((64, 64), "float32"):
        R.func_attr({"relax.force_pure": True})
        cls = Swapped
        pool = R.memory.alloc_storage(
            R.shape([32768]), R.prim_value(0), R.str("global"), R.dtype("uint8")
        )
        a = R.memory.alloc_tensor(pool, R.prim_value(0), R.shape([64, 64]), R.dtype("float32"))
        cls.add_one(x, a)
        # swap-out of a into a host pool
        hpool = R.call_builtin_with_ctx(
            "tvm_ext.swap.host_storage",
            (R.shape([16384]), R.prim_value(1), R.prim_value(0)),
            ty_args=R.Object,
        )
        a_host = R.memory.alloc_tensor(
            hpool, R.prim_value(0), R.shape([64, 64]), R.dtype("float32")
        )
        _1 = R.call_packed(
            "tvm_ext.swap.copy_async", a, a_host, R.prim_value(0), R.str("a"), ty_args=R.Tuple([])
        )
        # b overwrites a's place: wait for the swap-out first (this also keeps a alive until here)
        _2 = R.call_packed("tvm_ext.swap.wait", a, R.prim_value(0), ty_args=R.Tuple([]))
        b = R.memory.alloc_tensor(pool, R.prim_value(0), R.shape([64, 64]), R.dtype("float32"))
        cls.square(x, b)
        # swap-in of a, right before its consumer
        a2_at = R.memory.alloc_tensor(
            pool, R.prim_value(16384), R.shape([64, 64]), R.dtype("float32")
        )
        a2 = R.memory.ensure_zero_offset(a2_at)
        _3 = R.call_packed(
            "tvm_ext.swap.copy_async", a_host, a2, R.prim_value(0), R.str("a"), ty_args=R.Tuple([])
        )
        _4 = R.call_packed("tvm_ext.swap.wait", a2, R.prim_value(0), ty_args=R.Tuple([]))
        c = R.builtin.alloc_tensor(
            R.shape([64, 64]), R.dtype("float32"), R.prim_value(0), R.str("global")
        )
        cls.mul_add(a2, b, c)
        # b is also swapped out into a single host tensor on stream 1 (an output-free copy that
        # the end-of-function wait must complete)
        b_host = R.call_builtin_with_ctx(
            "tvm_ext.swap.host_empty",
            (R.shape([64, 64]), R.dtype("float32"), R.prim_value(1), R.prim_value(0)),
            ty_args=R.Tensor((64, 64), "float32"),
        )
        _5 = R.call_packed(
            "tvm_ext.swap.copy_async", b, b_host, R.prim_value(1), R.str("b"), ty_args=R.Tuple([])
        )
        _6 = R.call_packed("tvm_ext.swap.wait_all", R.prim_value(-1), ty_args=R.Tuple([]))
        return c


def _unswapped() -> tvm.IRModule:
    """`Swapped` without the swaps: the same kernels, the default memory planning."""
    kernels = {gv: f for gv, f in Swapped.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    gv = {g.name_hint: g for g in kernels}
    ty = relax.TensorType((64, 64), "float32")
    bb = relax.BlockBuilder(tvm.IRModule(kernels))
    x = relax.Var("x", ty)
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.call_tir(gv["add_one"], (x,), ty))
            b = bb.emit(relax.call_tir(gv["square"], (x,), ty))
            c = bb.emit_output(relax.call_tir(gv["mul_add"], (a, b), ty))
        bb.emit_func_output(c)
    return bb.get()


def _finalize_only(target: tvm.target.Target) -> tvm.transform.Pass:
    return tvm.transform.Sequential(pipeline.finalize_passes(target))


def test_swap_out_and_in_between_kernels_on_the_vm():
    target = tvm.target.Target("llvm")
    swapped = relax.VirtualMachine(
        tvm.compile(Swapped, target, relax_pipeline=_finalize_only(target)), [DEV, HOST]
    )
    reference = relax.VirtualMachine(tvm.compile(_unswapped(), target), DEV)

    data = _random((64, 64), "float32")
    for _ in range(2):  # a second call reuses the streams
        host_before = memory_stats(HOST).in_use
        out = swapped["main"](to_device(data, DEV))
        expected = reference["main"](to_device(data, DEV))
        np.testing.assert_array_equal(out.numpy(), expected.numpy())
        assert memory_stats(HOST).in_use == host_before, "host buffers are freed after the call"
    a, b = swap_streams.stats(0), swap_streams.stats(1)
    assert (a.copies, a.bytes) == (4, 4 * 16384)  # a out and in, twice
    assert (b.copies, b.bytes) == (2, 2 * 16384)
    assert swap_streams.is_idle()


def test_swap_out_failure_on_the_vm_names_the_tensor():
    target = tvm.target.Target("llvm")
    vm = relax.VirtualMachine(
        tvm.compile(Swapped, target, relax_pipeline=_finalize_only(target)), [DEV, HOST]
    )
    swap_streams.inject_failure(0)
    with pytest.raises(RuntimeError, match=r"copy of tensor 'a'"):
        vm["main"](to_device(_random((64, 64), "float32"), DEV))
    with pytest.raises(RuntimeError, match=r"poisoned"):  # a second run gives no stale output
        vm["main"](to_device(_random((64, 64), "float32"), DEV))


def test_call_builders_match_the_calling_convention():
    """swap_streams's builders emit exactly the calls written by hand in `Swapped`."""
    bindings = {bd.var.name: bd for bd in Swapped["main"].body.blocks[0].bindings}
    var = {name: bd.var for name, bd in bindings.items()}
    call = {name: bd.value for name, bd in bindings.items()}
    built = {
        "_1": swap_calls.copy_async_call(var["a"], var["a_host"], 0, "a"),
        "_2": swap_calls.wait_call(var["a"], 0),
        "_3": swap_calls.copy_async_call(var["a_host"], var["a2"], 0, "a"),
        "_4": swap_calls.wait_call(var["a2"], 0),
        "_5": swap_calls.copy_async_call(var["b"], var["b_host"], 1, "b"),
        "_6": swap_calls.wait_all_call(),
        "hpool": swap_calls.host_storage_call(16384, 1, 0),
        "b_host": swap_calls.host_empty_call((64, 64), "float32", 1, 0),
    }
    for name, expr in built.items():
        tvm.ir.assert_structural_equal(relax.BlockBuilder().normalize(expr), call[name])


def test_cuda_module_with_swap_calls_builds_exports_and_loads(tmp_path):
    """No GPU here: compile for CUDA, export, load back; running needs a GPU."""
    try:
        cuda_support.ensure_cuda_runtime()
    except cuda_support.CudaUnavailableError as err:
        pytest.skip(f"CUDA cannot be compiled here: {err}")
    from tvm.s_tir import dlight as dl

    target = cuda_support.cuda_target()
    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(Swapped)
        executable = tvm.compile(mod, target, relax_pipeline=_finalize_only(target))
    path = os.path.join(tmp_path, "swapped_cuda.so")
    executable.export_library(path)
    loaded = tvm.runtime.load_module(path)
    device_code = [m.kind for m in loaded.imports[0].imports]
    assert device_code == ["cuda"], "the compiled CUDA device module must load back"
    text = relax.VMExecutable(loaded).as_text()
    for name in ("copy_async", "wait", "wait_all", "host_storage", "host_empty"):
        assert f"call  tvm_ext.swap.{name} in:" in text


# ------------------------------------------------------------------------------------------------
# Chunk copies (a split op's streams)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, axis, chunks", [((6, 8, 5), 1, 4), ((6, 8, 5), 0, 3),
                                                 ((1, 1, 9, 4), 2, 3), ((4, 6), 1, 6),
                                                 ((2, 3, 4, 10), 3, 5)])
def test_chunk_copies_move_strided_chunks_exactly(shape, axis, chunks):
    """Chunk j along any axis: into a chunk buffer on the device and back out into a host
    tensor, strided rows where an axis before it is not 1; every chunk lands in its place."""
    data = _random(shape, "float32")
    whole = to_device(data, HOST)
    back = to_device(np.zeros(shape, "float32"), HOST)
    piece = list(shape)
    piece[axis] //= chunks
    for j in range(chunks):
        chunk = empty(piece, "float32", DEV)
        swap_streams.copy_chunk_async(whole, chunk, 1, axis, j, True, "x")
        swap_streams.wait(chunk, 1)
        expected = np.take(data, range(j * piece[axis], (j + 1) * piece[axis]), axis=axis)
        np.testing.assert_array_equal(chunk.numpy(), expected)
        swap_streams.copy_chunk_async(back, chunk, 0, axis, j, False, "x")
        swap_streams.wait(chunk, 0)
    np.testing.assert_array_equal(back.numpy(), data)
    rows = int(np.prod(shape[:axis]))
    assert swap_streams.stats(1).bytes == data.nbytes and swap_streams.stats(1).copies == chunks
    assert rows >= 1


def test_chunk_copy_orders_against_copies_touching_its_rows():
    """A chunk copy out of a tensor waits for a copy into the same tensor on another stream."""
    data = _random((64, BIG // 64), "float32")
    src = to_device(data, DEV)
    host = empty(data.shape, "float32", HOST)
    swap_streams.copy_async(src, host, 0, "whole")  # large: still running when the next comes
    chunk = empty((64, BIG // 256), "float32", DEV)
    swap_streams.copy_chunk_async(host, chunk, 1, 1, 2, True, "chunk")
    swap_streams.wait(chunk, 1)
    np.testing.assert_array_equal(chunk.numpy(), data[:, 2 * BIG // 256:3 * BIG // 256])


@pytest.mark.parametrize("chunk_shape, axis, index, reason", [
    ((6, 3, 5), 1, 0, "is not a chunk of"),
    ((6, 4, 4), 1, 0, "is not a chunk of"),
    ((6, 4, 5), 3, 0, "is not a chunk of"),
    ((6, 4, 5), 1, 2, "out of range for 2 chunks"),
])
def test_chunk_copy_that_is_no_chunk_is_refused_naming_the_tensor(chunk_shape, axis, index,
                                                                  reason):
    whole = to_device(_random((6, 8, 5), "float32"), HOST)
    chunk = empty(chunk_shape, "float32", DEV)
    with pytest.raises(ValueError, match=f"'w'.*{reason}"):
        swap_streams.copy_chunk_async(whole, chunk, 3, axis, index, True, "w")
    swap_streams.reset()


@pytest.mark.parametrize("start, rows", [(-3, 7), (5, 7), (14, 7), (-2, 20), (0, 16)])
def test_window_copies_move_the_rows_inside_the_tensor_and_leave_the_rest(start, rows):
    """A chunk's input range along a later axis (strided), starting before the tensor or
    running past its end: the rows inside land at their place, the others keep their bytes."""
    data = _random((2, 3, 16, 5), "float32")
    whole = to_device(data, HOST)
    fill = np.full((2, 3, rows, 5), 7.0, "float32")
    chunk = to_device(fill, DEV)
    swap_streams.copy_window_async(whole, chunk, 1, 2, start, "x")
    swap_streams.wait(chunk, 1)
    lo, hi = max(start, 0), min(start + rows, 16)
    expected = fill.copy()
    expected[:, :, lo - start:hi - start] = data[:, :, lo:hi]
    np.testing.assert_array_equal(chunk.numpy(), expected)
    assert swap_streams.stats(1).bytes == 2 * 3 * (hi - lo) * 5 * 4


@pytest.mark.parametrize("chunk_shape, axis, start, reason", [
    ((2, 4, 4), 1, 0, "does not match"),
    ((2, 4, 5), 1, 8, "hold no row"),
    ((2, 4, 5), 1, -4, "hold no row"),
])
def test_window_copy_outside_the_tensor_is_refused_naming_it(chunk_shape, axis, start, reason):
    whole = to_device(_random((2, 8, 5), "float32"), HOST)
    chunk = empty(chunk_shape, "float32", DEV)
    with pytest.raises(ValueError, match=f"'w'.*{reason}"):
        swap_streams.copy_window_async(whole, chunk, 3, axis, start, "w")
    swap_streams.reset()
