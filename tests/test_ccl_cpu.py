"""The "cpu" Disco collective backend (src/ccl/ccl_cpu.cc) on ThreadedSessions of 1..8 workers.

Every collective is reached the way compiled modules reach it: through TVM's disco builtins
(`runtime.disco.allreduce`, ...), which dispatch to `runtime.disco.cpu.*`, and through Relax's
`R.ccl.*` ops in compiled modules. Results are compared with numpy on every worker.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm_ffi import Shape

import tvm_ext
from tvm_ext.runtime import distributed as dist

KINDS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "int8", "uint8", "bool"]


def _np_dtype(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def _random(rng, shape, dtype: str) -> np.ndarray:
    if dtype == "bool":
        return rng.random(shape) < 0.4
    if dtype.startswith(("int", "uint")):
        low = 0 if dtype.startswith("uint") else -3
        return rng.integers(low, 4, shape).astype(dtype)
    return rng.standard_normal(shape).astype(_np_dtype(dtype))


def _expected_allreduce(parts: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """What the backend promises: reduce in worker order; half types accumulate in float32."""
    if dtype == "bool":
        return (np.logical_or if op in ("sum", "max") else np.logical_and).reduce(parts)
    if op == "min":
        return np.minimum.reduce(parts)
    if op == "max":
        return np.maximum.reduce(parts)
    acc_type = np.float32 if dtype in ("float16", "bfloat16") else parts[0].dtype
    acc = parts[0].astype(acc_type)
    for p in parts[1:]:
        acc = acc * p.astype(acc_type) if op == "prod" else acc + p.astype(acc_type)
    if op == "avg":
        if np.issubdtype(acc.dtype, np.integer):
            acc = np.fix(acc.astype(np.float64) / len(parts)).astype(acc.dtype)  # C truncation
        else:
            acc = acc / acc.dtype.type(len(parts))
    return acc.astype(_np_dtype(dtype))


@pytest.fixture(scope="module")
def sessions():
    opened: dict[int, dist.Session] = {}

    def get(k: int) -> dist.Session:
        if k not in opened:
            opened[k] = dist.Session(k)
        return opened[k]

    yield get
    for sess in opened.values():
        sess.shutdown()


def _builtin(sess: dist.Session, name: str, *args) -> None:
    sess.call(f"runtime.disco.{name}", *args)
    sess.check(name)


# -- every collective, every dtype, 1..8 workers ---------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_kind_matches_numpy(sessions, k, dtype):
    sess = sessions(k)
    rng = np.random.default_rng(k)
    parts = [_random(rng, (7,), dtype) for _ in range(k)]  # 7 elements: uneven slices
    src = sess.per_worker(parts)
    for op in KINDS:
        if dtype == "bool" and op == "avg":
            continue
        out = sess.empty(src.shape, src.dtype)
        _builtin(sess, "allreduce", src, Shape([KINDS[op]]), False, out)
        expected = _expected_allreduce(parts, op, dtype)
        for worker, value in enumerate(sess.worker_values(out)):
            np.testing.assert_array_equal(value, expected, err_msg=f"{op} on worker {worker}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_types_every_bit_pattern(sessions, dtype):
    """All 65536 values (subnormals, inf, nan): float32 accumulation, one rounding to nearest
    even, as numpy / ml_dtypes round."""
    sess = sessions(2)
    bits = np.arange(1 << 16, dtype=np.uint16)
    parts = [bits.view(_np_dtype(dtype)), np.roll(bits, 12345).view(_np_dtype(dtype))]
    src = sess.per_worker(parts)
    out = sess.empty(src.shape, src.dtype)
    for op in ("sum", "max", "avg"):
        _builtin(sess, "allreduce", src, Shape([KINDS[op]]), False, out)
        with np.errstate(invalid="ignore", over="ignore"):
            want = _expected_allreduce(parts, op, dtype).astype(np.float32)
        got = sess.gather(out).astype(np.float32)
        np.testing.assert_array_equal(got, want, err_msg=op)


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_allreduce_spans_several_blocks(sessions, k, dtype):
    sess = sessions(k)
    rng = np.random.default_rng(7)
    parts = [_random(rng, (2053,), dtype) for _ in range(k)]  # > 512-element blocks per slice
    src = sess.per_worker(parts)
    out = sess.empty(src.shape, src.dtype)
    _builtin(sess, "allreduce", src, Shape([KINDS["sum"]]), False, out)
    for value in sess.worker_values(out):
        np.testing.assert_array_equal(value, _expected_allreduce(parts, "sum", dtype))


@pytest.mark.parametrize("k", [1, 3, 4])
def test_allreduce_in_place_and_multidimensional(sessions, k):
    sess = sessions(k)
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((3, 5, 2)).astype("float32") for _ in range(k)]
    buf = sess.per_worker(parts)
    _builtin(sess, "allreduce", buf, Shape([KINDS["sum"]]), False, buf)
    expected = _expected_allreduce(parts, "sum", "float32")
    for value in sess.worker_values(buf):
        np.testing.assert_array_equal(value, expected)


def test_allreduce_empty_tensor(sessions):
    sess = sessions(3)
    buf = sess.per_worker([np.zeros((0, 4), "float32")] * 3)
    _builtin(sess, "allreduce", buf, Shape([0]), False, buf)
    assert [v.shape for v in sess.worker_values(buf)] == [(0, 4)] * 3


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "bool"])
def test_allgather_broadcast_scatter_gather(sessions, k, dtype):
    sess = sessions(k)
    rng = np.random.default_rng(1)
    parts = [_random(rng, (2, 3), dtype) for _ in range(k)]
    src = sess.per_worker(parts)  # scatter_from_worker0 underneath
    for worker, value in enumerate(sess.worker_values(src)):  # gather_to_worker0 underneath
        np.testing.assert_array_equal(value, parts[worker])

    gathered = sess.empty((2 * k, 3), dtype)
    _builtin(sess, "allgather", src, False, gathered)
    for value in sess.worker_values(gathered):
        np.testing.assert_array_equal(value, np.concatenate(parts))

    out = sess.empty((2, 3), dtype)
    _builtin(sess, "broadcast_from_worker0", src, False, out)
    for value in sess.worker_values(out):
        np.testing.assert_array_equal(value, parts[0])

    full = _random(rng, (2 * k, 3), dtype)
    np.testing.assert_array_equal(sess.gather(sess.scatter(full, axis=0), axis=0), full)
    np.testing.assert_array_equal(sess.gather(sess.replicate(full)), full)


def test_in_group_collectives_stay_inside_groups():
    with dist.Session(4, num_groups=2) as sess:
        parts = [np.full(3, 10.0**i, "float32") for i in range(4)]
        src = sess.per_worker(parts)
        out = sess.empty((3,), "float32")
        _builtin(sess, "allreduce", src, Shape([0]), True, out)
        values = sess.worker_values(out)
        for w in range(4):
            group = (0, 1) if w < 2 else (2, 3)
            np.testing.assert_array_equal(values[w], parts[group[0]] + parts[group[1]])
        _builtin(sess, "allreduce", src, Shape([0]), False, out)
        for value in sess.worker_values(out):
            np.testing.assert_array_equal(value, sum(parts))
        _builtin(sess, "broadcast_from_worker0", src, True, out)
        values = sess.worker_values(out)
        for w in range(4):
            np.testing.assert_array_equal(values[w], parts[0 if w < 2 else 2])
        gathered = sess.empty((6,), "float32")
        _builtin(sess, "allgather", src, True, gathered)
        values = sess.worker_values(gathered)
        np.testing.assert_array_equal(values[3], np.concatenate(parts[2:]))


# -- point to point (worker-dependent calls come from a Python function run on each worker) --------


def _rank() -> int:
    return int(tvm_ffi.get_global_func("runtime.disco.worker_rank")())


@tvm_ffi.register_global_func("tvm_ext_test.ccl_p2p")
def _p2p(buf):
    builtin = tvm_ffi.get_global_func
    rank = _rank()
    if rank == 0:
        builtin("runtime.disco.send_to_worker")(buf, 2)
        builtin("runtime.disco.send_to_worker")(buf, 3)
    elif rank == 2:
        builtin("runtime.disco.recv_from_worker")(buf, 0)
    elif rank == 3:
        builtin("runtime.disco.recv_from_worker0")(buf)


@tvm_ffi.register_global_func("tvm_ext_test.ccl_groups")
def _groups(buf):
    if _rank() < 2:
        tvm_ffi.get_global_func("runtime.disco.send_to_next_group")(buf)
    else:
        tvm_ffi.get_global_func("runtime.disco.recv_from_prev_group")(buf)


@tvm_ffi.register_global_func("tvm_ext_test.ccl_p2p_sizes")
def _p2p_sizes():
    rank = _rank()
    buf = tvm.runtime.tensor(np.zeros(4 + rank, "float32"), tvm.cpu(rank))
    if rank == 0:
        tvm_ffi.get_global_func("runtime.disco.send_to_worker")(buf, 1)
    else:
        tvm_ffi.get_global_func("runtime.disco.recv_from_worker")(buf, 0)


def test_point_to_point_size_mismatch(sessions):
    sess = sessions(2)
    with pytest.raises(dist.DistributedError, match=r"worker 1 receives into float32\[5\] but "
                       r"worker 0 sent float32\[4\]"):
        sess.call("tvm_ext_test.ccl_p2p_sizes")
        sess.check()
    _check_session_still_works(sess)


def test_point_to_point():
    with dist.Session(4, num_groups=2) as sess:
        parts = [np.full(4, i, "int32") for i in range(4)]
        buf = sess.per_worker(parts)
        sess.call("tvm_ext_test.ccl_p2p", buf)
        sess.check()
        assert [int(v[0]) for v in sess.worker_values(buf)] == [0, 1, 0, 0]
        buf = sess.per_worker(parts)
        sess.call("tvm_ext_test.ccl_groups", buf)
        sess.check()
        assert [int(v[0]) for v in sess.worker_values(buf)] == [0, 1, 0, 1]


# -- compiled per-worker Relax modules with R.ccl ops ----------------------------------------------

_CCL_MODULE = """
@I.ir_module
class Collectives:
    @R.function
    def main(x: R.Tensor((4, 6), "float32"), i: R.Tensor((3,), "int32"),
             h: R.Tensor((2, 6), "float16"), full0: R.Tensor(({k4}, 6), "float32"),
             full1: R.Tensor((4, {k6}), "float32"), b: R.Tensor((5,), "bool"),
             bf: R.Tensor((8,), "bfloat16")):
        s = R.ccl.allreduce(x, "sum")
        m = R.ccl.allreduce(x, "max")
        a = R.ccl.allreduce(x, "avg")
        p = R.ccl.allreduce(i, "prod")
        mn = R.ccl.allreduce(i, "min")
        g = R.ccl.allgather(h, {k})
        bc = R.ccl.broadcast_from_worker0(x)
        sc0 = R.ccl.scatter_from_worker0(full0, {k}, axis=0)
        sc1 = R.ccl.scatter_from_worker0(full1, {k}, axis=1)
        anyb = R.ccl.allreduce(b, "max")
        sbf = R.ccl.allreduce(bf, "sum")
        return (s, m, a, p, mn, g, bc, sc0, sc1, anyb, sbf)
