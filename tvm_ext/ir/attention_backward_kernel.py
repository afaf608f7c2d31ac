"""The backward of fused attention as two TIR kernels (FlashAttention-2's backward).

With s_ij = scale * Q_i . K_j + bias_ij, P = softmax_j(s), O = P V and dO the output's
adjoint, the gradients are

    delta_i = dO_i . O_i                       (= sum_j P_ij dP_ij)
    dP_ij   = dO_i . V_j
    dS_ij   = P_ij (dP_ij - delta_i)           (the adjoint of s)
    dQ_i    = dq_scale * sum_j dS_ij K_j
    dK'_j   = dk_scale * sum_i dS_ij Q_i       (per query head: K' is K repeated over groups)
    dV'_j   = sum_i P_ij dO_i                  (per query head)

where dq_scale and dk_scale are what the graph's products were scaled by on the other operand
(`BackwardSpec`). Neither kernel writes P or dS: each recomputes the tile of P it needs from
Q, K and the row's log-sum-exp, so nothing of size q_len x kv_len reaches global memory.

* `rows`: a thread block takes `ROWS` query rows of one (batch, head), `LANES` threads per row
  (as the forward kernel): each row's lse_i = m_i + log(l_i) is read from the forward kernel
  (`lse_from_forward`), or a first pass over the key tiles computes it (the forward's online
  softmax, its statements reused: the same bits); a pass over the key tiles scores the keys
  again, forms P and dS (lane t of a row its keys t, t + LANES, ..) and accumulates dQ (each
  lane its head dims). It writes dQ, lse and delta.
* `keys`: a thread block takes `ROWS` key rows of one (batch, query head), `LANES` threads
  per key row; query tiles (Q, dO, lse, delta) stream through shared memory; lane t scores
  the queries t, t + LANES, .. of a tile against its key row, forms P and dS, and the lanes
  accumulate dK' and dV' (each its dims). Its serial work per thread is that of the forward.

A row whose every score is -inf gives NaN gradients, as the unfused graph does, or zeros with
`zero_masked_rows` (the where() that zeroes such rows passes no gradient to them). Scores,
probabilities and sums are float32 whatever the operands' dtype; with the forward's
`operand_dtype` (a mixed-precision step) each product's operands are first rounded to it, as
the unfused step's low-precision products read them.

`attention_backward_kernels(spec, gpu=False)` are the same TIR with serial loops and global
scratch: what the CPU tests check, statement for statement the GPU kernels.
"""

# Every block binds all the loops around it, used or not in its statement.
# ruff: noqa: RUF059

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script import tirx as T

from .attention_kernel import (
    _BIASES,
    FUSED_ATTENTION_ATTR,
    LANES,
    ROWS,
    TILE_KV,
    AttentionSpec,
    _init_phase,
    _row_sum_phase,
    _score_phase,
    _softmax_phase,
    _tile_loader,
    _Tiling,
    bias_buffers,
    key_tiles_end,
    only_params,
    query_tiles_start,
)

TILE_Q = 32  # query rows per shared-memory tile of the keys kernel
# The serial iterations a thread of the keys kernel may run (the real-size schedule test's
# bound): the forward kernel's figure at 512 keys and a head dim of 64.
MAX_THREAD_ITERATIONS = 4096
_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class BackwardSpec:
    """A fused attention's backward: the forward's spec and the gradient scales (dQ =
    dq_scale * dS K, dK' = dk_scale * dS^T Q). With the forward's `operand_dtype` (mixed
    precision) every product operand is rounded to it as the unfused backward's products
    read them: Q, K, V, dO, P (for dV') and dS (for dQ and dK'); softmax's gradient stays
    float32."""

    forward: AttentionSpec
    dq_scale: float
    dk_scale: float
    # the rows kernel reads each row's log-sum-exp from the forward kernel (its `with_lse`
    # output) instead of walking the keys once more to compute it
    lse_from_forward: bool = False

    def __post_init__(self):
        if self.forward.qk_dtype is not None:
            raise ValueError("no fused backward for Q and K of another dtype than V's "
                             "(an autocast inference's attention)")


