"""Causal tile skipping: a constant bias that masks every key past a line parallel to the
diagonal is read as the spec's `causal_offset`, and the fused kernels skip the tiles past it
with the same bits as walking them (their probabilities are exp(-inf) = 0); the cost model
counts only the tiles walked; the kernels compile for CUDA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from cuda_source import cuda_source
from tvm import relax, tirx
from tvm.script import tirx as T

from tvm_ext.ir.attention_backward_kernel import (
    BackwardSpec,
    attention_backward_kernels,
    key_splits,
)
from tvm_ext.ir.attention_kernel import ROWS, TILE_KV, AttentionSpec, attention_kernel
from tvm_ext.ir.attention_mask import causal_offset
from tvm_ext.ir.attention_pattern import find_attention
from tvm_ext.ir.kernel_cost import analyze_kernel
from tvm_ext.passes import FuseAttention
from tvm_ext.schedules.default_gpu import MAX_SERIAL_ITERATIONS
from tvm_ext.schedules.thread_work import serial_iterations


def _causal(q_len: int, kv_len: int, offset: int) -> np.ndarray:
    keys, rows = np.arange(kv_len)[None, :], np.arange(q_len)[:, None]
    return np.where(keys > rows + offset, -np.inf, 0).astype("float32")


def test_the_offset_is_read_from_the_constant_masks():
    assert causal_offset([_causal(8, 8, 0)], 8, 8) == 0
    assert causal_offset([_causal(8, 8, 0)[None, None]], 8, 8) == 0
    assert causal_offset([_causal(8, 12, 4)], 8, 12) == 4  # aligned to the last key
    # A runtime bias (None) beside the constant one, and a padding mask broadcast over rows
    # that masks the last key: the line moves left by what every row loses.
    padding = np.zeros((1, 8), "float32")
    padding[0, 7] = -np.inf
    assert causal_offset([None, _causal(8, 8, 2)], 8, 8) == 2
    assert causal_offset([_causal(8, 8, 2), padding], 8, 8) == 2
    # A key masked in one batch only is not masked for the kernel.
    per_batch = np.stack([_causal(8, 8, 0), np.zeros((8, 8), "float32")])[:, None]
    assert causal_offset([per_batch], 8, 8) is None
    # Nothing masked, or nothing a row's last key leaves: no line.
    assert causal_offset([np.zeros((8, 8), "float32")], 8, 8) is None
    assert causal_offset([None], 8, 8) is None
    assert causal_offset([_causal(8, 8, 7)], 8, 8) is None
    # A row with every key masked: a skip would zero its gradients where the graph gives NaN.
    full = _causal(8, 8, 0)
    full[3] = -np.inf
    assert causal_offset([full], 8, 8) is None
    # A large negative (not -inf) is not a proof: exp of it need not be 0 after the scores.
    assert causal_offset([np.where(np.isinf(_causal(8, 8, 0)), -1e9, 0)], 8, 8) is None


def _spec(b=1, h=4, hk=2, sq=90, sk=90, d=16, offset=0, second=False, zero_rows=False):
    shapes = [(1, 1, sq, sk)] + ([(b, 1, 1, sk)] if second else [])
    return AttentionSpec(b, h, hk, sq, sk, d, d, "float32", 0.3, tuple(shapes),
                         ("float32",) * len(shapes), zero_rows, causal_offset=offset)


def _compiled(func):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                       target="llvm")["main"]


def _outputs(spec: AttentionSpec, arrays: list) -> list[np.ndarray]:
    """The forward's output and lse, dQ, dK', dV' (summed over the keys kernel's splits),
    then dQ and lse of the rows kernel that computes each row's lse itself."""
    b, h, sq, sk, d = spec.batch, spec.heads, spec.q_len, spec.kv_len, spec.head_dim
    q, k, v, *biases, do = (tvm.runtime.tensor(a) for a in arrays)

    def empty(*shape):
        return tvm.runtime.empty(shape, "float32", tvm.cpu())

    o, lse = empty(b, h, sq, d), empty(b, h, sq)
    _compiled(attention_kernel(spec, with_lse=True))(q, k, v, *biases, o, lse)
    rows, keys = attention_backward_kernels(BackwardSpec(spec, 0.7, 1.3, lse_from_forward=True))
    dq, lse_out, delta = empty(b, h, sq, d), empty(b, h, sq), empty(b, h, sq)
    _compiled(rows)(q, k, v, *biases, o, do, lse, dq, lse_out, delta)
    splits = key_splits(spec)[0]
    dk, dv = empty(splits, b, h, sk, d), empty(splits, b, h, sk, d)
    _compiled(keys)(q, k, v, *biases, do, lse, delta, dk, dv)
    # the rows kernel that walks the keys once more for each row's log-sum-exp
    walking, _ = attention_backward_kernels(BackwardSpec(spec, 0.7, 1.3))
    dq2, lse2, delta2 = empty(b, h, sq, d), empty(b, h, sq), empty(b, h, sq)
    _compiled(walking)(q, k, v, *biases, o, do, dq2, lse2, delta2)
    return [o.numpy(), lse.numpy(), dq.numpy(), dk.numpy().sum(0), dv.numpy().sum(0),
            dq2.numpy(), lse2.numpy()]


