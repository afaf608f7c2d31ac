"""Which loop nests a vendor library computes: GEMM roles and convolution parameters read from
legalized, fused TIR, and nests that must not match."""

from __future__ import annotations

import pytest
from one_op import one_op_module
from tvm import relax, tirx
from tvm.script import tirx as T

from tvm_ext import pipeline
from tvm_ext.driver import resolve_target
from tvm_ext.ir.library_kernels import BATCH, UNIT, K, M, N, find_library_calls

F32 = "float32"


def fused_calls(build, *shapes, dtype=F32):
    """{kernel name: its library calls} of `build(*params)` fused as the pipeline does."""
    mod = pipeline.fuse(one_op_module(build, *shapes, dtypes=[dtype] * len(shapes)),
                        resolve_target("llvm"))
    return {gv.name_hint: find_library_calls(f) for gv, f in mod.functions.items()
            if isinstance(f, tirx.PrimFunc)}


def only_call(calls):
    found = [c for cs in calls.values() for c in cs]
    assert len(found) == 1, calls
    return found[0]


def test_plain_matmul_roles():
    call = only_call(fused_calls(lambda a, b: relax.op.matmul(a, b), (8, 16), (16, 4)))
    assert call.kind == "gemm"
    assert call.roles == ((M, K), (K, N), (M, N))
    assert call.flops == 2 * 8 * 16 * 4


def test_leading_dims_of_a_broadcast_weight_merge_into_m():
    # [2, 3, 8, 16] @ [16, 4] is one (48 x 16) @ (16 x 4) product.
    call = only_call(fused_calls(lambda a, b: relax.op.matmul(a, b), (2, 3, 8, 16), (16, 4)))
    assert call.roles == ((M, K), (K, N), (M, N))
    assert call.views == (((0, 1, 2), (3,)), ((0,), (1,)), ((0, 1, 2), (3,)))


def test_batched_matmul_roles():
    call = only_call(fused_calls(lambda a, b: relax.op.matmul(a, b), (2, 3, 8, 16),
                                 (2, 3, 16, 4)))
    assert call.roles == ((BATCH, BATCH + 1, M, K), (BATCH, BATCH + 1, K, N),
                          (BATCH, BATCH + 1, M, N))


def test_transposed_operand_roles():
    # x @ w.T as legalized and fused: the transpose is read in place.
    call = only_call(fused_calls(
        lambda a, b: relax.op.matmul(a, relax.op.permute_dims(b)), (8, 16), (4, 16)))
    assert call.roles[1] in ((N, K), (K, N))


def test_batch_broadcast_from_unit_axis():
    # [1, 8, 16] @ [3, 16, 4]: A's unit batch axis is read at 0.
    call = only_call(fused_calls(lambda a, b: relax.op.matmul(a, b), (1, 8, 16), (3, 16, 4)))
    assert call.roles == ((UNIT, M, K), (BATCH, K, N), (BATCH, M, N))


def test_matmul_with_epilogue_keeps_its_nest_index():
    calls = fused_calls(lambda a, b: relax.op.nn.gelu(relax.op.matmul(a, b)), (8, 16), (16, 4))
    call = only_call(calls)
    assert call.stmt == 0 and call.kind == "gemm"


def test_convolution_parameters():
    call = only_call(fused_calls(
        lambda x, w: relax.op.nn.conv2d(x, w, strides=2, padding=1, dilation=1),
        (2, 4, 9, 9), (6, 4, 3, 3)))
    assert call.kind == "conv2d"
    assert call.conv == (2, 2, 1, 1, 1)
    assert call.stmt == 1  # after the padding nest


def test_grouped_and_dilated_convolution():
    call = only_call(fused_calls(
        lambda x, w: relax.op.nn.conv2d(x, w, dilation=2, groups=2), (1, 8, 12, 12),
        (6, 4, 3, 3)))
    assert call.conv == (1, 1, 2, 2, 2)