def _dims(dim: int) -> tuple[int, int]:
    """(width, chunks) of the dims of a lane: dim c * width * LANES + lane * width + e."""
    width = 4 if dim % (4 * LANES) == 0 else 1
    return width, -(-dim // (width * LANES))


def _bias_sum(spec: AttentionSpec, biases, b, h, i, j):
    total = T.float32(0)
    for n, (bb, bh, bq, bk) in enumerate(spec.bias_shapes):
        total = total + T.Cast("float32", biases[n][b if bb > 1 else 0, h if bh > 1 else 0,
                                                     i if bq > 1 else 0, j if bk > 1 else 0])
    return total


def _prob(spec: AttentionSpec, s, lse):
    """P from a score and its row's log-sum-exp (0 for a fully masked row when zeroed)."""
    if spec.zero_masked_rows:
        return T.if_then_else(lse == T.float32(_NEG_INF), T.float32(0), T.exp(s - lse))
    return T.exp(s - lse)


class _Rows:
    """The constants of the rows kernel, and the forward kernel's statements it reuses."""

    def __init__(self, bs: BackwardSpec, gpu: bool):
        spec = self.spec = bs.forward
        t = self.t = _Tiling(spec, gpu)
        self.H, self.SQ, self.D, self.DV = spec.heads, spec.q_len, spec.head_dim, spec.value_dim
        self.threads, self.per_lane = t.threads, t.per_lane
        self.p_stride, self.k_stride = t.p_stride, t.k_stride
        self.width, self.chunks = _dims(spec.head_dim)
        self.dq_scale = float(bs.dq_scale)
        self.load_k = _tile_loader(t, spec.head_dim, t.kvec, t.k_stride, "k_load")
        self.load_v = _tile_loader(t, spec.value_dim, t.vvec, spec.value_dim, "v_load")
        self.score, self.softmax = _score_phase(t), _softmax_phase(t)
        self.local, self.shared = t.local, t.shared
        self.lse_given = bs.lse_from_forward


def _rows_init(c: _Rows):
    """The forward's init (the query row, dQ's accumulators, m and l), then dO's row and
    delta = dO . O."""
    t, H, SQ, DV, threads = c.t, c.H, c.SQ, c.DV, c.threads
    forward_init = _init_phase(t, c.chunks * c.width)

    @T.macro
    def init(q, o, do, q_loc, do_loc, delta, dq_acc, m, lsum, lbh, lqt):
        forward_init(q, q_loc, dq_acc, m, lsum, lbh, lqt)
        for tid in t.thread(threads):
            with T.sblock("delta_init"):
                vbh, vqt, vt = T.axis.remap("SSS", [lbh, lqt, tid])
                delta[vt] = T.float32(0)
            for d in t.unrolled(DV):
                with T.sblock("do_load"):
                    vbh, vqt, vt, vd = T.axis.remap("SSSS", [lbh, lqt, tid, d])
                    do_loc[vt, vd] = T.if_then_else(
                        vqt * ROWS + vt // LANES < SQ,
                        t.operand(do[vbh // H, vbh % H, vqt * ROWS + vt // LANES, vd]),
                        T.float32(0))
                with T.sblock("delta"):
                    vbh, vqt, vt, vd = T.axis.remap("SSSR", [lbh, lqt, tid, d])
                    delta[vt] = delta[vt] + do_loc[vt, vd] * T.if_then_else(
                        vqt * ROWS + vt // LANES < SQ,
                        T.Cast("float32", o[vbh // H, vbh % H,
                                            T.min(vqt * ROWS + vt // LANES, SQ - 1), vd]),
                        T.float32(0))

    return init


def _rows_first_pass(c: _Rows):
    """Each row's log-sum-exp: read from the forward kernel's output, or computed by a first
    walk over the key tiles (the forward's online softmax, its statements reused)."""
    t, H, SQ, threads, load_k, score, softmax = c.t, c.H, c.SQ, c.threads, c.load_k, c.score, \
        c.softmax
    row_sum = _row_sum_phase(t)
    if c.lse_given:
        @T.macro
        def given(k, biases, lse_in, q_loc, k_sh, s, kreg, m, m_new, alpha, lsum, lse, part,
                  p_sh, lbh, lqt):
            for tid in t.thread(threads):
                with T.sblock("lse_load"):
                    vbh, vqt, vt = T.axis.remap("SSS", [lbh, lqt, tid])
                    row: T.let[T.int32] = vqt * ROWS + vt // LANES
                    lse[vt] = T.if_then_else(row < SQ, lse_in[vbh // H, vbh % H,
                                                              T.min(row, SQ - 1)],
                                             T.float32(0))

        return given

    @T.macro
    def computed(k, biases, lse_in, q_loc, k_sh, s, kreg, m, m_new, alpha, lsum, lse, part,
                 p_sh, lbh, lqt):
        for kt in T.serial(key_tiles_end(c.spec, lqt, ROWS, TILE_KV, t.kv_tiles)):
            for tid in t.thread(threads):
                load_k(k, k_sh, lbh, lqt, kt, tid)
            score(biases, q_loc, k_sh, s, kreg, m_new, part, lbh, lqt, kt)
            softmax(s, m, m_new, alpha, lsum, part, p_sh, lbh, lqt, kt)
        row_sum(lsum, lse, part, lbh, lqt)
        for tid in t.thread(threads):
            with T.sblock("lse"):
                vbh, vqt, vt = T.axis.remap("SSS", [lbh, lqt, tid])
                lse[vt] = m[vt] + T.log(lse[vt])

    return computed


def _rows_grad_scores(c: _Rows):
    spec, t, DV, threads, per_lane, p_stride = c.spec, c.t, c.DV, c.threads, c.per_lane, c.p_stride

    @T.macro
    def grad_scores(s, do_loc, v_sh, lse, delta, ds_sh, lbh, lqt, kt):
        for tid in t.thread(threads):
            for jj in t.unrolled(per_lane):
                with T.sblock("dp_init"):
                    vbh, vqt, vkt, vt, vj = T.axis.remap("SSRSS", [lbh, lqt, kt, tid, jj])
                    ds_sh[vt // LANES * p_stride + vj * LANES + vt % LANES] = T.float32(0)
                for d in t.unrolled(DV):
                    with T.sblock("dp"):
                        vbh, vqt, vkt, vt, vj, vd = T.axis.remap(
                            "SSRSSR", [lbh, lqt, kt, tid, jj, d])
                        ds_sh[vt // LANES * p_stride + vj * LANES + vt % LANES] = \
                            ds_sh[vt // LANES * p_stride + vj * LANES + vt % LANES] \
                            + do_loc[vt, vd] * v_sh[(vj * LANES + vt % LANES) * DV + vd]
                with T.sblock("ds"):
                    vbh, vqt, vkt, vt, vj = T.axis.remap("SSRSS", [lbh, lqt, kt, tid, jj])
                    ds_sh[vt // LANES * p_stride + vj * LANES + vt % LANES] = t.operand(
                        _prob(spec, s[vt, vj], lse[vt]) * (
                            ds_sh[vt // LANES * p_stride + vj * LANES + vt % LANES]
                            - delta[vt]))

    return grad_scores


def _lane_accumulate(t: _Tiling, tile: int, dim: int, stride: int, name: str):
    """acc[lane's dims] += sum over the tile's rows j of coef[row, j] * src[j, dims]: each lane
    its dims of `dim` (`_dims`), coef a row per thread's row (stride TILE + 1), src `stride`
    floats per row."""
    threads, p_stride = t.threads, tile + 1
    width, chunks = _dims(dim)

    @T.macro
    def accumulate(src_sh, coef_sh, acc, lbh, lxt, it):
        for tid in t.thread(threads):
            for j in T.serial(tile):
                for c in t.unrolled(chunks):
                    for e in t.unrolled(width):
                        with T.sblock(name):
                            vbh, vxt, vit, vt, vj, vc, ve = T.axis.remap(
                                "SSRSRSS", [lbh, lxt, it, tid, j, c, e])
                            d: T.let[T.int32] = vc * width * LANES + vt % LANES * width + ve
                            acc[vt, vc * width + ve] = acc[vt, vc * width + ve] \
                                + coef_sh[vt // LANES * p_stride + vj] \
                                * src_sh[vj * stride + T.min(d, dim - 1)]

    return accumulate


def _rows_store(c: _Rows):
    spec, t, H, SQ, D, threads, width = c.spec, c.t, c.H, c.SQ, c.D, c.threads, c.width
    chunks, dq_scale = c.chunks, c.dq_scale

    @T.macro
    def store(dq, lse_out, delta_out, dq_acc, lse, delta, lbh, lqt):
        for tid in t.thread(threads):
            for c in t.unrolled(chunks):
                for e in t.unrolled(width):
                    with T.sblock("dq_store"):
                        vbh, vqt, vt, vc, ve = T.axis.remap("SSSSS", [lbh, lqt, tid, c, e])
                        row: T.let[T.int32] = vqt * ROWS + vt // LANES
                        dim: T.let[T.int32] = vc * width * LANES + vt % LANES * width + ve
                        if row < SQ and dim < D:
                            dq[vbh // H, vbh % H, row, dim] = T.Cast(
                                spec.dtype, dq_acc[vt, vc * width + ve] * dq_scale)
            with T.sblock("stats_store"):
                vbh, vqt, vt = T.axis.remap("SSS", [lbh, lqt, tid])
                row: T.let[T.int32] = vqt * ROWS + vt // LANES
                if row < SQ and vt % LANES == 0:
                    lse_out[vbh // H, vbh % H, row] = lse[vt]
                    delta_out[vbh // H, vbh % H, row] = delta[vt]

    return store


def _rows_body(c: _Rows):
    init = _rows_init(c)
    grad_scores = _rows_grad_scores(c)
    accumulate = _lane_accumulate(c.t, TILE_KV, c.D, c.k_stride, "dq")
    store = _rows_store(c)
    spec, t, H, D, DV, threads, per_lane = c.spec, c.t, c.H, c.D, c.DV, c.threads, c.per_lane
    p_stride, k_stride, width, chunks, load_k = c.p_stride, c.k_stride, c.width, c.chunks, c.load_k
    load_v, score, local, shared = c.load_v, c.score, c.local, c.shared
    first_pass = _rows_first_pass(c)

    @T.macro
    def body(q, k, v, biases, o, do, lse_in, dq, lse_out, delta_out):
        for lbh in t.grid(spec.batch * H, "y"):
            for lqt in t.grid(t.q_tiles, "x"):
                with T.sblock("tile"):
                    q_loc = T.sblock_alloc_buffer((threads, D), "float32", scope=local)
                    do_loc = T.sblock_alloc_buffer((threads, DV), "float32", scope=local)
                    dq_acc = T.sblock_alloc_buffer((threads, chunks * width), "float32",
                                                   scope=local)
                    s = T.sblock_alloc_buffer((threads, per_lane), "float32", scope=local)
                    kreg = T.sblock_alloc_buffer((threads, t.kvec), "float32", scope=local)
                    m = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    m_new = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    alpha = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    lsum = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    lse = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    delta = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    k_sh = T.sblock_alloc_buffer((TILE_KV * k_stride,), "float32",
                                                 scope=shared)
                    v_sh = T.sblock_alloc_buffer((TILE_KV * DV,), "float32", scope=shared)
                    p_sh = T.sblock_alloc_buffer((ROWS * p_stride,), "float32", scope=shared)
                    part = T.sblock_alloc_buffer((ROWS, LANES), "float32", scope=shared)
                    init(q, o, do, q_loc, do_loc, delta, dq_acc, m, lsum, lbh, lqt)
                    first_pass(k, biases, lse_in, q_loc, k_sh, s, kreg, m, m_new, alpha, lsum,
                               lse, part, p_sh, lbh, lqt)
                    for kt2 in T.serial(key_tiles_end(spec, lqt, ROWS, TILE_KV, t.kv_tiles)):
                        for tid in t.thread(threads):
                            load_k(k, k_sh, lbh, lqt, kt2, tid)
                            load_v(v, v_sh, lbh, lqt, kt2, tid)
                        score(biases, q_loc, k_sh, s, kreg, m_new, part, lbh, lqt, kt2)
                        grad_scores(s, do_loc, v_sh, lse, delta, p_sh, lbh, lqt, kt2)
                        accumulate(k_sh, p_sh, dq_acc, lbh, lqt, kt2)
                    store(dq, lse_out, delta_out, dq_acc, lse, delta, lbh, lqt)

    return body


def _rows_kernel(bs: BackwardSpec, gpu: bool):
    return _rows_body(_Rows(bs, gpu))


def key_splits(spec: AttentionSpec) -> tuple[int, int]:
    """(splits, query tiles per split) of the keys kernel: the query walk is split over thread
    blocks (each writing partial dK' and dV', summed after) where one walk would take a
    thread more than `MAX_THREAD_ITERATIONS` iterations (many queries, few keys: a
    SegFormer's reduced keys)."""
    q_tiles = -(-spec.q_len // TILE_Q)
    kw, kc = _dims(spec.head_dim)
    vw, vc = _dims(spec.value_dim)
    per_tile = max(TILE_Q // LANES * max(spec.head_dim, spec.value_dim),
                   TILE_Q * max(kw * kc, vw * vc))
    per_split = max(1, min(q_tiles, MAX_THREAD_ITERATIONS // per_tile))
    splits = -(-q_tiles // per_split)
    return splits, -(-q_tiles // splits)


class _Keys:
    """The constants of the keys kernel."""

    def __init__(self, bs: BackwardSpec, gpu: bool):
        spec = self.spec = bs.forward
        t = self.t = _Tiling(spec, gpu)
        D, DV = self.D, self.DV = spec.head_dim, spec.value_dim
        self.H, self.SQ, self.SK = spec.heads, spec.q_len, spec.kv_len
        self.group = spec.heads // spec.kv_heads
        self.threads = t.threads
        self.per_lane = TILE_Q // LANES
        self.q_stride, self.do_stride, self.p_stride = D + 1, DV + 1, TILE_Q + 1
        self.k_tiles = -(-spec.kv_len // ROWS)
        self.splits, self.per_split = key_splits(spec)
        self.kw, self.kc = _dims(D)
        self.vw, self.vc_ = _dims(DV)
        self.scale, self.dk_scale = float(spec.scale), float(bs.dk_scale)
        self.local, self.shared = t.local, t.shared


def _keys_init(c: _Keys):
    t, H, SK, D, DV, group, threads = c.t, c.H, c.SK, c.D, c.DV, c.group, c.threads
    k_tiles, kw, kc, vw, vc_ = c.k_tiles, c.kw, c.kc, c.vw, c.vc_

    @T.macro
    def init(k, v, k_loc, v_loc, dk_acc, dv_acc, lbh, lkt):
        for tid in t.thread(threads):
            for d in t.unrolled(D):
                with T.sblock("k_row"):
                    vbh, vkt, vt, vd = T.axis.remap("SSSS", [lbh, lkt, tid, d])
                    k_loc[vt, vd] = T.if_then_else(
                        vkt % k_tiles * ROWS + vt // LANES < SK,
                        t.operand(k[vbh // H, vbh % H // group,
                                            vkt % k_tiles * ROWS + vt // LANES, vd]), T.float32(0))
            for d in t.unrolled(DV):
                with T.sblock("v_row"):
                    vbh, vkt, vt, vd = T.axis.remap("SSSS", [lbh, lkt, tid, d])
                    v_loc[vt, vd] = T.if_then_else(
                        vkt % k_tiles * ROWS + vt // LANES < SK,
                        t.operand(v[vbh // H, vbh % H // group,
                                            vkt % k_tiles * ROWS + vt // LANES, vd]), T.float32(0))
            for d in t.unrolled(kc * kw):
                with T.sblock("dk_init"):
                    vbh, vkt, vt, vd = T.axis.remap("SSSS", [lbh, lkt, tid, d])
                    dk_acc[vt, vd] = T.float32(0)
            for d in t.unrolled(vc_ * vw):
                with T.sblock("dv_init"):
                    vbh, vkt, vt, vd = T.axis.remap("SSSS", [lbh, lkt, tid, d])
                    dv_acc[vt, vd] = T.float32(0)

    return init


def _query_tile_loader(c: _Keys, dim: int, stride: int, name: str):
    """A macro loading the query tile (of this block's split) of a [batch, heads, q_len, dim]
    tensor into flat shared rows of `stride` floats, zeros past q_len."""
    H, SQ, threads = c.H, c.SQ, c.threads
    k_tiles, per_split = c.k_tiles, c.per_split
    loads = -(-TILE_Q * dim // threads)

    @T.macro
    def load(src, dst, lbh, lkt, qt, tid):
        for r in T.serial(loads):
            with T.sblock(name):
                vbh, vkt, vqt, vt, vr = T.axis.remap("SSRSS", [lbh, lkt, qt, tid, r])
                flat: T.let[T.int32] = vr * threads + vt
                row: T.let[T.int32] = (vkt // k_tiles * per_split + vqt) * TILE_Q + flat // dim
                if flat < TILE_Q * dim:
                    dst[flat // dim * stride + flat % dim] = T.if_then_else(
                        row < SQ, c.t.operand(src[vbh // H, vbh % H, row, flat % dim]),
                        T.float32(0))

    return load


def _keys_load(c: _Keys):
    t, H, SQ, threads, k_tiles, per_split = c.t, c.H, c.SQ, c.threads, c.k_tiles, c.per_split
    load_q = _query_tile_loader(c, c.D, c.q_stride, "q_tile")
    load_do = _query_tile_loader(c, c.DV, c.do_stride, "do_tile")

    @T.macro
    def load(q, do, lse, delta, q_sh, do_sh, lse_sh, delta_sh, lbh, lkt, qt):
        for tid in t.thread(threads):
            load_q(q, q_sh, lbh, lkt, qt, tid)
            load_do(do, do_sh, lbh, lkt, qt, tid)
            with T.sblock("stats_tile"):
                vbh, vkt, vqt, vt = T.axis.remap("SSRS", [lbh, lkt, qt, tid])
                row: T.let[T.int32] = (vkt // k_tiles * per_split + vqt) * TILE_Q + vt
                if vt < TILE_Q:
                    lse_sh[vt] = T.if_then_else(
                        row < SQ, lse[vbh // H, vbh % H, T.min(row, SQ - 1)], T.float32(0))
                    delta_sh[vt] = T.if_then_else(
                        row < SQ, delta[vbh // H, vbh % H, T.min(row, SQ - 1)], T.float32(0))

    return load


def _keys_grad_scores(c: _Keys):
    spec, t, H, SQ, SK, D, DV, threads = c.spec, c.t, c.H, c.SQ, c.SK, c.D, c.DV, c.threads
    per_lane, q_stride, do_stride, p_stride = c.per_lane, c.q_stride, c.do_stride, c.p_stride
    k_tiles, per_split, scale = c.k_tiles, c.per_split, c.scale

    @T.macro
    def grad_scores(biases, k_loc, v_loc, q_sh, do_sh, lse_sh, delta_sh, s, dp, p_sh, ds_sh,
                    lbh, lkt, qt):
        for tid in t.thread(threads):
            for ii in t.unrolled(per_lane):
                with T.sblock("s_init"):
                    vbh, vkt, vqt, vt, vi = T.axis.remap("SSRSS", [lbh, lkt, qt, tid, ii])
                    s[vt, vi] = T.float32(0)
                    dp[vt, vi] = T.float32(0)
                for d in t.unrolled(D):
                    with T.sblock("s"):
                        vbh, vkt, vqt, vt, vi, vd = T.axis.remap(
                            "SSRSSR", [lbh, lkt, qt, tid, ii, d])
                        s[vt, vi] = s[vt, vi] \
                            + q_sh[(vi * LANES + vt % LANES) * q_stride + vd] * k_loc[vt, vd]
                for d in t.unrolled(DV):
                    with T.sblock("dp"):
                        vbh, vkt, vqt, vt, vi, vd = T.axis.remap(
                            "SSRSSR", [lbh, lkt, qt, tid, ii, d])
                        dp[vt, vi] = dp[vt, vi] \
                            + do_sh[(vi * LANES + vt % LANES) * do_stride + vd] * v_loc[vt, vd]
                with T.sblock("p_ds"):
                    vbh, vkt, vqt, vt, vi = T.axis.remap("SSRSS", [lbh, lkt, qt, tid, ii])
                    qi: T.let[T.int32] = vi * LANES + vt % LANES
                    row: T.let[T.int32] = (vkt // k_tiles * per_split + vqt) * TILE_Q + qi
                    key: T.let[T.int32] = vkt % k_tiles * ROWS + vt // LANES
                    p: T.let[T.float32] = _prob(spec, s[vt, vi] * scale + _bias_sum(
                        spec, biases, vbh // H, vbh % H, T.min(row, SQ - 1),
                        T.min(key, SK - 1)), lse_sh[qi])
                    # Rounded inside the select: a row or key known to be out of range
                    # folds to a constant 0, which CUDA's reinterpret cannot take.
                    p_sh[vt // LANES * p_stride + qi] = T.if_then_else(
                        row < SQ and key < SK, t.operand(p), T.float32(0))
                    ds_sh[vt // LANES * p_stride + qi] = T.if_then_else(
                        row < SQ and key < SK, t.operand(p * (dp[vt, vi] - delta_sh[qi])),
                        T.float32(0))

    return grad_scores


def _keys_store(c: _Keys):
    """Each lane writes its dims of dK' (scaled by dk_scale) and dV' for its key row."""
    spec, t, H, SK, threads, k_tiles = c.spec, c.t, c.H, c.SK, c.threads, c.k_tiles

    def one(width: int, chunks: int, dim: int, scale: float, name: str):
        @T.macro
        def store(out, acc, lbh, lkt, tid):
            for c in t.unrolled(chunks):
                for e in t.unrolled(width):
                    with T.sblock(name):
                        vbh, vkt, vt, vc, ve = T.axis.remap("SSSSS", [lbh, lkt, tid, c, e])
                        key: T.let[T.int32] = vkt % k_tiles * ROWS + vt // LANES
                        d: T.let[T.int32] = vc * width * LANES + vt % LANES * width + ve
                        if key < SK and d < dim:
                            if scale == 1.0:
                                out[vkt // k_tiles, vbh // H, vbh % H, key, d] = T.Cast(
                                    spec.dtype, acc[vt, vc * width + ve])
                            else:
                                out[vkt // k_tiles, vbh // H, vbh % H, key, d] = T.Cast(
                                    spec.dtype, acc[vt, vc * width + ve] * scale)

        return store

    store_dk = one(c.kw, c.kc, c.D, c.dk_scale, "dk_store")
    store_dv = one(c.vw, c.vc_, c.DV, 1.0, "dv_store")

    @T.macro
    def store(dk, dv, dk_acc, dv_acc, lbh, lkt):
        for tid in t.thread(threads):
            store_dk(dk, dk_acc, lbh, lkt, tid)
            store_dv(dv, dv_acc, lbh, lkt, tid)

    return store


def _split_start(c: _Keys, lkt):
    """The first of the query tiles of block `lkt`'s split that sees a key of its key tile
    (0 without a causal offset)."""
    if c.spec.causal_offset is None:
        return 0
    first = query_tiles_start(c.spec, lkt % c.k_tiles, ROWS, TILE_Q) - \
        lkt // c.k_tiles * c.per_split
    return T.min(c.per_split, T.max(0, first))


def _keys_body(c: _Keys):
    init = _keys_init(c)
    load = _keys_load(c)
    grad_scores = _keys_grad_scores(c)
    accumulate_dk = _lane_accumulate(c.t, TILE_Q, c.D, c.q_stride, "dk")
    accumulate_dv = _lane_accumulate(c.t, TILE_Q, c.DV, c.do_stride, "dv")
    store = _keys_store(c)
    spec, t, H, D, DV, threads, per_lane = c.spec, c.t, c.H, c.D, c.DV, c.threads, c.per_lane
    q_stride, do_stride, p_stride, k_tiles = c.q_stride, c.do_stride, c.p_stride, c.k_tiles
    splits, per_split, kw, kc, vw, vc_ = c.splits, c.per_split, c.kw, c.kc, c.vw, c.vc_
    local, shared = c.local, c.shared

    @T.macro
    def body(q, k, v, biases, do, lse, delta, dk, dv):
        for lbh in t.grid(spec.batch * H, "y"):
            for lkt in t.grid(k_tiles * splits, "x"):
                with T.sblock("tile"):
                    k_loc = T.sblock_alloc_buffer((threads, D), "float32", scope=local)
                    v_loc = T.sblock_alloc_buffer((threads, DV), "float32", scope=local)
                    dk_acc = T.sblock_alloc_buffer((threads, kc * kw), "float32", scope=local)
                    dv_acc = T.sblock_alloc_buffer((threads, vc_ * vw), "float32",
                                                   scope=local)
                    s = T.sblock_alloc_buffer((threads, per_lane), "float32", scope=local)
                    dp = T.sblock_alloc_buffer((threads, per_lane), "float32", scope=local)
                    q_sh = T.sblock_alloc_buffer((TILE_Q * q_stride,), "float32",
                                                 scope=shared)
                    do_sh = T.sblock_alloc_buffer((TILE_Q * do_stride,), "float32",
                                                  scope=shared)
                    lse_sh = T.sblock_alloc_buffer((TILE_Q,), "float32", scope=shared)
                    delta_sh = T.sblock_alloc_buffer((TILE_Q,), "float32", scope=shared)
                    p_sh = T.sblock_alloc_buffer((ROWS * p_stride,), "float32", scope=shared)
                    ds_sh = T.sblock_alloc_buffer((ROWS * p_stride,), "float32",
                                                  scope=shared)
                    init(k, v, k_loc, v_loc, dk_acc, dv_acc, lbh, lkt)
                    for qt in T.serial(_split_start(c, lkt), per_split):
                        load(q, do, lse, delta, q_sh, do_sh, lse_sh, delta_sh, lbh, lkt, qt)
                        grad_scores(biases, k_loc, v_loc, q_sh, do_sh, lse_sh, delta_sh, s,
                                    dp, p_sh, ds_sh, lbh, lkt, qt)
                        accumulate_dk(q_sh, ds_sh, dk_acc, lbh, lkt, qt)
                        accumulate_dv(do_sh, p_sh, dv_acc, lbh, lkt, qt)
                    store(dk, dv, dk_acc, dv_acc, lbh, lkt)

    return body


def _keys_kernel(bs: BackwardSpec, gpu: bool):
    return _keys_body(_Keys(bs, gpu))


def _finish(func: tirx.PrimFunc, gpu: bool) -> tirx.PrimFunc:
    func = func.with_attr(FUSED_ATTENTION_ATTR, True)
    return func.with_attr("tirx.is_scheduled", True) if gpu else func


def _rows_func(bs: BackwardSpec, gpu: bool) -> tirx.PrimFunc:
    spec = bs.forward
    B, H, HK = spec.batch, spec.heads, spec.kv_heads
    SQ, SK, D, DV, dtype = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim, spec.dtype
    rows = _rows_kernel(bs, gpu)
    s0, d0, s1, d1 = bias_buffers(spec)

    @T.prim_func(private=True, s_tir=True)
    def attention_rows(q: T.Buffer((B, H, SQ, D), dtype), k: T.Buffer((B, HK, SK, D), dtype),
                       v: T.Buffer((B, HK, SK, DV), dtype), bias0: T.Buffer(s0, d0),
                       bias1: T.Buffer(s1, d1), o: T.Buffer((B, H, SQ, DV), dtype),
                       do: T.Buffer((B, H, SQ, DV), dtype),
                       lse_in: T.Buffer((B, H, SQ), "float32"),
                       dq: T.Buffer((B, H, SQ, D), dtype),
                       lse: T.Buffer((B, H, SQ), "float32"),
                       delta: T.Buffer((B, H, SQ), "float32")):
        T.func_attr({"tirx.noalias": True})
        rows(q, k, v, (bias0, bias1), o, do, lse_in, dq, lse, delta)

    return _finish(only_params(attention_rows, [
        "q", "k", "v", *_BIASES[:len(spec.bias_shapes)], "o", "do",
        *(["lse_in"] if bs.lse_from_forward else []), "dq", "lse", "delta"]), gpu)


def _keys_func(bs: BackwardSpec, gpu: bool) -> tirx.PrimFunc:
    spec = bs.forward
    B, H, HK = spec.batch, spec.heads, spec.kv_heads
    SQ, SK, D, DV, dtype = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim, spec.dtype
    keys = _keys_kernel(bs, gpu)
    NS = key_splits(spec)[0]
    s0, d0, s1, d1 = bias_buffers(spec)

    @T.prim_func(private=True, s_tir=True)
    def attention_keys(q: T.Buffer((B, H, SQ, D), dtype), k: T.Buffer((B, HK, SK, D), dtype),
                       v: T.Buffer((B, HK, SK, DV), dtype), bias0: T.Buffer(s0, d0),
                       bias1: T.Buffer(s1, d1), do: T.Buffer((B, H, SQ, DV), dtype),
                       lse: T.Buffer((B, H, SQ), "float32"),
                       delta: T.Buffer((B, H, SQ), "float32"),
                       dk: T.Buffer((NS, B, H, SK, D), dtype),
                       dv: T.Buffer((NS, B, H, SK, DV), dtype)):
        T.func_attr({"tirx.noalias": True})
        keys(q, k, v, (bias0, bias1), do, lse, delta, dk, dv)

    return _finish(only_params(attention_keys, [
        "q", "k", "v", *_BIASES[:len(spec.bias_shapes)], "do", "lse", "delta", "dk", "dv"]), gpu)


def attention_backward_kernels(bs: BackwardSpec, gpu: bool = False) \
        -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """(rows, keys): rows(q, k, v, biases.., o, do[, lse from the forward]) -> (dq, lse,
    delta) and keys(q, k, v, biases.., do, lse, delta) -> (dk', dv'), the primed gradients
    per query head in `key_splits(spec)[0]` parts to be summed ([splits, batch, heads, kv_len,
    dim]). With `gpu`, bound to CUDA blocks and threads with shared and local scratch (marked
    scheduled); without, serial (any target)."""
    return _rows_func(bs, gpu), _keys_func(bs, gpu)
