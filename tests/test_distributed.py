"""tvm_ext.runtime.distributed: sessions, placing and gathering arrays, running modules on k
workers, per-worker memory. Modules come from Relax's own distributed lowering (a Megatron MLP)
and from hand-written per-worker code."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.distributed import transform as dist_transform
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_ext
from tvm_ext.runtime import distributed as dist

B, D, H = 4, 12, 24  # H and D divisible by 1, 2, 3, 4

_MEGATRON = """
@I.ir_module
class MLP:
    I.module_global_infos({{"mesh": [R.dist.device_mesh(({k},), I.Range(0, {k}))]}})

    @R.function
    def main(x: R.Tensor(({B}, {D}), "{dt}"), w1: R.Tensor(({D}, {H}), "{dt}"),
             w2: R.Tensor(({H}, {D}), "{dt}")) -> R.Tensor(({B}, {D}), "{dt}"):
        w1s = R.dist.annotate_sharding(w1, device_mesh="mesh[0]", placement="S[1]")
        h = R.matmul(x, w1s)
        a = R.nn.relu(h)
        w2s = R.dist.annotate_sharding(w2, device_mesh="mesh[0]", placement="S[0]")
        y = R.matmul(a, w2s)
        return y
"""

# Per-worker (local view) code of the same plan, written by hand: parameters arrive sharded.
_LOCAL_MLP = """
@I.ir_module
class LocalMLP:
    @R.function
    def main(x: R.Tensor(({B}, {D}), "float32"), w1: R.Tensor(({D}, {Hk}), "float32"),
             w2: R.Tensor(({Hk}, {D}), "float32")) -> R.Tensor(({B}, {D}), "float32"):
        a = R.nn.relu(R.matmul(x, w1))
        y = R.ccl.allreduce(R.matmul(a, w2), "sum")
        return y
