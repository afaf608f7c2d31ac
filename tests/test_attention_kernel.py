"""The fused attention kernel: its serial form computes softmax(scale * Q K^T + bias) V as the
unfused graph does (online softmax over key tiles, lanes meeting in shared memory), at ragged
sizes, grouped and broadcast heads, broadcast biases and fully masked rows; its GPU form is the
same statements bound to blocks and threads, and compiles for CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from cuda_source import cuda_source

from tvm_ext.ir.attention_backward_kernel import BackwardSpec
from tvm_ext.ir.attention_kernel import LANES, ROWS, TILE_KV, AttentionSpec, attention_kernel
from tvm_ext.ir.kernel_cost import analyze_kernel
from tvm_ext.schedules.default_gpu import MAX_SERIAL_ITERATIONS
from tvm_ext.schedules.thread_work import serial_iterations


def _reference(q, k, v, biases, scale, zero_rows):
    """float64 softmax attention, -inf rows as numpy's softmax gives them (NaN) or zeroed."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) * scale
    for bias in biases:
        s = s + bias
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
    if zero_rows:
        p = np.where(np.all(s == -np.inf, -1, keepdims=True), 0, p)
    return np.einsum("bhqk,bhkd->bhqd", p, v)


def _run(spec: AttentionSpec, seed: int = 0, masked: float = 0.3):
    rng = np.random.default_rng(seed)
    b, h, hk = spec.batch, spec.heads, spec.kv_heads
    q = rng.standard_normal((b, h, spec.q_len, spec.head_dim)).astype("float32")
    k = rng.standard_normal((b, hk, spec.kv_len, spec.head_dim)).astype("float32")
    v = rng.standard_normal((b, hk, spec.kv_len, spec.value_dim)).astype("float32")
    biases = []
    for shape in spec.bias_shapes:
        bias = rng.standard_normal(shape).astype("float32")
        bias[rng.random(shape) < masked] = -np.inf
        biases.append(bias)
    func = attention_kernel(spec).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.empty((b, h, spec.q_len, spec.value_dim), "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(x) for x in (q, k, v, *biases)], out)
    return out.numpy(), _reference(q, k, v, biases, spec.scale, spec.zero_masked_rows)


def _spec(b=2, h=4, hk=2, sq=70, sk=45, d=16, dv=16, biases=(), zero_rows=False, scale=0.3):
    return AttentionSpec(b, h, hk, sq, sk, d, dv, "float32", scale, tuple(biases),
                         ("float32",) * len(biases), zero_rows)


@pytest.mark.parametrize("spec", [
    # ragged query and key tiles, grouped heads, a per-batch causal-style mask
    _spec(biases=[(2, 1, 70, 45)]),
    # one key head for all (multi-query), a padding mask over keys, value dim != head dim
    _spec(b=1, h=3, hk=1, sq=33, sk=64, d=8, dv=12, biases=[(1, 1, 1, 64)]),
    # no bias; dims not a multiple of the vector width (scalar loads)
    _spec(b=1, h=3, hk=1, sq=40, sk=37, d=6, dv=5),
    # two biases (T5: a per-head position bias and a padding mask), whole tiles
    _spec(b=2, h=2, hk=2, sq=ROWS * 2, sk=TILE_KV * 2, d=32, dv=32,
          biases=[(1, 2, ROWS * 2, TILE_KV * 2), (2, 1, 1, TILE_KV * 2)]),
], ids=["gqa-mask", "mqa-padding", "no-bias-scalar", "two-biases"])
def test_the_serial_kernel_equals_softmax_attention(spec):
    out, ref = _run(spec)
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)


def test_mixed_precision_rounds_the_operands_as_the_products_read_them():
    """With operand_dtype (a mixed-precision step: both products read bfloat16 casts), Q, K,
    V and the probabilities are rounded to bfloat16, the rest stays float32."""
    import ml_dtypes

    def rounded(x):
        return x.astype(ml_dtypes.bfloat16).astype("float32")

    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 40, 16)).astype("float32") for _ in range(3))
    outs = {}
    for low in (None, "bfloat16"):
        spec = AttentionSpec(1, 2, 2, 40, 40, 16, 16, "float32", 0.25, operand_dtype=low)
        func = attention_kernel(spec).with_attr("global_symbol", "main")
        lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
        out = tvm.runtime.empty((1, 2, 40, 16), "float32", tvm.cpu())
        lib["main"](*[tvm.runtime.tensor(x) for x in (q, k, v)], out)
        outs[low] = out.numpy()
    want = _reference(rounded(q), rounded(k), rounded(v), [], 0.25, False)
    np.testing.assert_allclose(outs["bfloat16"], want, atol=1e-2 * np.abs(want).max())
    assert np.abs(outs["bfloat16"] - outs[None]).max() > 1e-5  # the rounding happened


