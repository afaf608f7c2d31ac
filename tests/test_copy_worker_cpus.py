"""Pinning the CPU stand-in's copy workers to CPUs of their own (src/swap/worker_cpus.cc,
`swap_streams.set_copy_worker_cpus`, `driver.dedicated_copy_cpu`): the workers running and
those started later are pinned, copies stay exact, bad CPUs and a malformed environment are
refused with the name of what is wrong, and the context restores everything it changed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm

from tvm_ext.driver import dedicated_copy_cpu
from tvm_ext.runtime import empty, swap_streams, to_device

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="pinning threads is Linux only")

DEV = tvm.cpu(0)
HOST = tvm.cpu(1)


def _cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for item in text.strip().split(","):
        first, _, last = item.partition("-")
        cpus |= set(range(int(first), int(last or first) + 1))
    return cpus


def _workers() -> dict[str, set[int]]:
    """The copy workers' threads (by name) and the CPUs each may run on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # a thread that ended meanwhile
            continue
        if name.startswith("tvm_ext-copy"):
            line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:"))
            out[f"{name}/{tid}"] = _cpu_list(line.split(":", 1)[1])
    return out


def _copy_round_trip(stream: int, seed: int) -> None:
    """A swap-out and back on `stream` (starting its worker), checked exact."""
    data = np.random.default_rng(seed).standard_normal(4096).astype("float32")
    x = to_device(data, DEV)
    x_host = swap_streams.host_empty((4096,), "float32", HOST, DEV)
    back = empty((4096,), "float32", DEV)
    swap_streams.copy_async(x, x_host, stream, "x")
    swap_streams.copy_async(x_host, back, stream, "x")
    swap_streams.wait_all()
    np.testing.assert_array_equal(back.numpy(), data)


@pytest.fixture(autouse=True)
def _unpinned():
    cpus = os.sched_getaffinity(0)
    yield
    swap_streams.set_copy_worker_cpus([])
    os.sched_setaffinity(0, cpus)
    swap_streams.reset()


def test_workers_running_and_started_later_are_pinned_then_unpinned():
    _copy_round_trip(0, seed=0)  # a worker running before the setting
    process = set(swap_streams.process_cpus())  # as loaded: TVM's pool may bind this thread
    assert set(os.sched_getaffinity(0)) <= process
    cpu = max(os.sched_getaffinity(0))
    assert swap_streams.copy_worker_cpus() == ()
    swap_streams.set_copy_worker_cpus([cpu])
    assert swap_streams.copy_worker_cpus() == (cpu,)
    _copy_round_trip(7, seed=1)  # a worker started after it
    workers = _workers()
    assert len(workers) >= 2
    assert all(cpus == {cpu} for cpus in workers.values()), workers
    _copy_round_trip(0, seed=2)  # copies on a pinned worker stay exact
    swap_streams.set_copy_worker_cpus([])
    assert swap_streams.copy_worker_cpus() == ()
    assert all(cpus == process for cpus in _workers().values()), "unpinned: the process's CPUs"


@pytest.mark.parametrize("bad", [[4096], [-1], [1 << 40]])
def test_a_cpu_the_process_cannot_use_is_refused_and_nothing_changes(bad):
    cpu = min(os.sched_getaffinity(0))
    swap_streams.set_copy_worker_cpus([cpu])
    with pytest.raises(ValueError, match="is not one this process may run on"):
        swap_streams.set_copy_worker_cpus([cpu, *bad])
    assert swap_streams.copy_worker_cpus() == (cpu,)


def test_the_environment_pins_an_exported_modules_workers_and_is_checked():
    """$TVM_EXT_COPY_WORKER_CPUS, read when first needed (a fresh process): a list pins the
    workers; a malformed one raises naming the variable, and is read again next time."""
    cpu = max(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import os
        import numpy as np, tvm
        from tvm_ext.runtime import swap_streams
        os.environ["TVM_EXT_COPY_WORKER_CPUS"] = "2-1"
        try:
            swap_streams.copy_worker_cpus()
        except ValueError as err:
            print("refused:", err)
        os.environ["TVM_EXT_COPY_WORKER_CPUS"] = "{cpu}"
        print("cpus:", swap_streams.copy_worker_cpus())
        x = tvm.runtime.tensor(np.ones(16, "float32"), tvm.cpu(0))
        h = swap_streams.host_empty((16,), "float32", tvm.cpu(1), tvm.cpu(0))
        swap_streams.copy_async(x, h, 0, "x")
        swap_streams.wait_all()
        for tid in os.listdir("/proc/self/task"):
            if open(f"/proc/self/task/{{tid}}/comm").read().startswith("tvm_ext-copy"):
                status = open(f"/proc/self/task/{{tid}}/status").read()
                print("worker:", status.split("Cpus_allowed_list:")[1].split()[0])
    """)
    env = {k: v for k, v in os.environ.items() if k != "TVM_EXT_COPY_WORKER_CPUS"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("refused: tvm_ext.swap: TVM_EXT_COPY_WORKER_CPUS=2-1 is not a list of CPUs such "
            "as 3, 2,3 or 2-3") in out.stdout
    assert f"cpus: ({cpu},)" in out.stdout
    assert f"worker: {cpu}" in out.stdout


@pytest.mark.skipif(len(swap_streams.process_cpus()) < 2, reason="needs two CPUs")
def test_dedicated_copy_cpu_splits_the_cpus_and_restores_them():
    _copy_round_trip(0, seed=3)
    process = set(swap_streams.process_cpus())
    os.sched_setaffinity(0, process)
    with dedicated_copy_cpu() as cpu:
        assert cpu == max(process)
        assert os.sched_getaffinity(0) == process - {cpu}, "the compute keeps the other CPUs"
        assert swap_streams.copy_worker_cpus() == (cpu,)
        assert all(c == {cpu} for c in _workers().values())
        _copy_round_trip(1, seed=4)
    assert os.sched_getaffinity(0) == process
    assert swap_streams.copy_worker_cpus() == ()
    with pytest.raises(RuntimeError, match="inside"), dedicated_copy_cpu(min(process)) as cpu:
        assert cpu == min(process)
        assert swap_streams.copy_worker_cpus() == (cpu,)
        raise RuntimeError("inside")  # restored on an error too
    assert os.sched_getaffinity(0) == process
    assert swap_streams.copy_worker_cpus() == ()


@pytest.mark.skipif(len(swap_streams.process_cpus()) < 2, reason="needs two CPUs")
def test_a_thread_bound_to_the_copy_cpu_moves_to_the_processs_others():
    """TVM's pool binds the calling thread to one core once it runs a parallel kernel: where
    that is the copy CPU, the compute moves to the process's other CPUs for the block."""
    process = set(swap_streams.process_cpus())
    top = max(process)
    os.sched_setaffinity(0, {top})
    with dedicated_copy_cpu() as cpu:
        assert cpu == top
        assert os.sched_getaffinity(0) == process - {top}
    assert os.sched_getaffinity(0) == {top}


def test_refused_cpus_and_a_single_cpu():
    process = swap_streams.process_cpus()
    assert process and set(os.sched_getaffinity(0)) <= set(process)
    with pytest.raises(ValueError, match="not one of this process's CPUs"), \
            dedicated_copy_cpu(max(process) + 1):
        pass
    assert swap_streams.copy_worker_cpus() == ()
    if len(process) == 1:
        with pytest.warns(RuntimeWarning, match=f"runs on CPU {process[0]} only"), \
                dedicated_copy_cpu() as cpu:
            assert cpu is None
            assert swap_streams.copy_worker_cpus() == ()