"""


def _lower_megatron(k: int, dtype: str = "float32") -> tvm.IRModule:
    mod = tvm.script.from_source(_MEGATRON.format(k=k, B=B, D=D, H=H, dt=dtype),
                                 extra_vars={"I": I, "R": R})
    # LegalizeOps before PropagateSharding: on un-legalized matmuls the allreduce is dropped.
    return tvm.transform.Sequential([
        relax.transform.LegalizeOps(),
        dist_transform.PropagateSharding(),
        dist_transform.LowerGlobalViewToLocalView(),
        dist_transform.LegalizeRedistribute(),
        dist_transform.LowerDistIR(),
    ])(mod)


def _mlp_arguments(dtype: str = "float32") -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(dtype) for s in ((B, D), (D, H), (H, D))]


def _mlp_reference(x, w1, w2) -> np.ndarray:
    x, w1, w2 = (a.astype(np.float64) for a in (x, w1, w2))
    return np.maximum(x @ w1, 0) @ w2


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_megatron_mlp_from_relax_distributed_runs_on_k_workers(k):
    lowered = _lower_megatron(k)
    script = lowered.script()
    if k > 1:
        assert "R.ccl.allreduce" in script and "R.ccl.scatter_from_worker0" in script
    args = _mlp_arguments()
    with dist.Session(k) as sess:
        module = sess.load_module(tvm.compile(lowered, target="llvm"))
        # LowerDistIR's main scatters its parameters from worker 0 itself.
        result = dist.run(sess, module, args, [dist.WORKER0] * 3, [None], repeat=2)
        np.testing.assert_allclose(result.outputs[0], _mlp_reference(*args), rtol=1e-5, atol=1e-5)
        assert len(result.latencies_ms) == 2
        outs = module["main"](*(sess.on_worker0(a) for a in args))
        values = sess.worker_values(outs[0])  # the allreduce leaves the result on every worker
        for value in values[1:]:
            np.testing.assert_array_equal(value, values[0])


def test_megatron_mlp_float16():
    args = _mlp_arguments("float16")
    with dist.Session(2) as sess:
        module = sess.load_module(tvm.compile(_lower_megatron(2, "float16"), target="llvm"))
        result = dist.run(sess, module, args, [dist.WORKER0] * 3, [None])
        assert result.outputs[0].dtype == np.float16
        np.testing.assert_allclose(result.outputs[0].astype(np.float64), _mlp_reference(*args),
                                   rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_sharded_parameters_and_per_worker_memory(k):
    mod = tvm.script.from_source(_LOCAL_MLP.format(B=B, D=D, Hk=H // k),
                                 extra_vars={"I": I, "R": R})
    args = _mlp_arguments()
    with dist.Session(k) as sess:
        module = sess.load_module(tvm.compile(mod, target="llvm"))
        result = dist.run(sess, module, args, [None, 1, 0], [None])
        np.testing.assert_allclose(result.outputs[0], _mlp_reference(*args), rtol=1e-5, atol=1e-5)
        # Each worker holds x and its 1/k of both weights: counted on its own device, exactly.
        shard_bytes = 4 * (B * D + 2 * D * H // k)
        assert result.argument_bytes == [shard_bytes] * k
        assert all(p >= shard_bytes + 4 * B * D for p in result.peak_bytes)  # + the output
        assert len(set(result.peak_bytes)) == 1


def test_per_worker_peak_shrinks_with_more_workers():
    peaks = {}
    for k in (1, 2, 4):
        mod = tvm.script.from_source(_LOCAL_MLP.format(B=B, D=D, Hk=H // k),
                                     extra_vars={"I": I, "R": R})
        with dist.Session(k) as sess:
            module = sess.load_module(tvm.compile(mod, target="llvm"))
            peaks[k] = dist.run(sess, module, _mlp_arguments(), [None, 1, 0], [None]).peak_bytes
    assert peaks[1][0] > peaks[2][0] > peaks[4][0]


def test_memory_stats_are_kept_per_worker_device():
    with dist.Session(3) as sess:
        assert sess.devices == [tvm.cpu(0), tvm.cpu(1), tvm.cpu(2)]
        before = sess.memory_stats()
        with sess.measure_peak() as peaks:
            arr = sess.scatter(np.zeros((3, 1000), "float32"), axis=0)
        after = sess.memory_stats()
        for i in range(3):
            assert after[i].in_use - before[i].in_use == 4000
            # the controller reads the same counters of cpu(i)
            assert tvm_ext.runtime.memory_stats(tvm.cpu(i)).in_use == after[i].in_use
            assert peaks[i].peak_above_baseline >= 4000
        del arr


def test_placement_round_trips():
    rng = np.random.default_rng(3)
    full = rng.standard_normal((6, 4, 9)).astype("float32")
    with dist.Session(3) as sess:
        for axis in (0, 2, -1):
            parts = sess.worker_values(sess.scatter(full, axis))
            for got, want in zip(parts, np.split(full, 3, axis=axis), strict=True):
                np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(sess.gather(sess.place(full, axis), axis=axis), full)
        np.testing.assert_array_equal(sess.gather(sess.place(full, None)), full)
        values = sess.worker_values(sess.on_worker0(full))
        np.testing.assert_array_equal(values[0], full)


def test_api_errors():
    with pytest.raises(ValueError, match="unknown collective backend"):
        dist.Session(2, "mpi")
    with pytest.raises(ValueError, match="at least one worker"):
        dist.Session(0)
    with pytest.raises(ValueError, match="equal groups"):
        dist.Session(3, num_groups=2)
    with dist.Session(2) as sess, dist.Session(2) as other:
        with pytest.raises(ValueError, match="cannot split axis 0"):
            sess.scatter(np.zeros((3, 2)), axis=0)
        with pytest.raises(ValueError, match="out of range"):
            sess.scatter(np.zeros((4, 2)), axis=2)
        with pytest.raises(ValueError, match="differ in shape"):
            sess.per_worker([np.zeros(2), np.zeros(3)])
        with pytest.raises(ValueError, match="unknown placement"):
            sess.place(np.zeros(2), "everywhere")
        with pytest.raises(FileNotFoundError):
            sess.load_module("/nonexistent/module.so")
        mod = tvm.script.from_source(_LOCAL_MLP.format(B=B, D=D, Hk=H // 2),
                                     extra_vars={"I": I, "R": R})
        module = sess.load_module(tvm.compile(mod, target="llvm"))
        with pytest.raises(dist.DistributedError, match="no function `forward`"):
            module["forward"]
        x = sess.replicate(np.zeros((B, D), "float32"))
        with pytest.raises(dist.DistributedError, match="calling main failed on worker 0"):
            module["main"](x, x, x)  # wrong shapes: the VM's own check, reported, not fatal
        with pytest.raises(TypeError, match="DArrays of this session"):
            module["main"](other.replicate(np.zeros((B, D), "float32")), x, x)
        w1 = sess.scatter(np.zeros((D, H), "float32"), 1)
        w2 = sess.scatter(np.zeros((H, D), "float32"), 0)
        assert sess.gather(module["main"](x, w1, w2)[0]).shape == (B, D)


_CONST = np.arange(24, dtype="float32").reshape(4, 6)


@I.ir_module
class _ConstantsAndShapes:
    @R.function
    def main(x: R.Tensor((4, 6), "float32"), n: R.Tensor(("m",), "float32")):
        m = T.int64()
        z = R.ccl.allreduce(R.add(x, R.const(_CONST)), "sum")
        return (z, (R.sum(n), R.shape([m])))


def test_constants_dynamic_shapes_and_non_tensor_outputs():
    with dist.Session(3) as sess:
        module = sess.load_module(tvm.compile(_ConstantsAndShapes, target="llvm"))
        x = sess.per_worker([np.full((4, 6), i, "float32") for i in range(3)])
        z, total, shape = module["main"](x, sess.replicate(np.arange(5, dtype="float32")))
        np.testing.assert_array_equal(sess.gather(z), 3 * _CONST + 3)
        assert [float(v) for v in sess.worker_values(total)] == [10.0] * 3
        assert shape == (5,)


def test_disco_module_survives_the_stale_import():
    disco = dist.disco_module()
    assert disco is tvm.runtime.disco
    assert hasattr(disco._ffi_api, "SessionThreaded")