def test_fully_masked_rows_give_nan_or_zeros_as_the_graph_does():
    """Every key of rows 0..4 at -inf: softmax of all -inf is NaN (eager attention), PyTorch's
    scaled_dot_product_attention zeroes those rows. Rows 5..9 are -inf on their first two
    tiles only: they must not be poisoned by exp(-inf + inf) before a finite score comes."""
    sk = 3 * TILE_KV
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 40, 16)).astype("float32")
    k = rng.standard_normal((1, 2, sk, 16)).astype("float32")
    v = rng.standard_normal((1, 2, sk, 16)).astype("float32")
    bias = np.zeros((1, 1, 40, sk), "float32")
    bias[0, 0, :5] = -np.inf
    bias[0, 0, 5:10, : 2 * TILE_KV] = -np.inf
    for zero_rows in (False, True):
        spec = _spec(b=1, h=2, hk=2, sq=40, sk=sk, biases=[bias.shape], zero_rows=zero_rows)
        func = attention_kernel(spec).with_attr("global_symbol", "main")
        lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
        got = tvm.runtime.empty((1, 2, 40, 16), "float32", tvm.cpu())
        lib["main"](*[tvm.runtime.tensor(x) for x in (q, k, v, bias)], got)
        got = got.numpy()
        ref = _reference(q, k, v, [bias], spec.scale, zero_rows)
        if zero_rows:
            assert (got[:, :, :5] == 0).all()
        else:
            assert np.isnan(got[:, :, :5]).all()
        assert np.isfinite(got[:, :, 5:]).all()
        np.testing.assert_allclose(got[:, :, 5:], ref[:, :, 5:], rtol=1e-5, atol=2e-6)


def test_a_spec_that_does_not_broadcast_is_refused():
    with pytest.raises(ValueError, match="does not broadcast"):
        _spec(biases=[(2, 3, 70, 45)])
    with pytest.raises(ValueError, match="not a multiple"):
        _spec(h=3, hk=2)
    with pytest.raises(ValueError, match="at most two"):
        _spec(biases=[(1, 1, 1, 45)] * 3)


def test_its_flops_are_read_from_the_blocks():
    """The cost model reads the kernel like any other: the two products' FLOPs (plus the
    softmax's few operations per score) over the whole grid, not per thread block."""
    spec = _spec(b=2, h=4, hk=2, sq=ROWS * 2, sk=TILE_KV * 4, d=32, dv=32)
    for gpu in (False, True):
        cost = analyze_kernel(attention_kernel(spec, gpu=gpu))
        assert spec.flops <= cost.flops <= 1.5 * spec.flops
    # On the GPU its scratch is on chip (shared and local memory), not device memory.
    assert analyze_kernel(attention_kernel(spec, gpu=True)).scratch_bytes == 0


def test_the_gpu_kernel_spreads_rows_and_lanes_over_threads(cuda_target):
    """At GPT-2's size (512 keys, head dim 64) a thread runs 4096 iterations (the key walk of
    FlashAttention), within the bound of the real-size schedule test; it compiles for CUDA."""
    spec = AttentionSpec(2, 12, 12, 512, 512, 64, 64, "float32", 0.125, ((2, 1, 512, 512),),
                         ("float32",), True)
    func = attention_kernel(spec, gpu=True)
    assert func.attrs["tirx.is_scheduled"]
    work = serial_iterations(func)
    assert work.iterations <= MAX_SERIAL_ITERATIONS
    assert work.iterations == 512 // LANES * 64
    source = cuda_source(func, cuda_target)
    assert "__shared__" in source and "blockIdx.y" in source
    assert "float4" in source  # keys and values read four floats at a time


def test_low_precision_operands_compile_for_cuda(cuda_target):
    spec = AttentionSpec(1, 4, 2, 128, 96, 64, 64, "bfloat16", 0.125)
    cuda_source(attention_kernel(spec, gpu=True), cuda_target)
    # autocast's Llama: float32 Q and K rounded to bfloat16 beside a bfloat16 V
    autocast = AttentionSpec(1, 4, 2, 128, 128, 64, 64, "bfloat16", 0.125, ((1, 1, 128, 128),),
                             ("float32",), True, "bfloat16", 0, "float32")
    source = cuda_source(attention_kernel(autocast, gpu=True), cuda_target)
    assert "float* __restrict__ q" in source and "nv_bfloat16* __restrict__ v" in source


def test_float32_queries_and_keys_need_rounding_beside_a_low_value():
    with pytest.raises(ValueError, match="rounded to bfloat16"):
        AttentionSpec(1, 2, 2, 8, 8, 8, 8, "bfloat16", 1.0, qk_dtype="float32")
    spec = AttentionSpec(1, 2, 2, 8, 8, 8, 8, "bfloat16", 1.0, operand_dtype="bfloat16",
                         qk_dtype="float32")
    with pytest.raises(ValueError, match="no fused backward"):
        BackwardSpec(spec, 1.0, 1.0)
