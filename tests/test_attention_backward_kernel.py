"""The fused attention backward kernels: their serial forms compute dQ, dK' and dV' as autograd
of softmax(scale * Q K^T + bias) V does (float64 reference), at ragged sizes, grouped and
broadcast heads, one and two broadcast biases and fully masked rows; their GPU forms stay
within the per-thread bound at GPT-2's size and compile for CUDA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from cuda_source import cuda_source

from tvm_ext.ir.attention_backward_kernel import (
    BackwardSpec,
    attention_backward_kernels,
    key_splits,
)
from tvm_ext.ir.attention_kernel import AttentionSpec
from tvm_ext.ir.kernel_cost import analyze_kernel
from tvm_ext.schedules.default_gpu import MAX_SERIAL_ITERATIONS
from tvm_ext.schedules.thread_work import serial_iterations

DQ_SCALE, DK_SCALE = 0.7, 1.3


def _bfloat16(x):
    """float32 -> bfloat16 -> float32, to nearest even (numpy has no bfloat16)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def _reference(q, k, v, biases, do, spec: AttentionSpec):
    """(O, dQ, dK', dV') in float64: the forward, then the chain rule written out; with the
    spec's bfloat16 operands, every product's operands rounded as the unfused step's are."""
    def r(x):
        if spec.operand_dtype == "float16":
            return x.astype(np.float16).astype(np.float64)
        return _bfloat16(x).astype(np.float64) if spec.operand_dtype else x

    group = q.shape[1] // k.shape[1]
    k = np.repeat(r(k.astype(np.float64)), group, axis=1)
    v = np.repeat(r(v.astype(np.float64)), group, axis=1)
    q, do = r(q.astype(np.float64)), r(do.astype(np.float64))
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * spec.scale
    for bias in biases:
        s = s + bias
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
    if spec.zero_masked_rows:
        p = np.where(np.all(s == -np.inf, -1, keepdims=True), 0, p)
    o = np.einsum("bhqk,bhkd->bhqd", p, v)
    dp = np.einsum("bhqd,bhkd->bhqk", do, v)
    ds = r(p * (dp - (dp * p).sum(-1, keepdims=True)))
    return (o, DQ_SCALE * np.einsum("bhqk,bhkd->bhqd", ds, k),
            DK_SCALE * np.einsum("bhqk,bhqd->bhkd", ds, q),
            np.einsum("bhqk,bhqd->bhkd", r(p), do))


def _compiled(func):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                       target="llvm")["main"]


