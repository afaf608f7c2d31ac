"""Fused scaled dot-product attention as one TIR kernel (FlashAttention-2's online softmax).

    O[b, h, i, :] = sum_j softmax_j(scale * Q[b, h, i, :] . K[b, h // g, j, :] + bias[b, h, i, j])
                    * V[b, h // g, j, :]

with g = heads / kv_heads (grouped-query attention), `bias` the sum of up to two additive
biases, each broadcast over [batch, heads, q_len, kv_len] (a causal or padding mask as the
frontends build it, 0 or a large negative / -inf; T5's position bias). The score matrix
never reaches global memory: keys and values stream through shared memory in tiles of
`TILE_KV` keys while each query row keeps its running maximum m, its running sum l and its
output accumulator, rescaled by exp(m_old - m_new) whenever m grows.

Work split: a thread block takes `ROWS` query rows of one (batch, head); each row is shared by
`LANES` threads. Lane t of a row scores the keys t, t + LANES, .. of a tile (a full dot product
over the head dim from its own copy of the query row, reading keys from shared memory four
floats at a time); the lanes meet in shared memory for the tile's row maximum and exchange the
probabilities; then lane t accumulates its share of the value dims (four adjacent dims every
4 * LANES, so that the lanes of a row read one shared-memory row without bank conflicts). Each
lane keeps its own partial sum of the probabilities (all lanes rescale by the same maxima);
the partial sums meet once, at the end. Like FlashAttention, each thread walks the whole key
range: its serial work grows with kv_len (4096 loop iterations per thread at 512 keys and a
head dim of 64).

Semantics at the edges, as the unfused graph computes them: a row whose every score is -inf
gives NaN (softmax of all -inf), or 0 with `zero_masked_rows` (PyTorch's scaled_dot_product_
attention, which zeroes such rows). Scores, softmax and accumulation are float32 whatever the
operands' dtype; the output is cast once. With `with_lse` (a training step's forward) the
kernel also writes each row's log-sum-exp m + log(l) (-inf for a fully masked row), which the
backward's rows kernel reads instead of computing it again.

`attention_kernel(spec, gpu=False)` is the same TIR with its loops serial and its scratch in
global memory: the kernel whose numerics the CPU tests check, statement for statement the GPU
kernel.
"""

# Every block binds all the loops around it (its FLOPs count over the whole grid), used or
# not in its statement.
# ruff: noqa: RUF059

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script import tirx as T

ROWS = 32  # query rows per thread block
LANES = 8  # threads per query row
TILE_KV = 32  # keys per shared-memory tile
VEC = 4  # floats per shared-memory load
_NEG_INF = float("-inf")
# Marks the kernel (graph readers and reports tell it from generated code by it).
FUSED_ATTENTION_ATTR = "tvm_ext.fused_attention"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The shapes and options of one fused attention call (static shapes)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: str  # of Q, K, V and the output (of Q and K: see `qk_dtype`)
    scale: float
    # additive biases (at most two): 4-D, each axis 1 (broadcast) or full; their dtypes
    bias_shapes: tuple[tuple[int, int, int, int], ...] = ()
    bias_dtypes: tuple[str, ...] = ()
    zero_masked_rows: bool = False
    # the low dtype the unfused products read their operands in (mixed precision): Q, K, V and
    # the probabilities are rounded to it, the products accumulate in float32
    operand_dtype: str | None = None
    # Every key j > i + causal_offset of query row i is masked (-inf) by a constant bias, in
    # every batch and head, and every row keeps an unmasked key (a causal mask: 0; aligned to
    # the last key: kv_len - q_len): the kernels skip the tiles past that line
    # (`key_tiles_end`, `query_tiles_start`).
    causal_offset: int | None = None
    # the dtype of Q and K where it is not `dtype` (autocast: Llama's rotary embedding leaves
    # them float32 beside a bfloat16 V; the products read them rounded to `operand_dtype`)
    qk_dtype: str | None = None

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} query heads are not a multiple of "
                             f"{self.kv_heads} key/value heads")
        full = (self.batch, self.heads, self.q_len, self.kv_len)
        if len(self.bias_shapes) > 2 or len(self.bias_dtypes) != len(self.bias_shapes):
            raise ValueError(f"{len(self.bias_shapes)} biases with {len(self.bias_dtypes)} "
                             f"dtypes: at most two, one dtype each")
        for shape in self.bias_shapes:
            if len(shape) != 4 or any(
                    s not in (1, f) for s, f in zip(shape, full, strict=True)):
                raise ValueError(f"bias of shape {shape} does not broadcast to {full}")
        if self.qk_dtype is not None and self.operand_dtype != self.dtype:
            raise ValueError(f"Q and K in {self.qk_dtype} beside V in {self.dtype}: the "
                             f"products must read them rounded to {self.dtype}")
        if self.causal_offset is not None and not self.bias_shapes:
            raise ValueError("a causal offset without a bias: nothing masks the keys past it")

    @property
    def flops(self) -> int:
        """Multiply-adds of the two products, counted as two operations each."""
        rows = self.batch * self.heads * self.q_len
        return 2 * rows * self.kv_len * (self.head_dim + self.value_dim)