@pytest.mark.parametrize("strides, dilation, groups, conv", [
    (5, 1, 1, (1, 5, 1, 1, 1)),  # wav2vec2's feature extractor: kernel 10, stride 5
    (1, 2, 2, (1, 1, 1, 2, 2)),
])
def test_conv1d_is_a_conv2d_of_unit_height(strides, dilation, groups, conv):
    call = only_call(fused_calls(
        lambda x, w: relax.op.nn.conv1d(x, w, strides=strides, dilation=dilation,
                                        groups=groups), (2, 4, 60), (6, 4 // groups, 10)))
    assert call.kind == "conv1d"
    assert call.conv == conv


@T.prim_func(private=True, s_tir=True)
def _weight_gradient(x: T.Buffer((2, 8, 6, 6), F32), dy: T.Buffer((2, 16, 4, 4), F32),
                     dw: T.Buffer((16, 8, 3, 3), F32)):
    # TVM's conv2d weight gradient: data and output channels-first ([C, N, H, W] roles).
    for ff, nn, yy, xx, rc, ry, rx in T.grid(16, 8, 3, 3, 2, 4, 4):
        with T.sblock("conv2d_cnhw"):
            v_ff, v_nn, v_yy, v_xx, v_rc, v_ry, v_rx = T.axis.remap(
                "SSSSRRR", [ff, nn, yy, xx, rc, ry, rx])
            with T.init():
                dw[v_ff, v_nn, v_yy, v_xx] = T.float32(0.0)
            dw[v_ff, v_nn, v_yy, v_xx] = dw[v_ff, v_nn, v_yy, v_xx] + \
                x[v_rc, v_nn, v_yy + v_ry, v_xx + v_rx] * dy[v_rc, v_ff, v_ry, v_rx]


def test_weight_gradient_roles_come_from_the_indices():
    (call,) = find_library_calls(_weight_gradient)
    assert call.kind == "conv2d" and call.conv == (1, 1, 1, 1, 1)
    # data [rc, nn, h, w] is n at axis 1, c at 0; weight [rc, ff, ..]: f at 1, c at 0;
    # output [ff, nn, ..]: n at 1, f at 0.
    assert call.conv_axes == ((1, 0, 2, 3), (1, 0, 2, 3), (1, 0, 2, 3))
    assert call.weight_copy == ()


def test_grouped_transposed_conv1d_weight_is_copied_to_its_canonical_layout():
    call = only_call(fused_calls(
        lambda x, w: relax.op.nn.conv1d_transpose(x, w, groups=2), (2, 8, 20), (8, 3, 4)))
    assert call.kind == "conv1d"
    variables, indices, extents = call.weight_copy
    assert extents == (6, 4, 4)  # [F, C/g, K] of the equivalent convolution
    assert len(variables) == len(indices) == 3


def test_depthwise_convolution_is_left_to_tvm():
    calls = fused_calls(lambda x, w: relax.op.nn.conv2d(x, w, groups=4), (1, 4, 8, 8),
                        (4, 1, 3, 3))
    assert not any(calls.values())


@pytest.mark.parametrize("build, shapes", [
    (lambda a: relax.op.sum(a, axis=1), [(8, 16)]),
    (lambda a, b: relax.op.add(a, b), [(8, 16), (8, 16)]),
    (lambda a: relax.op.nn.softmax(a), [(4, 8)]),
])
def test_non_gemm_kernels_do_not_match(build, shapes):
    assert not any(fused_calls(build, *shapes).values())


def test_shifted_index_does_not_match():
    @T.prim_func(private=True, s_tir=True)
    def shifted(a: T.Buffer((8, 17), F32), b: T.Buffer((16, 4), F32),
                c: T.Buffer((8, 4), F32)):
        for i, j, k in T.grid(8, 4, 16):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0)
                c[vi, vj] = c[vi, vj] + a[vi, vk + 1] * b[vk, vj]

    assert find_library_calls(shifted) == []


def test_partial_extent_does_not_match():
    # The loop covers 16 of the 32 columns of `a`: a library call would read all of them.
    @T.prim_func(private=True, s_tir=True)
    def partial(a: T.Buffer((8, 32), F32), b: T.Buffer((16, 4), F32), c: T.Buffer((8, 4), F32)):
        for i, j, k in T.grid(8, 4, 16):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    assert find_library_calls(partial) == []


def test_accumulation_without_init_does_not_match():
    @T.prim_func(private=True, s_tir=True)
    def accumulate(a: T.Buffer((8, 16), F32), b: T.Buffer((16, 4), F32),
                   c: T.Buffer((8, 4), F32)):
        for i, j, k in T.grid(8, 4, 16):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    assert find_library_calls(accumulate) == []