def _run(spec: AttentionSpec, masked: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    b, h, hk, sq, sk = spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len
    q = rng.standard_normal((b, h, sq, spec.head_dim)).astype("float32")
    k = rng.standard_normal((b, hk, sk, spec.head_dim)).astype("float32")
    v = rng.standard_normal((b, hk, sk, spec.value_dim)).astype("float32")
    do = rng.standard_normal((b, h, sq, spec.value_dim)).astype("float32")
    biases = []
    for shape in spec.bias_shapes:
        bias = rng.standard_normal(shape).astype("float32")
        bias[rng.random(shape) < masked] = -np.inf
        biases.append(bias)
    o, *want = _reference(q, k, v, biases, do, spec)
    rows, keys = attention_backward_kernels(BackwardSpec(spec, DQ_SCALE, DK_SCALE))
    tensors = [tvm.runtime.tensor(x) for x in (q, k, v, *biases)]
    dq = tvm.runtime.empty(q.shape, "float32", tvm.cpu())
    lse, delta = (tvm.runtime.empty((b, h, sq), "float32", tvm.cpu()) for _ in range(2))
    _compiled(rows)(*tensors, tvm.runtime.tensor(o.astype("float32")),
                    tvm.runtime.tensor(do), dq, lse, delta)
    splits = key_splits(spec)[0]
    dk = tvm.runtime.empty((splits, b, h, sk, spec.head_dim), "float32", tvm.cpu())
    dv = tvm.runtime.empty((splits, b, h, sk, spec.value_dim), "float32", tvm.cpu())
    _compiled(keys)(*tensors, tvm.runtime.tensor(do), lse, delta, dk, dv)
    return [dq.numpy(), dk.numpy().sum(0), dv.numpy().sum(0)], want


def _spec(b=2, h=4, hk=2, sq=70, sk=45, d=16, dv=16, biases=(), zero_rows=False, scale=0.3):
    return AttentionSpec(b, h, hk, sq, sk, d, dv, "float32", scale, tuple(biases),
                         ("float32",) * len(biases), zero_rows)


@pytest.mark.parametrize("spec,masked", [
    # ragged query, key and tile sizes, grouped heads, a per-batch mask
    (_spec(biases=[(2, 1, 70, 45)]), 0.3),
    # one key head for all, value dim != head dim, a padding mask and a per-head bias, rows
    # whose every key is masked zeroed (PyTorch's scaled_dot_product_attention)
    (_spec(b=1, h=2, hk=1, sq=33, sk=40, d=8, dv=12, biases=[(1, 1, 1, 40), (1, 2, 33, 40)],
           zero_rows=True), 0.5),
    # head dim 64: four floats per lane and shared-memory load
    (_spec(b=1, h=2, hk=2, sq=40, sk=40, d=64, dv=64, scale=0.125), 0.0),
    # many queries, few keys (SegFormer's reduced keys): the query walk in two parts
    (_spec(b=1, h=2, hk=1, sq=600, sk=20, d=64, dv=64, biases=[(1, 1, 600, 20)]), 0.2),
])
def test_the_serial_kernels_compute_the_gradients_of_attention(spec, masked):
    got, want = _run(spec, masked)
    for g, w in zip(got, want, strict=True):
        # NaN exactly where the unfused graph gives NaN (rows of -inf without zeroing)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        finite = ~np.isnan(w)
        np.testing.assert_allclose(g[finite], w[finite], rtol=1e-4,
                                   atol=1e-5 * np.abs(w[finite]).max())


@pytest.mark.parametrize("zero_rows", [False, True])
def test_the_forward_kernels_log_sum_exp_replaces_the_rows_kernels_first_pass(zero_rows):
    """The forward kernel `with_lse` writes each row's log-sum-exp as the rows kernel's first
    walk over the keys computes it, bit for bit (fully masked rows included), so the rows
    kernel that reads it gives the same dQ, lse and delta."""
    from tvm_ext.ir.attention_kernel import attention_kernel

    spec = _spec(b=1, h=4, hk=2, sq=40, sk=36, biases=[(1, 1, 40, 36)], zero_rows=zero_rows)
    rng = np.random.default_rng(1)
    q, do = (rng.standard_normal((1, 4, 40, 16)).astype("float32") for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 36, 16)).astype("float32") for _ in range(2))
    bias = rng.standard_normal((1, 1, 40, 36)).astype("float32")
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    bias[0, 0, 3] = -np.inf  # a row with every key masked
    inputs = [tvm.runtime.tensor(x) for x in (q, k, v, bias)]
    o, lse_fwd = (tvm.runtime.empty(shape, "float32", tvm.cpu())
                  for shape in ((1, 4, 40, 16), (1, 4, 40)))
    _compiled(attention_kernel(spec, with_lse=True))(*inputs, o, lse_fwd)
    outs = {}
    for given in (False, True):
        bspec = BackwardSpec(spec, DQ_SCALE, DK_SCALE, lse_from_forward=given)
        rows, _ = attention_backward_kernels(bspec)
        got = [tvm.runtime.empty(shape, "float32", tvm.cpu())
               for shape in ((1, 4, 40, 16), (1, 4, 40), (1, 4, 40))]
        _compiled(rows)(*inputs, o, tvm.runtime.tensor(do), *([lse_fwd] if given else []), *got)
        outs[given] = [x.numpy() for x in got]
    np.testing.assert_array_equal(lse_fwd.numpy(), outs[False][1])
    assert np.isneginf(lse_fwd.numpy()[0, :2, 3]).all()
    for computed, read in zip(outs[False], outs[True], strict=True):
        np.testing.assert_array_equal(computed, read)