"""


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_relax_ccl_ops_on_k_workers(k):
    mod = tvm.script.from_source(_CCL_MODULE.format(k=k, k4=4 * k, k6=6 * k),
                                 extra_vars={"I": I, "R": R})
    executable = tvm.compile(mod, target="llvm")
    rng = np.random.default_rng(k)
    specs = [((4, 6), "float32"), ((3,), "int32"), ((2, 6), "float16"), ((4 * k, 6), "float32"),
             ((4, 6 * k), "float32"), ((5,), "bool"), ((8,), "bfloat16")]
    inputs = [[_random(rng, shape, dtype) for _ in range(k)] for shape, dtype in specs]
    x, i, h, full0, full1, b, bf = inputs
    expected = [
        _expected_allreduce(x, "sum", "float32"),
        _expected_allreduce(x, "max", "float32"),
        _expected_allreduce(x, "avg", "float32"),
        _expected_allreduce(i, "prod", "int32"),
        _expected_allreduce(i, "min", "int32"),
        np.concatenate(h),
        x[0],
        None,  # scatter: worker-dependent, below
        None,
        _expected_allreduce(b, "max", "bool"),
        _expected_allreduce(bf, "sum", "bfloat16"),
    ]
    with dist.Session(k) as sess:
        module = sess.load_module(executable)
        outs = module["main"](*(sess.per_worker(v) for v in inputs))
        assert len(outs) == len(expected)
        for j, out in enumerate(outs):
            for w, value in enumerate(sess.worker_values(out)):
                if j == 7:
                    want = np.split(full0[0], k, axis=0)[w]
                elif j == 8:
                    want = np.split(full1[0], k, axis=1)[w]
                else:
                    want = expected[j]
                np.testing.assert_array_equal(value, want, err_msg=f"output {j}, worker {w}")


# -- misuse ----------------------------------------------------------------------------------------


def test_error_outside_a_session():
    tvm_ext.runtime.load_library()
    x = tvm.runtime.tensor(np.zeros(3, "float32"))
    with pytest.raises(ValueError, match="outside a Disco worker"):
        tvm_ffi.get_global_func("runtime.disco.cpu.allreduce")(x, 0, False, x)


def test_error_backend_not_initialised():
    disco = dist.disco_module()
    sess = disco.ThreadedSession(2)
    try:
        guarded = sess.get_global_func("tvm_ext.disco.call_guarded")
        empty = sess.empty((3,), "float32")
        sess.call_packed(guarded, sess.get_global_func("runtime.disco.cpu.allgather"), empty,
                         False, empty)
        error = sess.call_packed(sess.get_global_func("tvm_ext.disco.take_error"))
        message = str(error.debug_get_from_remote(1))
        assert "not initialised on worker 1" in message
        assert 'SessionInitCCL(session, "cpu"' in message
    finally:
        sess.shutdown()


def test_error_process_session_rejected():
    disco = dist.disco_module()
    sess = disco.ProcessSession(2)
    try:
        with pytest.raises(ValueError, match="ThreadedSession"):
            disco._ffi_api.SessionInitCCL(sess, "cpu", Shape([0, 1]))
    finally:
        sess.shutdown()


@tvm_ffi.register_global_func("tvm_ext_test.ccl_ragged")
def _ragged():
    rank = _rank()
    x = tvm.runtime.tensor(np.ones(4 + min(rank, 1), "float32"), tvm.cpu(rank))
    tvm_ffi.get_global_func("runtime.disco.allreduce")(x, Shape([0]), False, x)


@tvm_ffi.register_global_func("tvm_ext_test.ccl_different_ops")
def _different_ops():
    x = tvm.runtime.tensor(np.ones(4, "float32"), tvm.cpu(0))
    if _rank() == 0:
        tvm_ffi.get_global_func("runtime.disco.allreduce")(x, Shape([0]), False, x)
    else:
        tvm_ffi.get_global_func("runtime.disco.broadcast_from_worker0")(x, False, x)


@tvm_ffi.register_global_func("tvm_ext_test.ccl_fail_on_1")
def _fail_on_1():
    x = tvm.runtime.tensor(np.ones(4, "float32"), tvm.cpu(0))
    if _rank() == 1:
        raise ValueError("boom on worker one")
    tvm_ffi.get_global_func("runtime.disco.allreduce")(x, Shape([0]), False, x)


@tvm_ffi.register_global_func("tvm_ext_test.ccl_only_0")
def _only_0():
    x = tvm.runtime.tensor(np.ones(4, "float32"), tvm.cpu(0))
    if _rank() == 0:
        tvm_ffi.get_global_func("runtime.disco.allreduce")(x, Shape([0]), False, x)


def test_error_shape_mismatch_between_workers_fails_on_all(sessions):
    sess = sessions(3)
    with pytest.raises(dist.DistributedError, match=r"worker 1 sends float32\[5\] but worker 0 "
                       r"sends float32\[4\]") as info:
        sess.call("tvm_ext_test.ccl_ragged")
        sess.check("ragged")
    assert "workers [1, 2] failed too" in str(info.value)
    _check_session_still_works(sess)


def test_error_different_collectives(sessions):
    sess = sessions(2)
    with pytest.raises(dist.DistributedError,
                       match="worker 1 called broadcast_from_worker0 while worker 0 called "
                             "allreduce"):
        sess.call("tvm_ext_test.ccl_different_ops")
        sess.check()
    _check_session_still_works(sess)


def test_error_local_arguments(sessions):
    sess = sessions(3)
    src = sess.empty((2,), "float32")
    with pytest.raises(dist.DistributedError, match="must hold 3 times the elements of send"):
        _builtin(sess, "allgather", src, False, sess.empty((5,), "float32"))
    flags = sess.empty((2,), "bool")
    with pytest.raises(dist.DistributedError, match="avg of bool is not defined"):
        _builtin(sess, "allreduce", flags, Shape([KINDS["avg"]]), False, flags)
    with pytest.raises(dist.DistributedError, match="unknown reduce kind 7"):
        sess.call("runtime.disco.cpu.allreduce", src, 7, False, src)
        sess.check()
    with pytest.raises(dist.DistributedError, match="differ in dtype"):
        _builtin(sess, "allreduce", src, Shape([0]), False, sess.empty((2,), "float64"))
    _check_session_still_works(sess)


def test_failing_worker_stops_the_waiting_ones_at_once():
    with dist.Session(3, timeout=120) as sess:
        start = time.perf_counter()
        with pytest.raises(dist.DistributedError,
                           match=r"failed on worker 1: .*boom on worker one") as info:
            sess.call("tvm_ext_test.ccl_fail_on_1")
            sess.check()
        assert time.perf_counter() - start < 60  # not the 120 s timeout
        assert "workers [0, 2] were stopped by it" in str(info.value)
        _check_session_still_works(sess)


def test_missing_worker_times_out():
    with dist.Session(2, timeout=2.0) as sess:
        with pytest.raises(dist.DistributedError, match=r"worker 0 waited 2 s"):
            sess.call("tvm_ext_test.ccl_only_0")
            sess.check()
        _check_session_still_works(sess)


def _check_session_still_works(sess: dist.Session) -> None:
    k = sess.num_workers
    src = sess.per_worker([np.full(3, i, "float32") for i in range(k)])
    _builtin(sess, "allreduce", src, Shape([0]), False, src)
    for value in sess.worker_values(src):
        np.testing.assert_array_equal(value, np.full(3, sum(range(k)), "float32"))


# -- lifetime --------------------------------------------------------------------------------------


def test_sessions_repeat_and_coexist():
    for _ in range(3):
        with dist.Session(2) as sess:
            _check_session_still_works(sess)
    with dist.Session(2) as a, dist.Session(3) as b:
        for _ in range(5):
            _check_session_still_works(a)
            _check_session_still_works(b)


def test_sync_worker_is_a_no_op_on_worker_0_alone():
    with dist.Session(3) as sess:
        sess._sess.sync_worker_0()  # TVM's SyncWorker builtin -> runtime.disco.cpu.sync_worker
        _check_session_still_works(sess)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        tvm_ext.runtime.get_function("tvm_ext.ccl.cpu.set_timeout")(0.0)