class _Tiling:
    """The constants of one kernel, and its loop kinds and scratch scopes (GPU or serial)."""

    def __init__(self, spec: AttentionSpec, gpu: bool):
        self.spec, self.gpu = spec, gpu
        self.threads = ROWS * LANES
        self.q_tiles = -(-spec.q_len // ROWS)
        self.kv_tiles = -(-spec.kv_len // TILE_KV)
        self.per_lane = TILE_KV // LANES  # keys a lane scores per tile
        self.kvec = VEC if spec.head_dim % VEC == 0 else 1
        self.vvec = VEC if spec.value_dim % VEC == 0 else 1
        # Shared rows padded (flat buffers: compaction keeps their strides): the lanes of a
        # row read adjacent keys' rows, and the rows of a warp their probabilities, from
        # distinct banks.
        self.k_stride = spec.head_dim + self.kvec
        self.p_stride = TILE_KV + 1
        # The value dims of a lane: dim c * width * LANES + lane * width + e of chunk c,
        # element e (adjacent lanes read adjacent shared words).
        self.width = VEC if spec.value_dim % (VEC * LANES) == 0 else 1
        self.chunks = -(-spec.value_dim // (self.width * LANES))
        self.shared = "shared" if gpu else "global"
        self.local = "local" if gpu else "global"

    def grid(self, n: int, axis: str):
        return T.thread_binding(n, thread=f"blockIdx.{axis}") if self.gpu else T.serial(n)

    def thread(self, n: int):
        return T.thread_binding(n, thread="threadIdx.x") if self.gpu else T.serial(n)

    def unrolled(self, n: int):
        return T.unroll(n) if self.gpu else T.serial(n)

    def vectorized(self, n: int):
        return T.vectorized(n) if self.gpu and n > 1 else T.serial(n)

    def value_dim(self, lane, c, e):
        return c * self.width * LANES + lane * self.width + e

    def operand(self, x):
        """A product operand in float32, first rounded to `operand_dtype` where set."""
        low = self.spec.operand_dtype
        x = T.Cast("float32", x)
        if low == "bfloat16":
            # Round to nearest even on the bits: targets without bfloat16 arithmetic (LLVM's
            # legalization) cancel a float32 -> bfloat16 -> float32 cast pair.
            bits = T.reinterpret("uint32", x)
            bits = (bits + T.uint32(0x7FFF) + ((bits >> T.uint32(16)) & T.uint32(1))) \
                & T.uint32(0xFFFF0000)
            return T.reinterpret("float32", bits)
        return T.Cast("float32", T.Cast(low, x)) if low else x


_BIASES = ("bias0", "bias1")


def bias_buffers(spec: AttentionSpec):
    """(shape, dtype) of the first and last bias; a one-element stand-in where there is none
    (`only_params` drops the parameters a kernel without them does not read)."""
    shapes, dtypes = spec.bias_shapes, spec.bias_dtypes
    if not shapes:
        return (1, 1, 1, 1), "float32", (1, 1, 1, 1), "float32"
    return shapes[0], dtypes[0], shapes[-1], dtypes[-1]


def key_tiles_end(spec: AttentionSpec, q_tile, q_rows: int, k_rows: int, k_tiles: int):
    """How many tiles of `k_rows` keys the tile of `q_rows` query rows numbered `q_tile`
    walks: all `k_tiles`, or with a `causal_offset` those up to the last key the mask leaves
    any of its rows (an expression of the tile's number). The tiles past it are wholly -inf:
    their probabilities are exp(-inf) = 0, adding nothing to a sum, a maximum or a gradient."""
    if spec.causal_offset is None:
        return k_tiles
    return T.min(k_tiles, (q_tile * q_rows + (q_rows - 1 + spec.causal_offset)) // k_rows + 1)


def query_tiles_start(spec: AttentionSpec, k_tile, k_rows: int, q_rows: int):
    """The first tile of `q_rows` query rows that sees a key of the tile of `k_rows` keys
    numbered `k_tile` (the keys kernel's walk; 0 without a `causal_offset`): the tiles before
    it mask every key of this one."""
    if spec.causal_offset is None:
        return 0
    return T.max(0, T.floordiv(k_tile * k_rows - spec.causal_offset, q_rows))


def only_params(func: tirx.PrimFunc, names: list[str]) -> tirx.PrimFunc:
    """`func` with only the parameters named, in `func`'s order: a kernel is written once with
    every optional buffer (the biases, what a variant also reads or writes) and each variant
    keeps those its body uses."""
    params = [p for p in func.params if p.name in names]
    missing = set(names) - {p.name for p in params}
    if missing:
        raise ValueError(f"no parameters {sorted(missing)} among "
                         f"{[p.name for p in func.params]}")
    return tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)


def _init_phase(t: _Tiling, acc_dims: int | None = None):
    """Each thread's copy of its query row (scaled), zero accumulators (`acc_dims` per thread:
    by default the lane's value dims), m = -inf."""
    H, SQ, D, threads, scale = t.spec.heads, t.spec.q_len, t.spec.head_dim, t.threads, \
        float(t.spec.scale)
    acc_dims = t.chunks * t.width if acc_dims is None else acc_dims

    @T.macro
    def init(q, q_loc, acc, m, lsum, lbh, lqt):
        for tid in t.thread(threads):
            for d in t.unrolled(D):
                with T.sblock("q_load"):
                    vbh, vqt, vt, vd = T.axis.remap("SSSS", [lbh, lqt, tid, d])
                    q_loc[vt, vd] = T.if_then_else(
                        vqt * ROWS + vt // LANES < SQ,
                        t.operand(q[vbh // H, vbh % H, vqt * ROWS + vt // LANES, vd])
                        * scale,
                        T.float32(0))
            for d in t.unrolled(acc_dims):
                with T.sblock("acc_init"):
                    vbh, vqt, vt, vd = T.axis.remap("SSSS", [lbh, lqt, tid, d])
                    acc[vt, vd] = T.float32(0)
            with T.sblock("state_init"):
                vbh, vqt, vt = T.axis.remap("SSS", [lbh, lqt, tid])
                m[vt] = T.float32(_NEG_INF)
                lsum[vt] = T.float32(0)

    return init


def _tile_loader(t: _Tiling, dim: int, vec: int, stride: int, name: str):
    """A macro loading tile kt of keys or values ([.., kv_len, dim]) into flat shared rows of
    `stride` floats (float32), `vec` floats per load, zeros past kv_len."""
    H, SK, threads = t.spec.heads, t.spec.kv_len, t.threads
    group = t.spec.heads // t.spec.kv_heads
    loads = -(-TILE_KV * dim // (threads * vec))  # vector loads per thread

    @T.macro
    def load(src, dst, lbh, lqt, kt, tid):
        for r in T.serial(loads):
            for e in t.vectorized(vec):
                with T.sblock(name):
                    vbh, vqt, vkt, vt, vr, ve = T.axis.remap(
                        "SSRSSS", [lbh, lqt, kt, tid, r, e])
                    flat: T.let[T.int32] = (vr * threads + vt) * vec
                    if flat < TILE_KV * dim:
                        dst[flat // dim * stride + flat % dim + ve] = T.if_then_else(
                            vkt * TILE_KV + flat // dim < SK,
                            t.operand(src[vbh // H, vbh % H // group,
                                          vkt * TILE_KV + flat // dim, flat % dim + ve]),
                            T.float32(0))

    return load


def _load_phase(t: _Tiling):
    """Tile kt of the keys and values into shared memory."""
    load_k = _tile_loader(t, t.spec.head_dim, t.kvec, t.k_stride, "k_load")
    load_v = _tile_loader(t, t.spec.value_dim, t.vvec, t.spec.value_dim, "v_load")

    @T.macro
    def load(k, v, k_sh, v_sh, lbh, lqt, kt):
        for tid in t.thread(t.threads):
            load_k(k, k_sh, lbh, lqt, kt, tid)
            load_v(v, v_sh, lbh, lqt, kt, tid)

    return load


def _score_phase(t: _Tiling):
    """Each lane's scores of its keys of the tile (masked: -inf past kv_len), and its maximum
    shared with the row's other lanes."""
    spec = t.spec
    H, SQ, SK, D = spec.heads, spec.q_len, spec.kv_len, spec.head_dim
    threads, per_lane, kvec, k_stride = t.threads, t.per_lane, t.kvec, t.k_stride
    count = len(spec.bias_shapes)

    def bias_at(biases, n, b, h, i, j):
        bb, bh, bq, bk = spec.bias_shapes[n]
        return T.Cast("float32", biases[n][b if bb > 1 else 0, h if bh > 1 else 0,
                                           i if bq > 1 else 0, j if bk > 1 else 0])

    @T.macro
    def score(biases, q_loc, k_sh, s, kreg, m_new, part, lbh, lqt, kt):
        for tid in t.thread(threads):
            for jj in t.unrolled(per_lane):
                with T.sblock("score_init"):
                    vbh, vqt, vkt, vt, vj = T.axis.remap("SSRSS", [lbh, lqt, kt, tid, jj])
                    s[vt, vj] = T.float32(0)
                for c in t.unrolled(D // kvec):
                    for e in t.vectorized(kvec):
                        with T.sblock("k_reg"):
                            vbh, vqt, vkt, vt, vj, vc, ve = T.axis.remap(
                                "SSRSSRS", [lbh, lqt, kt, tid, jj, c, e])
                            kreg[vt, ve] = k_sh[(vj * LANES + vt % LANES) * k_stride
                                                + vc * kvec + ve]
                    for e in t.unrolled(kvec):
                        with T.sblock("score"):
                            vbh, vqt, vkt, vt, vj, vc, ve = T.axis.remap(
                                "SSRSSRR", [lbh, lqt, kt, tid, jj, c, e])
                            s[vt, vj] = s[vt, vj] + q_loc[vt, vc * kvec + ve] * kreg[vt, ve]
                with T.sblock("score_mask"):
                    vbh, vqt, vkt, vt, vj = T.axis.remap("SSRSS", [lbh, lqt, kt, tid, jj])
                    key: T.let[T.int32] = vkt * TILE_KV + vj * LANES + vt % LANES
                    row: T.let[T.int32] = vqt * ROWS + vt // LANES
                    if count == 2:
                        s[vt, vj] = T.if_then_else(
                            key < SK and row < SQ,
                            s[vt, vj] + bias_at(biases, 0, vbh // H, vbh % H, row, key)
                            + bias_at(biases, 1, vbh // H, vbh % H, row, key),
                            T.float32(_NEG_INF))
                    elif count == 1:
                        s[vt, vj] = T.if_then_else(
                            key < SK and row < SQ,
                            s[vt, vj] + bias_at(biases, 0, vbh // H, vbh % H, row, key),
                            T.float32(_NEG_INF))
                    else:
                        s[vt, vj] = T.if_then_else(key < SK, s[vt, vj], T.float32(_NEG_INF))
            with T.sblock("lane_max_init"):
                vbh, vqt, vkt, vt = T.axis.remap("SSRS", [lbh, lqt, kt, tid])
                m_new[vt] = T.float32(_NEG_INF)
            for jj in t.unrolled(per_lane):
                with T.sblock("lane_max"):
                    vbh, vqt, vkt, vt, vj = T.axis.remap("SSRSR", [lbh, lqt, kt, tid, jj])
                    m_new[vt] = T.max(m_new[vt], s[vt, vj])
            with T.sblock("lane_max_share"):
                vbh, vqt, vkt, vt = T.axis.remap("SSRS", [lbh, lqt, kt, tid])
                part[vt // LANES, vt % LANES] = m_new[vt]

    return score


def _softmax_phase(t: _Tiling):
    """The row's new maximum, the rescale factor of what was summed, the tile's
    probabilities (shared with the row's lanes) and each lane's partial sum."""
    threads, per_lane, p_stride = t.threads, t.per_lane, t.p_stride

    @T.macro
    def softmax(s, m, m_new, alpha, lsum, part, p_sh, lbh, lqt, kt):
        for tid in t.thread(threads):
            with T.sblock("row_max_init"):
                vbh, vqt, vkt, vt = T.axis.remap("SSRS", [lbh, lqt, kt, tid])
                m_new[vt] = m[vt]
            for lane in t.unrolled(LANES):
                with T.sblock("row_max"):
                    vbh, vqt, vkt, vt, vl = T.axis.remap("SSRSR", [lbh, lqt, kt, tid, lane])
                    m_new[vt] = T.max(m_new[vt], part[vt // LANES, vl])
            with T.sblock("rescale"):
                vbh, vqt, vkt, vt = T.axis.remap("SSRS", [lbh, lqt, kt, tid])
                # While every score so far is -inf nothing has been summed: keep the (zero)
                # sums rather than form exp(-inf + inf).
                alpha[vt] = T.if_then_else(m_new[vt] == T.float32(_NEG_INF), T.float32(1),
                                           T.exp(m[vt] - m_new[vt]))
                lsum[vt] = lsum[vt] * alpha[vt]
                m[vt] = m_new[vt]
            for jj in t.unrolled(per_lane):
                with T.sblock("prob"):
                    vbh, vqt, vkt, vt, vj = T.axis.remap("SSRSS", [lbh, lqt, kt, tid, jj])
                    s[vt, vj] = T.if_then_else(m[vt] == T.float32(_NEG_INF), T.float32(0),
                                               T.exp(s[vt, vj] - m[vt]))
                with T.sblock("prob_share"):
                    vbh, vqt, vkt, vt, vj = T.axis.remap("SSRSS", [lbh, lqt, kt, tid, jj])
                    p_sh[vt // LANES * p_stride + vj * LANES + vt % LANES] = t.operand(s[vt, vj])
                with T.sblock("lane_sum"):
                    vbh, vqt, vkt, vt, vj = T.axis.remap("SSRSR", [lbh, lqt, kt, tid, jj])
                    lsum[vt] = lsum[vt] + s[vt, vj]

    return softmax


def _accumulate_phase(t: _Tiling):
    """acc = acc * alpha + P . V over the tile, each lane its value dims."""
    DV, threads, chunks, width, p_stride = t.spec.value_dim, t.threads, t.chunks, t.width, \
        t.p_stride

    @T.macro
    def accumulate(v_sh, p_sh, acc, vreg, alpha, lbh, lqt, kt):
        for tid in t.thread(threads):
            for d in t.unrolled(chunks * width):
                with T.sblock("acc_rescale"):
                    vbh, vqt, vkt, vt, vd = T.axis.remap("SSRSS", [lbh, lqt, kt, tid, d])
                    acc[vt, vd] = acc[vt, vd] * alpha[vt]
            for j in T.serial(TILE_KV):
                for c in t.unrolled(chunks):
                    for e in t.vectorized(width):
                        with T.sblock("v_reg"):
                            vbh, vqt, vkt, vt, vj, vc, ve = T.axis.remap(
                                "SSRSRSS", [lbh, lqt, kt, tid, j, c, e])
                            dim: T.let[T.int32] = t.value_dim(vt % LANES, vc, ve)
                            vreg[vt, ve] = T.if_then_else(
                                dim < DV, v_sh[vj * DV + T.min(dim, DV - 1)], T.float32(0))
                    for e in t.unrolled(width):
                        with T.sblock("acc"):
                            vbh, vqt, vkt, vt, vj, vc, ve = T.axis.remap(
                                "SSRSRSS", [lbh, lqt, kt, tid, j, c, e])
                            acc[vt, vc * width + ve] = acc[vt, vc * width + ve] \
                                + p_sh[vt // LANES * p_stride + vj] * vreg[vt, ve]

    return accumulate


def _row_sum_phase(t: _Tiling):
    """The lanes' partial sums of each row meet in shared memory: dst = the sum of src over
    the row's lanes (src may be dst)."""
    threads = t.threads

    @T.macro
    def row_sum(src, dst, part, lbh, lqt):
        for tid in t.thread(threads):
            with T.sblock("sum_share"):
                vbh, vqt, vt = T.axis.remap("SSS", [lbh, lqt, tid])
                part[vt // LANES, vt % LANES] = src[vt]
        for tid in t.thread(threads):
            with T.sblock("row_sum_init"):
                vbh, vqt, vt = T.axis.remap("SSS", [lbh, lqt, tid])
                dst[vt] = T.float32(0)
            for lane in t.unrolled(LANES):
                with T.sblock("row_sum"):
                    vbh, vqt, vt, vl = T.axis.remap("SSSR", [lbh, lqt, tid, lane])
                    dst[vt] = dst[vt] + part[vt // LANES, vl]

    return row_sum


def _store_phase(t: _Tiling, with_lse: bool):
    """The lanes' partial sums meet; each lane writes its value dims of acc / l (and with
    `with_lse` the row's first lane its log-sum-exp m + log(l), what the backward's rows
    kernel would otherwise compute again)."""
    spec = t.spec
    H, SQ, DV, dtype = spec.heads, spec.q_len, spec.value_dim, spec.dtype
    threads, chunks, width = t.threads, t.chunks, t.width
    zero_rows = bool(spec.zero_masked_rows)

    def normalised(acc, lsum):
        # A row with nothing summed (every score -inf) is 0 with zero_masked_rows, else the
        # 0 / 0 the unfused softmax gives (NaN).
        if zero_rows:
            return T.if_then_else(lsum == T.float32(0), T.float32(0), acc / lsum)
        return acc / lsum

    row_sum = _row_sum_phase(t)

    @T.macro
    def store(o, lse, m, acc, lsum, part, lbh, lqt):
        row_sum(lsum, lsum, part, lbh, lqt)
        for tid in t.thread(threads):
            if with_lse:
                with T.sblock("lse_store"):
                    vbh, vqt, vt = T.axis.remap("SSS", [lbh, lqt, tid])
                    row: T.let[T.int32] = vqt * ROWS + vt // LANES
                    if row < SQ and vt % LANES == 0:
                        lse[vbh // H, vbh % H, row] = m[vt] + T.log(lsum[vt])
            for c in t.unrolled(chunks):
                for e in t.unrolled(width):
                    with T.sblock("store"):
                        vbh, vqt, vt, vc, ve = T.axis.remap("SSSSS", [lbh, lqt, tid, c, e])
                        row: T.let[T.int32] = vqt * ROWS + vt // LANES
                        dim: T.let[T.int32] = t.value_dim(vt % LANES, vc, ve)
                        if row < SQ and dim < DV:
                            o[vbh // H, vbh % H, row, dim] = T.Cast(
                                dtype, normalised(acc[vt, vc * width + ve], lsum[vt]))

    return store


def _tile_body(t: _Tiling, with_lse: bool):
    """One thread block's work: a tile of query rows against every key."""
    spec = t.spec
    D, DV, threads = spec.head_dim, spec.value_dim, t.threads
    init, load, score = _init_phase(t), _load_phase(t), _score_phase(t)
    softmax, accumulate = _softmax_phase(t), _accumulate_phase(t)
    store = _store_phase(t, with_lse)
    local, shared = t.local, t.shared

    @T.macro
    def body(q, k, v, biases, o, lse):
        for lbh in t.grid(spec.batch * spec.heads, "y"):
            for lqt in t.grid(t.q_tiles, "x"):
                with T.sblock("tile"):
                    q_loc = T.sblock_alloc_buffer((threads, D), "float32", scope=local)
                    acc = T.sblock_alloc_buffer((threads, t.chunks * t.width), "float32",
                                                scope=local)
                    s = T.sblock_alloc_buffer((threads, t.per_lane), "float32", scope=local)
                    kreg = T.sblock_alloc_buffer((threads, t.kvec), "float32", scope=local)
                    vreg = T.sblock_alloc_buffer((threads, t.width), "float32", scope=local)
                    m = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    m_new = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    alpha = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    lsum = T.sblock_alloc_buffer((threads,), "float32", scope=local)
                    k_sh = T.sblock_alloc_buffer((TILE_KV * t.k_stride,), "float32",
                                                 scope=shared)
                    v_sh = T.sblock_alloc_buffer((TILE_KV * DV,), "float32", scope=shared)
                    p_sh = T.sblock_alloc_buffer((ROWS * t.p_stride,), "float32", scope=shared)
                    part = T.sblock_alloc_buffer((ROWS, LANES), "float32", scope=shared)
                    init(q, q_loc, acc, m, lsum, lbh, lqt)
                    for kt in T.serial(key_tiles_end(spec, lqt, ROWS, TILE_KV, t.kv_tiles)):
                        load(k, v, k_sh, v_sh, lbh, lqt, kt)
                        score(biases, q_loc, k_sh, s, kreg, m_new, part, lbh, lqt, kt)
                        softmax(s, m, m_new, alpha, lsum, part, p_sh, lbh, lqt, kt)
                        accumulate(v_sh, p_sh, acc, vreg, alpha, lbh, lqt, kt)
                    store(o, lse, m, acc, lsum, part, lbh, lqt)

    return body


def attention_kernel(spec: AttentionSpec, gpu: bool = False,
                     with_lse: bool = False) -> tirx.PrimFunc:
    """The fused attention PrimFunc of `spec`: parameters q, k, v, the biases, o (and with
    `with_lse` each row's log-sum-exp lse [batch, heads, q_len], float32, for the backward).
    With `gpu`, its loops are bound to CUDA blocks and threads and its scratch lives in shared
    and local memory (marked scheduled); without, the same statements run serially (any
    target)."""
    B, H, HK = spec.batch, spec.heads, spec.kv_heads
    SQ, SK, D, DV, dtype = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim, spec.dtype
    qk = spec.qk_dtype or dtype
    body = _tile_body(_Tiling(spec, gpu), with_lse)
    s0, d0, s1, d1 = bias_buffers(spec)

    @T.prim_func(private=True, s_tir=True)
    def attention(q: T.Buffer((B, H, SQ, D), qk), k: T.Buffer((B, HK, SK, D), qk),
                  v: T.Buffer((B, HK, SK, DV), dtype), bias0: T.Buffer(s0, d0),
                  bias1: T.Buffer(s1, d1), o: T.Buffer((B, H, SQ, DV), dtype),
                  lse: T.Buffer((B, H, SQ), "float32")):
        T.func_attr({"tirx.noalias": True})
        body(q, k, v, (bias0, bias1), o, lse)

    attention = only_params(attention, ["q", "k", "v", *_BIASES[:len(spec.bias_shapes)], "o",
                                        *(["lse"] if with_lse else [])])
    func = attention.with_attr(FUSED_ATTENTION_ATTR, True)
    return func.with_attr("tirx.is_scheduled", True) if gpu else func