def test_a_long_query_walk_is_split_within_the_thread_bound(cuda_target):
    """SegFormer's first stage at 224 x 224: 3136 queries, 49 keys: the keys kernel walks the
    queries in parts, each within the bound (the rows kernel walks the keys)."""
    spec = AttentionSpec(8, 1, 1, 3136, 49, 32, 32, "float32", 32 ** -0.5)
    assert key_splits(spec) == (4, 25)
    assert key_splits(_spec(sq=512, sk=512, d=64, dv=64)) == (1, 16)
    _compile_both(BackwardSpec(spec, 1.0, 1.0), cuda_target)


def test_fully_masked_rows_give_nan_unless_zeroed():
    """All keys masked for some rows: NaN gradients as the unfused softmax's, or none."""
    for zero_rows in (False, True):
        spec = _spec(b=1, h=2, hk=2, sq=8, sk=8, biases=[(1, 1, 8, 8)], zero_rows=zero_rows)
        got, want = _run(spec, masked=0.9, seed=3)
        assert np.isnan(want[0]).any() != zero_rows
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w))


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_mixed_precision_rounds_every_products_operands(low):
    """Low-precision operands (a mixed-precision step): Q, K, V, dO, P and dS rounded before
    each product. The kernels agree with the rounded chain rule to float32's rounding, and
    differ from the unrounded one by the low dtype's."""
    base = _spec(b=1, h=4, hk=2, sq=40, sk=36, d=16, dv=16, biases=[(1, 1, 40, 36)])
    low = dataclasses.replace(base, operand_dtype=low)
    got, rounded = _run(low, masked=0.2)
    _, exact = _run(base, masked=0.2)
    for g, w, e in zip(got, rounded, exact, strict=True):
        scale = np.abs(w).max()
        assert np.abs(g - w).max() < 1e-4 * scale  # measured <= 2.3e-6 (a rounding may flip)
        assert np.abs(g - e).max() > 1e-4 * scale  # measured 4e-3 (bfloat16), 5e-4 (float16)


def test_the_gpu_kernels_spread_rows_and_lanes_over_threads(cuda_target):
    """At GPT-2's size (512 queries and keys, head dim 64) a thread of either kernel runs
    4096 iterations (FlashAttention's walk over the other side's tiles), within the bound of
    the real-size schedule test; both compile for CUDA with their tiles in shared memory. The
    rows kernel that reads the forward's log-sum-exp skips a third of its work."""
    spec = AttentionSpec(2, 12, 12, 512, 512, 64, 64, "float32", 0.125, ((2, 1, 512, 512),),
                         ("float32",), True)
    rows, keys = attention_backward_kernels(BackwardSpec(spec, 0.125, 0.125), gpu=True)
    rows_given, _ = attention_backward_kernels(
        BackwardSpec(spec, 0.125, 0.125, lse_from_forward=True), gpu=True)
    assert analyze_kernel(rows_given).flops < 0.7 * analyze_kernel(rows).flops
    for func in (rows, keys, rows_given):
        assert func.attrs["tirx.is_scheduled"]
        assert serial_iterations(func).iterations == 4096 <= MAX_SERIAL_ITERATIONS
        # its scratch is on chip (shared and local memory), not device memory
        assert analyze_kernel(func).scratch_bytes == 0
        source = cuda_source(func, cuda_target)
        assert "__shared__" in source and "blockIdx.y" in source


@pytest.mark.parametrize("dtype,operand_dtype", [
    ("bfloat16", None),  # bfloat16 tensors
    ("float32", "bfloat16"),  # a mixed-precision step: float32 tensors, rounded operands
    ("float32", "float16"),
])
def test_low_precision_compiles_for_cuda(cuda_target, dtype, operand_dtype):
    """At full tiles, and at 16 queries (a tile's other rows known to be out of range, so
    their operands fold to constants)."""
    for sq, sk in ((128, 96), (16, 16)):
        spec = AttentionSpec(1, 4, 2, sq, sk, 64, 64, dtype, 0.125, operand_dtype=operand_dtype)
        _compile_both(BackwardSpec(spec, 0.125, 0.125), cuda_target)


def _compile_both(bspec: BackwardSpec, cuda_target):
    """Both GPU kernels within the per-thread bound, compiled for CUDA."""
    for func in attention_backward_kernels(bspec, gpu=True):
        assert serial_iterations(func).iterations <= MAX_SERIAL_ITERATIONS
        cuda_source(func, cuda_target)