@pytest.mark.parametrize("spec", [
    _spec(),  # ragged tiles: 90 rows and keys, three tiles of 32
    _spec(sq=70, sk=110, offset=40),  # fewer queries than keys, aligned to the last key
    # a runtime padding mask beside the constant causal one, rows it masks wholly zeroed
    _spec(b=2, offset=5, second=True, zero_rows=True),
    _spec(h=2, hk=1, sq=600, sk=600),  # the keys kernel walks its queries in two parts
])
def test_skipping_the_masked_tiles_gives_the_same_bits(spec):
    rng = np.random.default_rng(0)
    b, h, hk, sq, sk, d = spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len, \
        spec.head_dim
    arrays = [rng.standard_normal(shape).astype("float32")
              for shape in ((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, d))]
    arrays.append(_causal(sq, sk, spec.causal_offset)[None, None])
    if len(spec.bias_shapes) == 2:
        padding = np.zeros((b, 1, 1, sk), "float32")
        padding[1, 0, 0, :8] = -np.inf  # batch 1's first rows see no key
        arrays.append(padding)
    arrays.append(rng.standard_normal((b, h, sq, d)).astype("float32"))
    skipped = _outputs(spec, arrays)
    walked = _outputs(dataclasses.replace(spec, causal_offset=None), arrays)
    for got, want in zip(skipped, walked, strict=True):
        np.testing.assert_array_equal(got, want)
    # zeroed rows, not NaN (their lse is -inf)
    assert all(np.isfinite(x).all() for i, x in enumerate(skipped) if i not in (1, 6))
    np.testing.assert_array_equal(skipped[6], skipped[1])  # both rows kernels' lse


def test_the_cost_model_counts_the_tiles_walked():
    """At 512 queries and keys, 16 x 16 tiles of which 136 are walked: the products' FLOPs
    are 136/256 of the full walk's, in the forward and in both backward kernels."""
    spec = _spec(sq=512, sk=512, d=64)
    full = dataclasses.replace(spec, causal_offset=None)
    assert 512 // ROWS == 512 // TILE_KV == 16
    for gpu in (False, True):
        skipped, walked = (analyze_kernel(attention_kernel(s, gpu=gpu)).flops
                           for s in (spec, full))
        assert 0.5 < skipped / walked < 136 / 256 + 0.02
        pairs = [attention_backward_kernels(BackwardSpec(s, 1.0, 1.0), gpu=gpu)
                 for s in (spec, full)]
        for skip, walk in zip(*pairs, strict=True):
            assert 0.5 < analyze_kernel(skip).flops / analyze_kernel(walk).flops < 0.56


def test_a_guard_on_anything_but_loop_indices_counts_every_iteration():
    @T.prim_func(private=True, s_tir=True)
    def guarded(a: T.Buffer((64,), "float32"), c: T.Buffer((64,), "float32"),
                n: T.Buffer((1,), "int32")):
        for i in T.serial(64):
            if i < 16:
                with T.sblock("low"):
                    vi = T.axis.spatial(64, i)
                    c[vi] = a[vi] * T.float32(2)
            if i < n[0]:
                with T.sblock("data"):
                    vi = T.axis.spatial(64, i)
                    c[vi] = a[vi] + T.float32(1)

    # "low": 64 iterations, a quarter admitted, one multiply; "data": all 64, one add.
    assert analyze_kernel(guarded).flops == 64 / 4 + 64


def _masked_attention(seq: int, mask: np.ndarray | None) -> tvm.IRModule:
    """GPT-2's eager attention on [1, 2, seq, 16] with the mask a constant of the module, or
    (None) a causal one computed from `arange`s as torch.export writes it."""
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((1, 2, seq, 16), "float32")) for n in "qkv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            if mask is None:
                keys = relax.op.expand_dims(relax.op.arange(0, seq, 1, "int64"), [0])
                rows = relax.op.expand_dims(relax.op.arange(0, seq, 1, "int64"), [1])
                seen = bb.emit(relax.op.less_equal(bb.emit(keys), bb.emit(rows)))
                bias = bb.emit(relax.op.where(seen, relax.const(0.0, "float32"),
                                              relax.const(float("-inf"), "float32")))
            else:
                bias = relax.const(mask)
            s = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
            s = bb.emit(relax.op.multiply(s, relax.const(0.25, "float32")))
            s = bb.emit(relax.op.add(s, bias))
            o = bb.emit_output(bb.emit(relax.op.matmul(relax.op.nn.softmax(s, axis=-1), v)))
        bb.emit_func_output(o)
    return bb.get()


def test_fuse_attention_skips_a_constant_causal_masks_tiles():
    """A module whose mask is a causal one, constant or computed from constants: the match
    carries the offset, the fused kernel costs about half the walk and computes what the
    unfused module does."""
    seq = 100
    computed = _masked_attention(seq, None)  # torch.export's form
    assert find_attention(computed["main"])[0].spec.causal_offset == 0
    mod = _masked_attention(seq, _causal(seq, seq, 0)[None, None])
    [match] = find_attention(mod["main"])
    assert match.spec.causal_offset == 0
    other = _masked_attention(seq, np.zeros((1, 1, seq, seq), "float32"))
    assert find_attention(other["main"])[0].spec.causal_offset is None
    fused = FuseAttention(tvm.target.Target("llvm"))(mod)
    [kernel] = [f for _, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)]
    # 4 x 4 tiles of 32, 10 walked
    walked = attention_kernel(dataclasses.replace(match.spec, causal_offset=None))
    assert analyze_kernel(kernel).flops < 0.7 * analyze_kernel(walked).flops
    rng = np.random.default_rng(0)
    arrays = [tvm.runtime.tensor(rng.standard_normal((1, 2, seq, 16)).astype("float32"))
              for _ in range(3)]
    got, want = (relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())["main"](
        *arrays).numpy() for m in (fused, mod))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_gpu_kernels_walk_up_to_the_line_within_the_thread_bound(cuda_target):
    """At GPT-2's size each kernel's walk ends (or the keys kernel's starts) at its tile's
    line, a bound read from the block's index; no thread runs more than the full walk."""
    spec = AttentionSpec(2, 12, 12, 512, 512, 64, 64, "float32", 0.125, ((1, 1, 512, 512),),
                         ("float32",), causal_offset=0)
    kernels = [attention_kernel(spec, gpu=True, with_lse=True),
               *attention_backward_kernels(BackwardSpec(spec, 1.0, 1.0, True), gpu=True)]
    for func in kernels:
        assert serial_iterations(func).iterations <= MAX_SERIAL_ITERATIONS
        source = cuda_source(func, cuda_target)
        assert "blockIdx.x" in source.split("for (int kt", 1)[-1].split("\n", 1)[0] or \
            "blockIdx.x" in source.split("for (int qt", 1)[-1].split("\n", 1)[0]
