"""Compiled hot loops of the swap planners (numba): swap derivation and the three-stream
simulation. Plain integer/float arrays in and out, grouped in named tuples; `derive.py` and
`simulator.py` wrap them.

Positions are places in the schedule: op `order[i]` runs at position i. The device memory for
planned tensors is one region of `arena` bytes; a tensor occupies a contiguous, 256-aligned
window of it for each residency interval. Two layouts: the arena (a window may start at any
aligned offset) and SwapAdvisor's size classes (the region is cut into `Layout.count[c]`
objects of `Layout.size[c]` bytes per class; a tensor may only occupy one object of its class).

Derivation walks the schedule once. The schedule is a sequence of op runs: an op may run again
later to make its one tensor again (recompute, `recompute.py`); a tensor whose next use is such
a run is released after its last use before it, with no copy, and the run writes it into a
new window. At each position the op's needs are locked; each one not resident gets a window.
A window's cost depends on the policy (`Policy.mode`):
  * SWAPADVISOR: the link time of evicting its occupants and bringing them back (weight beta),
    the stall that bringing them back before their next use would cause, a Belady term
    favouring occupants used furthest in the future (weight delta), and how late the op would
    start because of this window (weight gamma): the window frees when its occupants' last
    ops end and their swap-outs finish, then the swap-in waits for the host-to-device link.
    Evicted tensors leave right after their last use, and so (`Policy.write_back`) does an
    argument updated in place once its last update has run; a swap-in is issued as soon as its
    window is free (after the last use, and the swap-out, of everything that occupied it),
    and of windows that cost the same it takes the one free earliest (adjacent free segments
    keep their own free times: a window within one freed long ago is free before a window
    across one freed just now).
  * LRU: evict the window whose occupants were least recently used; swaps happen on demand,
    right before the op that needs the tensor (no prefetch).
  * VDNN: LRU on demand, plus the vDNN policy: forward activations that the backward pass reads
    are offloaded right after their last forward use and prefetched one op ahead of their use.
Those times come from a running estimate of the iteration kept during the walk (`est`: end of
each op so far, `d2h_free` / `h2d_free`: when each copy stream frees up), so choices see stalls
and link load. If no window avoids the op's other needs (arena fragmentation), every need of
the op is evicted and the op's working set is packed from offset 0, which always fits once the
budget is feasible.

Swap-outs are named by key, position * big + event id with big = 2 * tensors + 1 (a tensor
overwritten in place may be copied out once before and once after its write): a larger key is
later in the device-to-host FIFO.

The derivation's state lives in structrefs (mutable records that numba passes by reference,
with one reference count for all their fields): a tuple of arrays passed to a function costs
a reference count update per array, which the per-op helpers cannot afford. Loops read the
fields they use into locals first, for the same reason.
"""

from __future__ import annotations

from collections import namedtuple

import numba as nb
import numpy as np
from numba import types
from numba.experimental import structref

SWAPADVISOR, LRU, VDNN = 0, 1, 2
_NONE = -1  # the occupant of a free segment
_ASAP = -2  # swap-in issue position: as soon as the window is free

# ---------------------------------------------------------------- inputs and outputs
# The problem's arrays, fixed for an Evaluator; op's needs: need_idx[need_ptr[op]:need_ptr[op+1]].
# Ops split in time (`split.py`) have `chunks[op]` > 0: their cut inputs are streamed in from
# the host (stream_idx[stream_ptr[op]:stream_ptr[op+1]], not among their needs), their cut
# outputs out to it (out_idx[out_ptr[op]:...]), and their chunk buffers are one scratch tensor
# among their needs.
# writer[t]: the op that overwrites t in place (-1: none); after it t's host copy is stale.
# end_on_host[t]: t is copied to the host at the end if it is still on the device.
Graph = namedtuple("Graph", ["need_ptr", "need_idx", "producer", "sizes", "durations",
                             "is_output", "stream_ptr", "stream_idx", "out_ptr", "out_idx",
                             "chunks", "writer", "end_on_host"])
# Bytes/s and seconds; `sync`: seconds from the event a stalled stream waits for to its
# resuming. Handing a copy to a stream idle for `idle` seconds costs the compute stream
# interp(idle, wake_idle, wake_issue) and the copy starts interp(idle, wake_idle, wake_start)
# after the hand-over began (a worker asleep longer wakes slower). All 0 on a GPU; measured on
# the stand-in.
Link = namedtuple("Link", ["h2d_bw", "h2d_lat", "d2h_bw", "d2h_lat", "sync", "wake_idle",
                           "wake_issue", "wake_start"])
# write_back: 1.0 copies an argument out right after its final in-place update (`_after_op`),
# 0.0 holds it until it is evicted or the call ends (SWAPADVISOR mode only).
Policy = namedtuple("Policy", ["mode", "beta", "gamma", "delta", "write_back"])
# Size classes: tensor t takes an object of class obj_class[t] (-1: any window of the arena);
# class c has `count[c]` objects of `size[c]` bytes laid out from offset `base[c]`.
Layout = namedtuple("Layout", ["obj_class", "base", "size", "count"])
# What `derive` returns: its tables cut to their length, per-position d2h waits (the key each
# op waits for, -1: none), which tensors end on the device, and counters. A residency's
# wait_key is the swap-out to finish before its window is written.
ResidencyTable = namedtuple("ResidencyTable", ["tensor", "offset", "begin", "end", "swap_in",
                                               "wait_key", "valid"])
SwapInTable = namedtuple("SwapInTable", ["tensor", "after", "before", "wait_key", "valid",
                                         "stream"])
SwapOutTable = namedtuple("SwapOutTable", ["tensor", "after", "stream"])
Derivation = namedtuple("Derivation", ["residencies", "swap_ins", "swap_outs", "op_wait",
                                       "end_on_device", "fallbacks", "big", "max_segments",
                                       "placements"])
# What `simulate` returns: op times by position (`op_ready`: when the compute stream could have
# started the op had it not waited for a copy), copy times by event id, and the end of the
# compute stream (the last op and the copies issued after it).
Timeline = namedtuple("Timeline", ["op_start", "op_end", "d2h_start", "d2h_end", "h2d_start",
                                   "h2d_end", "op_ready", "compute_end"])


# ---------------------------------------------------------------- derivation state
@structref.register
class _Record(types.StructRef):
    """The numba type of a mutable record, made from its (name, type) fields."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(typ)) for name, typ in fields)


_I, _F, _B = types.int64[::1], types.float64[::1], types.boolean[::1]
# Arena segments, sorted by offset, covering [0, arena): offset, bytes and occupant (or _NONE);
# a free segment also keeps the position after which it is free, the key of the swap-out to
# wait for before writing it, and the estimated time it is free. The first `count` are in use,
# as are the first `count` rows of each table below.
_SEGMENTS = _Record([("off", _I), ("size", _I), ("tensor", _I), ("free_after", _I),
                     ("wait_key", _I), ("free_at", _F), ("count", types.int64)])
_TENSORS = _Record([
    # Fixed for the derivation.
    ("sizes", _I), ("slot", _I),  # bytes, and bytes of its window (its size class's objects)
    ("obj_class", _I), ("fixed", _B), ("is_output", _B),
    ("prod_op", _I),  # the op that makes it (-1: none); it may run at several positions
    ("write_op", _I),  # the op that overwrites it in place, -1 if none
    ("host_start", _B),  # it starts the call on the host (and must end there if written)
    ("end_on_host", _B),  # it must end the call on the host
    ("offload_after", _I),  # vDNN: offloaded after that position (-1: never)
    ("use_ptr", _I), ("use_pos", _I),  # its uses, sorted positions use_pos[use_ptr[t]:use_ptr[t+1]]
    ("xin", _F), ("xout", _F),  # estimated swap-in, swap-out time
    # Running.
    ("resident", _B), ("offset", _I), ("host_copy", _B), ("last_use", _I),
    ("release", _I),  # position after which its last residency ended
    ("out_key", _I), ("out_end", _F),  # key and estimated end of its swap-out
    ("cur_res", _I),  # its latest residency
    ("locked", _I),  # the last position that needs it
    ("cursor", _I),  # into its uses: the first not before the current position
])
# A residency's free_after / wait_key / free_at are those of the free window it took, restored
# if it is cancelled.
_RESIDENCIES = _Record([("tensor", _I), ("offset", _I), ("begin", _I), ("end", _I),
                        ("swap_in", _I), ("wait_key", _I), ("free_after", _I), ("free_at", _F),
                        ("valid", _B), ("count", types.int64)])
# `stream`: the copy streams a split op's cut tensor (no window of its own), 0 otherwise.
_SWAP_INS = _Record([("tensor", _I), ("after", _I), ("before", _I), ("wait_key", _I),
                     ("valid", _B), ("stream", _B), ("count", types.int64)])
_SWAP_OUTS = _Record([("tensor", _I), ("after", _I), ("stream", _B), ("count", types.int64)])
# Per segment, what evicting it means: `cost` (link time, stall, Belady), the time it is free
# (`ready`: free or clean; `ready_dirty`: its occupant's last use, before the swap-out of
# `out` seconds), whether a need of the op holds it (`locked`), its occupant's last use and
# bytes (LRU and tie-breaks); with the window search's candidates and deques. Allocated once
# per derivation rather than per window search (thousands per derivation).
_SEGMENT_COSTS = _Record([("cost", _F), ("ready", _F), ("ready_dirty", _F), ("out", _F),
                          ("locked", _I), ("last_use", _F), ("nbytes", _F), ("cand", _I),
                          ("dq_p", _I), ("dq_d", _I), ("dq_l", _I)])
_STATE = _Record([
    ("seg", _SEGMENTS), ("ten", _TENSORS), ("res", _RESIDENCIES), ("ins", _SWAP_INS),
    ("outs", _SWAP_OUTS), ("cls_base", _I), ("cls_size", _I), ("cls_count", _I),
    ("arena", types.int64), ("n", types.int64),  # positions
    ("order", _I),  # the op at each position (an op may run again: recompute)
    ("t_compute", _F),  # t_compute[i]: compute time of the positions before i, without stalls
    ("op_wait", _I),  # per position: key of the swap-out the op waits for (-1: none)
    ("est", _F),  # estimated end of each position's op so far
    ("d2h_free", types.float64), ("h2d_free", types.float64),  # when each copy stream frees up
    ("fallbacks", types.int64), ("max_segments", types.int64), ("placements", types.int64),
    ("costs", _SEGMENT_COSTS),  # scratch of the window search
])


@nb.njit(cache=True)
def _xfer(nbytes, bw, lat):
    return lat + nbytes / bw


# ---------------------------------------------------------------- segments
@nb.njit(cache=True)
def _seg_remove(seg, k0, k1):
    """Delete segments k0..k1 (inclusive)."""
    off, size, tensor = seg.off, seg.size, seg.tensor
    free_after, wait_key, free_at = seg.free_after, seg.wait_key, seg.free_at
    cnt = k1 - k0 + 1
    for k in range(k1 + 1, seg.count):
        off[k - cnt] = off[k]
        size[k - cnt] = size[k]
        tensor[k - cnt] = tensor[k]
        free_after[k - cnt] = free_after[k]
        wait_key[k - cnt] = wait_key[k]
        free_at[k - cnt] = free_at[k]
    seg.count -= cnt


@nb.njit(cache=True)
def _seg_insert(seg, k, off, size, t, fp, dk, rt):
    s_off, s_size, s_tensor = seg.off, seg.size, seg.tensor
    s_free_after, s_wait_key, s_free_at = seg.free_after, seg.wait_key, seg.free_at
    for j in range(seg.count, k, -1):
        s_off[j] = s_off[j - 1]
        s_size[j] = s_size[j - 1]
        s_tensor[j] = s_tensor[j - 1]
        s_free_after[j] = s_free_after[j - 1]
        s_wait_key[j] = s_wait_key[j - 1]
        s_free_at[j] = s_free_at[j - 1]
    s_off[k] = off
    s_size[k] = size
    s_tensor[k] = t
    s_free_after[k] = fp
    s_wait_key[k] = dk
    s_free_at[k] = rt
    seg.count += 1


@nb.njit(cache=True)
def _seg_free(seg, k, fp, dk, rt):
    """Mark segment k free (after position fp, d2h key dk, estimated time rt) and merge free
    neighbours freed alike. Neighbours freed at other times stay apart: a window over them is
    free when the last of them is (`_sweep`), one within the earlier one is free before."""
    tensor, size, free_after, wait_key, free_at = (seg.tensor, seg.size, seg.free_after,
                                                   seg.wait_key, seg.free_at)
    tensor[k] = _NONE
    free_after[k] = fp
    wait_key[k] = dk
    free_at[k] = rt
    if k + 1 < seg.count and _freed_alike(seg, k, k + 1):
        size[k] += size[k + 1]
        _seg_remove(seg, k + 1, k + 1)
    if k > 0 and _freed_alike(seg, k - 1, k):
        size[k - 1] += size[k]
        _seg_remove(seg, k, k)


@nb.njit(cache=True)
def _freed_alike(seg, a, b):
    """Whether segments a and b are both free, after the same position and swap-out."""
    return seg.tensor[a] == _NONE and seg.tensor[b] == _NONE and \
        seg.free_after[a] == seg.free_after[b] and seg.wait_key[a] == seg.wait_key[b] and \
        seg.free_at[a] == seg.free_at[b]


@nb.njit(cache=True)
def _seg_find(seg, off):
    """Index of the segment containing byte `off`."""
    seg_off = seg.off
    lo, hi = 0, seg.count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if seg_off[mid] <= off:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------- setup
@nb.njit(cache=True)
def _uses(order, graph, fixed):
    """Uses of each tensor not fixed (needs, and inputs streamed by split ops), as sorted
    positions: (use_ptr, use_pos, total)."""
    n = order.shape[0]
    n_t = graph.sizes.shape[0]
    use_cnt = np.zeros(n_t + 1, np.int64)
    total = 0
    for i in range(n):
        op = order[i]
        for ptr, idx in ((graph.need_ptr, graph.need_idx), (graph.stream_ptr, graph.stream_idx)):
            for k in range(ptr[op], ptr[op + 1]):
                t = idx[k]
                if not fixed[t]:
                    use_cnt[t + 1] += 1
                    total += 1
    use_ptr = np.cumsum(use_cnt)
    use_pos = np.empty(max(total, 1), np.int64)
    fill = use_ptr[:-1].copy()
    for i in range(n):
        op = order[i]
        for ptr, idx in ((graph.need_ptr, graph.need_idx), (graph.stream_ptr, graph.stream_idx)):
            for k in range(ptr[op], ptr[op + 1]):
                t = idx[k]
                if not fixed[t]:
                    use_pos[fill[t]] = i
                    fill[t] += 1
    return use_ptr, use_pos, total


@nb.njit(cache=True)
def _new_tensors(graph, fixed, host_start, link, offload_after, layout, use_ptr, use_pos):
    sizes = np.ascontiguousarray(graph.sizes)
    n_t = sizes.shape[0]
    ten = structref.new(_TENSORS)
    ten.sizes, ten.obj_class = sizes, np.ascontiguousarray(layout.obj_class)
    ten.fixed, ten.is_output = fixed.copy(), graph.is_output.copy()
    ten.prod_op, ten.slot = np.ascontiguousarray(graph.producer).copy(), sizes.copy()
    ten.write_op = np.ascontiguousarray(graph.writer).copy()
    ten.host_start, ten.end_on_host = host_start.copy(), graph.end_on_host.copy()
    ten.xin, ten.xout = np.empty(n_t), np.empty(n_t)
    for t in range(n_t):
        if layout.obj_class[t] >= 0:
            ten.slot[t] = layout.size[layout.obj_class[t]]
        ten.xin[t] = _xfer(sizes[t], link.h2d_bw, link.h2d_lat)
        ten.xout[t] = _xfer(sizes[t], link.d2h_bw, link.d2h_lat)
    ten.offload_after = offload_after.copy()
    ten.use_ptr, ten.use_pos, ten.cursor = use_ptr, use_pos, use_ptr[:-1].copy()
    ten.resident, ten.offset = np.zeros(n_t, np.bool_), np.zeros(n_t, np.int64)
    ten.host_copy, ten.last_use = host_start.copy(), np.full(n_t, -1, np.int64)
    ten.release, ten.out_key = np.full(n_t, -1, np.int64), np.full(n_t, -1, np.int64)
    ten.out_end, ten.cur_res = np.zeros(n_t), np.full(n_t, -1, np.int64)
    ten.locked = np.full(n_t, -1, np.int64)
    return ten


@nb.njit(cache=True)
def _new_tables(cap, n_t, nseg, arena):
    """Empty segments (one free segment of `arena` bytes), residency, swap-in (`cap` rows
    each) and swap-out tables."""
    seg = structref.new(_SEGMENTS)
    seg.off, seg.size = np.zeros(nseg, np.int64), np.zeros(nseg, np.int64)
    seg.tensor, seg.free_after = np.full(nseg, _NONE, np.int64), np.full(nseg, -1, np.int64)
    seg.wait_key, seg.free_at = np.full(nseg, -1, np.int64), np.zeros(nseg)
    seg.size[0] = arena
    seg.count = 1
    res = structref.new(_RESIDENCIES)
    res.tensor, res.offset = np.empty(cap, np.int64), np.empty(cap, np.int64)
    res.begin, res.end = np.empty(cap, np.int64), np.empty(cap, np.int64)
    res.swap_in, res.wait_key = np.empty(cap, np.int64), np.empty(cap, np.int64)
    res.free_after, res.free_at = np.empty(cap, np.int64), np.empty(cap)
    res.valid, res.count = np.zeros(cap, np.bool_), 0
    ins = structref.new(_SWAP_INS)
    ins.tensor, ins.after = np.empty(cap, np.int64), np.empty(cap, np.int64)
    ins.before, ins.wait_key = np.empty(cap, np.int64), np.empty(cap, np.int64)
    ins.valid, ins.stream, ins.count = np.zeros(cap, np.bool_), np.zeros(cap, np.bool_), 0
    outs = structref.new(_SWAP_OUTS)
    cap_out = _out_key_base(n_t)
    outs.tensor, outs.after = np.empty(cap_out, np.int64), np.empty(cap_out, np.int64)
    outs.stream, outs.count = np.zeros(cap_out, np.bool_), 0
    return seg, res, ins, outs


@nb.njit(cache=True)
def _new_state(order, graph, fixed, host_start, arena, link, offload_after, layout):
    n = order.shape[0]
    n_t = graph.sizes.shape[0]
    use_ptr, use_pos, total = _uses(order, graph, fixed)
    cap = 3 * total + n_t + 4  # fallbacks and vDNN prefetches add residencies
    st = structref.new(_STATE)
    nseg = 2 * cap + 4
    st.seg, st.res, st.ins, st.outs = _new_tables(cap, n_t, nseg, arena)
    st.costs = _new_segment_costs(nseg)
    st.ten = _new_tensors(graph, fixed, host_start, link, offload_after, layout, use_ptr,
                          use_pos)
    st.order = order
    st.cls_base = np.ascontiguousarray(layout.base)
    st.cls_size = np.ascontiguousarray(layout.size)
    st.cls_count = np.ascontiguousarray(layout.count)
    st.arena, st.n = arena, n
    st.t_compute = np.zeros(n + 1)
    for i in range(n):
        st.t_compute[i + 1] = st.t_compute[i] + graph.durations[order[i]]
    st.op_wait, st.est = np.full(n, -1, np.int64), np.zeros(n)
    st.d2h_free, st.h2d_free = 0.0, 0.0
    st.fallbacks, st.max_segments, st.placements = 0, 0, 0
    return st


# ---------------------------------------------------------------- the walk
@nb.njit(cache=True, nogil=True)
def derive(order, graph, fixed, host_start, arena, link, policy, offload_after, layout):
    """Swap derivation of one schedule (see the module docstring): `fixed` tensors stay on the
    device outside the `arena` bytes, `host_start` ones start on the host. Returns a
    Derivation."""
    st = _new_state(order, graph, fixed, host_start, arena, link, offload_after, layout)
    ten, est, sizes, durations = st.ten, st.est, graph.sizes, graph.durations
    cap = st.res.tensor.shape[0]
    needs = np.empty(cap, np.int64)
    placed = np.empty(cap, np.int64)
    for i in range(st.n):
        op = order[i]
        now = est[i - 1] if i > 0 else 0.0
        streams_from = st.ins.count
        first_chunk = _stream_in(st, graph, op, i, now) if graph.chunks[op] > 0 else now
        m = _lock_needs(graph.need_ptr, graph.need_idx, ten, op, i, needs)
        # Largest first: fewer fragmentation failures.
        srt = np.argsort(-sizes[needs[:m]], kind="mergesort")
        start, n_placed, failed = _place_needs(st, needs, srt, m, i, now, policy, placed,
                                               False)
        if failed:
            _undo_step(st, needs, m, i, placed, n_placed)
            start = _place_needs(st, needs, srt, m, i, now, policy, placed, True)[0]
        if graph.chunks[op] > 0:
            _streams_wait_for_scratch(st, graph, op, streams_from)
        est[i] = max(start, first_chunk) + durations[op]
        if policy.mode == VDNN and i + 1 < st.n:
            _prefetch(st, graph.need_ptr, graph.need_idx, order[i + 1], i, now)
        _after_op(st, needs, m, i, policy.mode == SWAPADVISOR and policy.write_back > 0.0)
        if graph.chunks[op] > 0:
            _stream_out(st, graph, op, i)
        if policy.mode == VDNN:
            _offload(st, needs, m, i)
    return _derivation(st)


@nb.njit(cache=True)
def _stream_in(st, graph, op, i, now):
    """A split op's cut inputs at position i come from their host copies: one resident is
    evicted (copied out first if it has no host copy); each is streamed in by one h2d copy
    into the op's chunk buffers. Returns when its first chunk can be there."""
    ten = st.ten
    ins = st.ins
    chunks = graph.chunks[op]
    first = now
    for k in range(graph.stream_ptr[op], graph.stream_ptr[op + 1]):
        x = graph.stream_idx[k]
        if ten.fixed[x]:
            raise ValueError("a tensor kept on the device is streamed")
        if ten.resident[x]:
            _advance(ten.cursor, ten.use_ptr, ten.use_pos, x, i)
            p = ten.last_use[x] if ten.last_use[x] >= 0 else i - 1
            _evict(st, x, _seg_find(st.seg, ten.offset[x]), p)
        if not ten.host_copy[x]:
            raise ValueError("a tensor is streamed before it is on the host")
        nh = ins.count
        ins.tensor[nh] = x
        ins.after[nh] = i - 1
        ins.before[nh] = i
        ins.wait_key[nh] = ten.out_key[x]
        ins.valid[nh] = True
        ins.stream[nh] = True
        ins.count = nh + 1
        s = max(st.h2d_free, now, ten.out_end[x])
        st.h2d_free = s + ten.xin[x]
        first = max(first, s + ten.xin[x] / chunks)
    return first


@nb.njit(cache=True)
def _streams_wait_for_scratch(st, graph, op, first):
    """The streamed inputs (the streamed swap-ins from `first` on; the others made since fill
    windows of their own) write the op's chunk buffers: like it, they wait for the swap-out of
    what that window held."""
    scratch = graph.need_idx[graph.need_ptr[op + 1] - 1]
    window = st.res.wait_key[st.ten.cur_res[scratch]]
    for e in range(first, st.ins.count):
        if st.ins.stream[e]:
            st.ins.wait_key[e] = max(st.ins.wait_key[e], window)


@nb.njit(cache=True)
def _stream_out(st, graph, op, i):
    """A split op's cut outputs leave for the host chunk by chunk: one d2h copy each after the
    op at i; they are on the host only, afterwards. Its chunk buffers' window (its scratch
    tensor, the last of its needs, freed after the op) is not free until the copies are."""
    ten = st.ten
    outs = st.outs
    big = _out_key_base(ten.sizes.shape[0])
    scratch = graph.need_idx[graph.need_ptr[op + 1] - 1]
    window = _seg_find(st.seg, ten.offset[scratch])
    for j in range(graph.out_ptr[op], graph.out_ptr[op + 1]):
        y = graph.out_idx[j]
        nd = outs.count
        outs.tensor[nd] = y
        outs.after[nd] = i
        outs.stream[nd] = True
        outs.count = nd + 1
        ten.out_key[y] = i * big + nd
        s = max(st.d2h_free, st.est[i] - graph.durations[op] * (1.0 - 1.0 / graph.chunks[op]))
        st.d2h_free = s + ten.xout[y]
        ten.out_end[y] = st.d2h_free
        ten.host_copy[y] = True
        ten.resident[y] = False
        ten.release[y] = i
        st.seg.wait_key[window] = max(st.seg.wait_key[window], ten.out_key[y])
        st.seg.free_at[window] = max(st.seg.free_at[window], ten.out_end[y])


@nb.njit(cache=True)
def _lock_needs(need_ptr, need_idx, ten, op, i, needs):
    """Write the op's needs (tensors not fixed) into `needs`, lock them; return how many."""
    fixed, locked = ten.fixed, ten.locked
    m = 0
    for k in range(need_ptr[op], need_ptr[op + 1]):
        t = need_idx[k]
        if not fixed[t]:
            needs[m] = t
            m += 1
            locked[t] = i
    return m


@nb.njit(cache=True)
def _place_needs(st, needs, srt, m, i, now, policy, placed, pack):
    """Give each need of the op at i not resident a window, in `srt` order: the cheapest one,
    or (`pack`) the next offset from 0. Returns (when the op can start, how many residencies
    were made, listed in `placed`, and whether some need found no window)."""
    ten = st.ten
    resident, slot, prod_op, host_copy = ten.resident, ten.slot, ten.prod_op, ten.host_copy
    op = st.order[i]
    on_demand = policy.mode != SWAPADVISOR
    n_placed = 0
    start = now
    packed = 0
    for jj in range(m):
        t = needs[srt[jj]]
        if resident[t]:
            continue
        size = slot[t]
        produced = prod_op[t] == op
        if not produced and not host_copy[t]:
            raise ValueError("a tensor is needed before it was produced")
        if not pack:
            o = _best_window(st, t, i, size, produced, policy, now)
        elif ten.obj_class[t] >= 0:
            raise ValueError("a size class has fewer objects than an op needs")
        else:
            o = packed
        packed += size
        if o < 0:
            return start, n_placed, True
        q = i - 1 if on_demand else _ASAP
        ready = _place(st, t, i, o, size, produced, q, on_demand)
        st.max_segments = max(st.max_segments, st.seg.count)
        st.placements += 1
        start = max(start, ready)
        placed[n_placed] = st.res.count - 1
        n_placed += 1
    return start, n_placed, False


@nb.njit(cache=True)
def _undo_step(st, needs, m, i, placed, n_placed):
    """Fragmentation fallback: undo this step's placements and evict every need of the op."""
    ten = st.ten
    st.fallbacks += 1
    for j in range(n_placed):
        _cancel(st, placed[j])
    for jj in range(m):
        t = needs[jj]
        if ten.resident[t] and ten.last_use[t] < st.res.begin[ten.cur_res[t]]:
            _cancel(st, ten.cur_res[t])  # prefetched (vDNN), unused: cancel the fetch
        elif ten.resident[t]:
            _evict(st, t, _seg_find(st.seg, ten.offset[t]), ten.last_use[t])
    st.op_wait[i] = -1


@nb.njit(cache=True)
def _prefetch(st, need_ptr, need_idx, nxt, i, now):
    """vDNN: prefetch the offloaded inputs of op `nxt` (at i + 1) one op ahead. The copy is
    issued before the op at i, so a tensor with no host copy yet (a split op's output, which
    reaches the host only as the op at i streams it out) is left to the on-demand swap-in."""
    ten = st.ten
    fixed, resident, prod_op, offload_after = (ten.fixed, ten.resident, ten.prod_op,
                                               ten.offload_after)
    lru = Policy(LRU, 0.0, 0.0, 0.0, 0.0)
    for k in range(need_ptr[nxt], need_ptr[nxt + 1]):
        t = need_idx[k]
        if fixed[t] or resident[t] or prod_op[t] == nxt or offload_after[t] < 0 or \
                not ten.host_copy[t]:
            continue
        size = ten.slot[t]
        o = _best_window(st, t, i, size, False, lru, now)
        if o >= 0:
            _place(st, t, i + 1, o, size, False, i - 1, True)
            ten.locked[t] = i + 1


@nb.njit(cache=True)
def _ends_on_host(ten, t):
    """t must end the call on the host: an output kept there, or an argument that starts the
    call on the host and is overwritten in place."""
    return ten.end_on_host[t] or (ten.host_start[t] and ten.write_op[t] >= 0)


@nb.njit(cache=True)
def _after_op(st, needs, m, i, write_back_early):
    """After the op at i: release what is dead (or made again before its next use: its
    producer runs again there), extend what lives on. With `write_back_early`, a tensor that
    ends the call on the host and has no use left (an argument's final in-place update) is
    copied out now rather than held to the end: it crosses the link once either way, and now
    the copy overlaps the ops still to run (the backward of the layers before it) instead of
    trailing the last op."""
    ten, res_end, seg = st.ten, st.res.end, st.seg
    last_use, cur_res, cursor, use_ptr, use_pos = (ten.last_use, ten.cur_res, ten.cursor,
                                                   ten.use_ptr, ten.use_pos)
    for jj in range(m):
        t = needs[jj]
        last_use[t] = i
        res_end[cur_res[t]] = i
        if ten.write_op[t] == st.order[i]:
            ten.host_copy[t] = False  # overwritten in place: the device copy is the only one
        c = cursor[t]
        while c < use_ptr[t + 1] and use_pos[c] <= i:
            c += 1
        cursor[t] = c
        if (c == use_ptr[t + 1] and not ten.is_output[t]) or \
                (c < use_ptr[t + 1] and st.order[use_pos[c]] == ten.prod_op[t]):
            ten.resident[t] = False
            ten.release[t] = i
            _seg_free(seg, _seg_find(seg, ten.offset[t]), i, -1, st.est[i])
        elif write_back_early and c == use_ptr[t + 1] and not ten.host_copy[t] and \
                _ends_on_host(ten, t):
            _evict(st, t, _seg_find(seg, ten.offset[t]), i)


@nb.njit(cache=True)
def _offload(st, needs, m, i):
    """vDNN: offload forward activations after their last forward use (at i)."""
    ten = st.ten
    offload_after, resident, cursor, use_ptr = (ten.offload_after, ten.resident, ten.cursor,
                                                ten.use_ptr)
    for jj in range(m):
        t = needs[jj]
        if offload_after[t] == i and resident[t] and cursor[t] < use_ptr[t + 1]:
            _evict(st, t, _seg_find(st.seg, ten.offset[t]), i)


@nb.njit(cache=True)
def _derivation(st):
    ten = st.ten
    n_t = ten.sizes.shape[0]
    end_on_device = np.zeros(n_t, np.bool_)
    for t in range(n_t):
        if ten.resident[t]:
            st.res.end[ten.cur_res[t]] = st.n - 1
            if _ends_on_host(ten, t):
                if not ten.host_copy[t]:
                    _write_back(st, t)
                ten.resident[t] = False
            else:
                end_on_device[t] = True
    r, h, d = st.res, st.ins, st.outs
    nr, nh, nd = r.count, h.count, d.count
    res = ResidencyTable(tensor=r.tensor[:nr], offset=r.offset[:nr], begin=r.begin[:nr],
                         end=r.end[:nr], swap_in=r.swap_in[:nr], wait_key=r.wait_key[:nr],
                         valid=r.valid[:nr])
    ins = SwapInTable(tensor=h.tensor[:nh], after=h.after[:nh], before=h.before[:nh],
                      wait_key=h.wait_key[:nh], valid=h.valid[:nh], stream=h.stream[:nh])
    outs = SwapOutTable(tensor=d.tensor[:nd], after=d.after[:nd], stream=d.stream[:nd])
    return Derivation(residencies=res, swap_ins=ins, swap_outs=outs, op_wait=st.op_wait,
                      end_on_device=end_on_device, fallbacks=st.fallbacks, big=_out_key_base(n_t),
                      max_segments=st.max_segments, placements=st.placements)


@nb.njit(cache=True)
def _write_back(st, t):
    """Copy t, overwritten in place, back to its host buffer after the last op."""
    outs, ten = st.outs, st.ten
    nd = outs.count
    outs.tensor[nd] = t
    outs.after[nd] = st.n - 1
    outs.count = nd + 1
    s = max(st.d2h_free, st.est[st.n - 1] if st.n > 0 else 0.0)
    st.d2h_free = s + ten.xout[t]
    ten.host_copy[t] = True
    ten.resident[t] = False


# ---------------------------------------------------------------- tensors
@nb.njit(cache=True)
def _out_key_base(n_t):
    """Rows of the swap-out table, and the `big` of its keys: each tensor is copied out at
    most once before an in-place write to it and once after."""
    return 2 * n_t + 1


@nb.njit(cache=True)
def _advance(cursor, use_ptr, use_pos, v, i):
    """Move v's cursor (into its uses) to its first use at or after position i; return it."""
    c = cursor[v]
    while c < use_ptr[v + 1] and use_pos[c] < i:
        c += 1
    cursor[v] = c
    return c


@nb.njit(cache=True)
def _next_use(cursor, use_ptr, use_pos, is_output, v, i, n):
    """The position of v's next use from i on; n if none but v is an output, else -1."""
    c = _advance(cursor, use_ptr, use_pos, v, i)
    if c < use_ptr[v + 1]:
        return use_pos[c]
    return n if is_output[v] else -1


@nb.njit(cache=True)
def _evict(st, v, k, p):
    """Evict resident tensor v (segment k) whose residency ends after position p: swap it out
    after p if it has no host copy and is needed again (or returned)."""
    ten = st.ten
    big = _out_key_base(ten.sizes.shape[0])
    c = ten.cursor[v]
    # A tensor made again before its next use (recompute) needs no copy.
    future = (c < ten.use_ptr[v + 1] and st.order[ten.use_pos[c]] != ten.prod_op[v]) or \
        ten.is_output[v]
    dk = -1
    rt = st.est[p] if p >= 0 else 0.0
    if future and not ten.host_copy[v]:
        outs = st.outs
        nd = outs.count
        outs.tensor[nd] = v
        outs.after[nd] = p
        dk = p * big + nd
        ten.out_key[v] = dk
        s = max(st.d2h_free, rt)
        st.d2h_free = s + ten.xout[v]
        rt = st.d2h_free
        ten.out_end[v] = rt
        outs.count = nd + 1
        ten.host_copy[v] = True
    ten.resident[v] = False
    ten.release[v] = p
    st.res.end[ten.cur_res[v]] = p
    _seg_free(st.seg, k, p, dk, rt)


# ---------------------------------------------------------------- choosing a window
# What a window's cost depends on besides its segments.
Target = namedtuple("Target", ["mode", "gamma", "produced", "own_ready", "d2h_free",
                               "h2d_free", "xin", "now", "arena"])


@nb.njit(cache=True)
def _new_segment_costs(nseg):
    sc = structref.new(_SEGMENT_COSTS)
    sc.cost, sc.ready, sc.ready_dirty = np.empty(nseg), np.empty(nseg), np.empty(nseg)
    sc.out, sc.locked, sc.last_use = np.empty(nseg), np.empty(nseg, np.int64), np.empty(nseg)
    sc.nbytes = np.empty(nseg)
    sc.cand = np.empty(nseg, np.int64)
    sc.dq_p, sc.dq_d = np.empty(nseg, np.int64), np.empty(nseg, np.int64)
    sc.dq_l = np.empty(nseg, np.int64)
    return sc


@nb.njit(cache=True)
def _segment_costs(st, sc, i, policy, now):
    """Fill the rows of `sc` for the op at position i."""
    ns = st.seg.count
    seg_tensor, seg_size, seg_free_at = st.seg.tensor, st.seg.size, st.seg.free_at
    ten = st.ten
    locked, last_use, host_copy, xin, xout = (ten.locked, ten.last_use, ten.host_copy, ten.xin,
                                              ten.xout)
    cursor, use_ptr, use_pos, is_output = ten.cursor, ten.use_ptr, ten.use_pos, ten.is_output
    est, t_compute, n = st.est, st.t_compute, st.n
    mode, beta, delta = policy.mode, policy.beta, policy.delta
    cost, ready, ready_dirty, out = sc.cost, sc.ready, sc.ready_dirty, sc.out
    lk, lu, nbytes = sc.locked, sc.last_use, sc.nbytes
    for k in range(ns):
        cost[k] = 0.0
        ready[k] = -np.inf
        ready_dirty[k] = -np.inf
        out[k] = 0.0
        lk[k] = 0
        lu[k] = -2.0
        nbytes[k] = 0.0
        v = seg_tensor[k]
        if v == _NONE:
            ready[k] = seg_free_at[k]
            continue
        if locked[v] >= i:
            lk[k] = 1
            continue
        luv = last_use[v]
        lu[k] = luv
        nbytes[k] = seg_size[k]
        rt = est[luv] if luv >= 0 else 0.0
        if mode != SWAPADVISOR:
            ready[k] = max(rt, now)
            continue
        nu = _next_use(cursor, use_ptr, use_pos, is_output, v, i, n)
        out_v = 0.0
        if not host_copy[v] and nu >= 0:
            out_v = xout[v]
            ready_dirty[k] = rt
            out[k] = out_v
        else:
            ready[k] = rt
        if 0 <= nu < n:
            in_v = xin[v]
            cost[k] = (beta * (in_v + out_v)
                       + max(0.0, out_v + in_v - (t_compute[nu] - t_compute[i]))
                       + delta * in_v * n / (nu - i + 1.0))
        else:
            cost[k] = beta * out_v


@nb.njit(cache=True)
def _best_window(st, t, i, size, produced, policy, now):
    """The offset of the cheapest window for t (see the module docstring), -1 if every
    window holds a tensor the op needs. Candidate windows start where a segment starts or
    end where one ends (arena), or are the objects of t's size class; a two-pointer sweep
    scores them all in time linear in the segments."""
    seg = st.seg
    c = st.ten.obj_class[t]
    if produced and c < 0 and policy.mode == SWAPADVISOR:
        o = _free_window(seg, size, policy.gamma, now, st.arena)
        if o >= 0:
            return o  # what the sweep would find first: a window that costs nothing
    sc = st.costs
    _segment_costs(st, sc, i, policy, now)
    cand = sc.cand
    if c >= 0 and st.cls_count[c] > cand.shape[0]:
        cand = np.empty(st.cls_count[c], np.int64)
    target = Target(mode=policy.mode, gamma=policy.gamma, produced=produced,
                    own_ready=0.0 if produced else st.ten.out_end[t], d2h_free=st.d2h_free,
                    h2d_free=st.h2d_free, xin=st.ten.xin[t], now=now, arena=st.arena)
    best_cost = np.inf
    best_o = -1
    for variant in range(2 if c < 0 else 1):
        if c >= 0:  # the objects of t's class
            nc = st.cls_count[c]
            for j in range(nc):
                cand[j] = st.cls_base[c] + j * st.cls_size[c]
        else:
            nc = _window_starts(seg, size, variant, cand)
        best_cost, best_o = _sweep(seg.off, seg.size, seg.count, sc, cand, nc, size, target,
                                   best_cost, best_o)
        if best_cost <= 0.0:
            break  # a free window, ready in time: nothing can beat it
    return best_o


@nb.njit(cache=True)
def _free_window(seg, size, gamma, now, arena):
    """The first segment start where a window of `size` bytes for an output of the op covers
    only free segments free by `now` (any free ones when `gamma` is 0), -1 if none. Such a
    window costs nothing and any other costs more (`_window_cost`): the sweep's answer, found
    without the costs of every segment's occupant (and without the rounding the sweep's
    running sums of segment costs keep, which could make it pass over such a window)."""
    off, seg_size, tensor, free_at = seg.off, seg.size, seg.tensor, seg.free_at
    start = -1  # the first segment of the current run of usable free segments
    for k in range(seg.count):
        if tensor[k] != _NONE or gamma * max(0.0, free_at[k] - now) > 0.0:
            start = -1
            continue
        if start < 0:
            start = k
        o = off[start]
        if off[k] + seg_size[k] - o >= size:
            return o if o + size <= arena else -1
    return -1


@nb.njit(cache=True)
def _window_starts(seg, size, variant, cand):
    """Write into `cand` where each segment starts (variant 0) or where a window of `size`
    bytes ending with it starts (variant 1, when that differs); return how many."""
    off, seg_size = seg.off, seg.size
    nc = 0
    for k in range(seg.count):
        o = off[k] if variant == 0 else off[k] + seg_size[k] - size
        if variant == 1 and o == off[k]:
            continue
        cand[nc] = o
        nc += 1
    return nc


@nb.njit(cache=True)
def _push_max(dq, head, tail, values, e):
    """Append index e to a deque of indices of decreasing values; return the new tail."""
    while tail > head and values[dq[tail - 1]] <= values[e]:
        tail -= 1
    dq[tail] = e
    return tail + 1


@nb.njit(cache=True)
def _sweep(seg_off, seg_size, ns, sc, cand, nc, size, target, best_cost, best_o):
    """Score the windows at `cand[:nc]` (sorted); return the best (cost, offset) of them and
    the best so far. Stops at the first window that costs nothing."""
    cost, out, locked, nbytes = sc.cost, sc.out, sc.locked, sc.nbytes
    ready, ready_dirty, last_use = sc.ready, sc.ready_dirty, sc.last_use
    dq_p, dq_d, dq_l = sc.dq_p, sc.dq_d, sc.dq_l
    hp = tp = hd = td = hl = tl = 0
    b = 0
    e = -1  # the window covers segments b..e
    s_vc = 0.0
    s_out = 0.0
    s_lk = 0
    s_vb = 0.0
    for ci in range(nc):
        o = cand[ci]
        if o < 0 or o + size > target.arena:
            continue
        while e + 1 < ns and seg_off[e + 1] < o + size:  # take segments starting before the end
            e += 1
            s_vc += cost[e]
            s_out += out[e]
            s_lk += locked[e]
            s_vb += nbytes[e]
            tp = _push_max(dq_p, hp, tp, ready, e)
            td = _push_max(dq_d, hd, td, ready_dirty, e)
            tl = _push_max(dq_l, hl, tl, last_use, e)
        while b <= e and seg_off[b] + seg_size[b] <= o:  # drop segments ending before o
            s_vc -= cost[b]
            s_out -= out[b]
            s_lk -= locked[b]
            s_vb -= nbytes[b]
            if hp < tp and dq_p[hp] == b:
                hp += 1
            if hd < td and dq_d[hd] == b:
                hd += 1
            if hl < tl and dq_l[hl] == b:
                hl += 1
            b += 1
        if s_lk > 0:
            continue
        c = _window_cost(target, s_vc, s_out, s_vb, ready[dq_p[hp]] if hp < tp else -np.inf,
                         ready_dirty[dq_d[hd]] if hd < td else -np.inf,
                         last_use[dq_l[hl]] if hl < tl else -2.0)
        if c < best_cost:
            best_cost = c
            best_o = o
            if c <= 0.0:
                break
    return best_cost, best_o


@nb.njit(cache=True)
def _window_cost(target, s_vc, s_out, s_vb, ready, ready_dirty, last_use):
    """The cost of a window given the sums of its segments' cost, out and nbytes, and the
    latest ready, ready_dirty and last_use of its segments (-inf, -inf, -2 if none)."""
    tg = target
    if tg.mode != SWAPADVISOR:
        return (last_use + 2.0) * 1e12 + s_vb / (tg.arena + 1.0)
    ready = max(tg.own_ready, ready)
    if s_out > 0.0:
        ready = max(ready, max(tg.d2h_free, ready_dirty) + s_out)
    # Tie-breaks: evict fewer bytes; then, for a swap-in, the window free earliest (the
    # walk's times are estimates: a swap-in issued earlier has slack against a stream busier
    # than they say).
    if tg.produced:
        late = ready - tg.now
        early = 0.0
    else:
        late = max(ready, tg.h2d_free) + tg.xin - tg.now
        early = 1e-12 * max(0.0, ready)
    return s_vc + tg.gamma * max(0.0, late) + 1e-15 * s_vb + early


# ---------------------------------------------------------------- placing
@nb.njit(cache=True)
def _place(st, t, i, o, size, produced, q, on_demand):
    """Evict the occupants of [o, o + size), put t there for position i (produced by the op
    there, or swapped in after position q; q = _ASAP: as early as the window allows).
    Returns the estimated time the op at i can use it."""
    ten = st.ten
    _evict_window(st, i, o, size, on_demand)
    avail, wait_key, ready = _occupy(st.seg, ten, t, o, size, produced)
    ten.resident[t] = True
    ten.offset[t] = o
    res = st.res
    nr = res.count
    res.tensor[nr] = t
    res.offset[nr] = o
    res.end[nr] = i
    res.wait_key[nr] = wait_key
    res.free_after[nr] = avail
    res.free_at[nr] = ready
    res.valid[nr] = True
    if produced:
        res.begin[nr] = i
        res.swap_in[nr] = -1
        st.op_wait[i] = max(st.op_wait[i], wait_key)
        usable = ready
    else:
        usable = _swap_in(st, t, i, q, avail, wait_key, ready, nr)
    ten.cur_res[t] = nr
    res.count = nr + 1
    return usable


@nb.njit(cache=True)
def _evict_window(st, i, o, size, on_demand):
    """Evict the occupants of [o, o + size) (each becomes a free segment in place)."""
    seg, ten = st.seg, st.ten
    seg_off, seg_tensor = seg.off, seg.tensor  # not reallocated: safe across _evict
    k = _seg_find(seg, o)
    while k < seg.count and seg_off[k] < o + size:
        v = seg_tensor[k]
        if v != _NONE:
            _advance(ten.cursor, ten.use_ptr, ten.use_pos, v, i)
            _evict(st, v, k, i - 1 if on_demand else ten.last_use[v])
            k = _seg_find(seg, o)  # merging may have shifted segments
            continue
        k += 1


@nb.njit(cache=True)
def _occupy(seg, ten, t, o, size, produced):
    """Make the free segments over [o, o + size) one segment holding t. Returns when the
    window is free for t: (after which position, after which swap-out key, estimated time),
    counting t's own swap-out unless the op makes it."""
    k0 = _seg_find(seg, o)
    avail = ten.release[t] if not produced else -1
    wait_key = ten.out_key[t] if not produced else -1
    ready = 0.0 if produced else ten.out_end[t]
    seg_off, free_after, seg_wait_key, free_at = (seg.off, seg.free_after, seg.wait_key,
                                                  seg.free_at)
    k = k0
    while k < seg.count and seg_off[k] < o + size:
        avail = max(avail, free_after[k])
        wait_key = max(wait_key, seg_wait_key[k])
        ready = max(ready, free_at[k])
        k += 1
    k1 = k - 1
    seg_end = seg.off[k1] + seg.size[k1]
    lfp, ldk, lrt = seg.free_after[k0], seg.wait_key[k0], seg.free_at[k0]
    rfp, rdk, rrt = seg.free_after[k1], seg.wait_key[k1], seg.free_at[k1]
    left_off = seg.off[k0]
    _seg_remove(seg, k0, k1)
    kk = k0
    if left_off < o:
        _seg_insert(seg, kk, left_off, o - left_off, _NONE, lfp, ldk, lrt)
        kk += 1
    _seg_insert(seg, kk, o, size, t, -1, -1, 0.0)
    kk += 1
    if seg_end > o + size:
        _seg_insert(seg, kk, o + size, seg_end - o - size, _NONE, rfp, rdk, rrt)
    return avail, wait_key, ready


@nb.njit(cache=True)
def _swap_in(st, t, i, q, avail, wait_key, ready, nr):
    """Record the swap-in of t into residency nr, issued after position q (at the earliest
    once the window is free); return its estimated end."""
    if q == _ASAP:
        q = avail
    q = max(q, avail)
    ins = st.ins
    nh = ins.count
    ins.tensor[nh] = t
    ins.after[nh] = q
    ins.before[nh] = i
    ins.wait_key[nh] = wait_key
    ins.valid[nh] = True
    st.res.begin[nr] = q + 1
    st.res.swap_in[nr] = nh
    ins.count = nh + 1
    issue = st.est[q] if q >= 0 else 0.0
    s = max(st.h2d_free, ready, issue)
    st.h2d_free = s + st.ten.xin[t]
    return st.h2d_free


@nb.njit(cache=True)
def _cancel(st, rr):
    """Undo residency rr (and its swap-in): its window is free again as it was before."""
    res = st.res
    t = res.tensor[rr]
    res.valid[rr] = False
    if res.swap_in[rr] >= 0:
        st.ins.valid[res.swap_in[rr]] = False
    st.ten.resident[t] = False
    _seg_free(st.seg, _seg_find(st.seg, res.offset[rr]), res.free_after[rr], res.wait_key[rr],
              res.free_at[rr])


# ---------------------------------------------------------------- simulation
@nb.njit(cache=True, nogil=True)
def fifo_orders(h_q, h_r, h_valid, h_stream, d_p, big):
    """Stream orders: swap-outs by issue position, swap-ins by the position that needs them
    (earliest deadline first), their issue positions raised so the IR order is that order.
    A split op's streamed inputs (`h_stream`) are issued by the op itself, after every other
    copy issued before it: they come last among the swap-ins its position needs, and the
    swap-ins after them are issued after the op.
    Takes the swap-ins' issue positions, needing positions, validity and streaming and the
    swap-outs' issue positions; returns (d2h order, h2d order, final h2d issue positions)."""
    nd = d_p.shape[0]
    dkey = np.empty(nd, np.int64)
    for e in range(nd):
        dkey[e] = d_p[e] * big + e
    d_order = np.argsort(dkey, kind="mergesort")
    idx = np.nonzero(h_valid)[0]
    hkey = np.empty(idx.shape[0], np.int64)
    span = h_r.shape[0] + 1
    for j in range(idx.shape[0]):
        hkey[j] = (h_r[idx[j]] * 2 + h_stream[idx[j]]) * span + idx[j]
    h_order = idx[np.argsort(hkey, kind="mergesort")]
    q_final = h_q.copy()
    prev = -1
    stream_at = -1  # the split op whose streamed inputs came last
    for j in range(h_order.shape[0]):
        e = h_order[j]
        low = prev
        if stream_at >= 0 and not (h_stream[e] and h_r[e] == stream_at):
            low = max(low, stream_at)
        q_final[e] = max(h_q[e], low)
        prev = q_final[e]
        if h_stream[e]:
            stream_at = h_r[e]
    return d_order, h_order, q_final


@nb.njit(cache=True)
def _after_wait(ready, wait, sync):
    """When a stream that is free at `ready` can go on past an event at `wait`: at once if the
    event is over, else `sync` after it (the stalled stream is woken)."""
    return wait + sync if wait > ready else ready


@nb.njit(cache=True)
def _hand_over(free, clock, link):
    """A copy handed at `clock` to a stream free from `free`: (when the copy starts, when the
    compute stream is free again). A busy stream takes it when done; an idle one wakes, the
    slower the longer it was idle."""
    if free > clock:
        return free, clock
    idle = clock - free
    start = clock + np.interp(idle, link.wake_idle, link.wake_start)
    return start, clock + np.interp(idle, link.wake_idle, link.wake_issue)


@nb.njit(cache=True)
def _d2h_span(e, s, d_free, d_p, d_bytes, d_stream, op_s, op_e, dur_pos, chunks_pos, link):
    """(start, end) of swap-out e, its stream free from `s`: a split op's output streams from
    its first chunk's end, one copy (and one latency) per chunk, and ends a chunk's copy after
    the op at the earliest."""
    xfer = link.d2h_lat + d_bytes[e] / link.d2h_bw
    if not d_stream[e]:
        return s, s + xfer
    p = d_p[e]
    c = chunks_pos[p]
    s = max(d_free, op_s[p] + dur_pos[p] / c)
    return s, max(s + xfer + (c - 1) * link.d2h_lat,
                  op_e[p] + link.d2h_lat + d_bytes[e] / c / link.d2h_bw)


@nb.njit(cache=True)
def _h2d_end(e, s, h_bytes, h_stream, h_r, chunks_pos, link):
    """The end of swap-in e, started at s: a split op's streamed input is a copy per chunk,
    each paying the link's latency."""
    end = s + link.h2d_lat + h_bytes[e] / link.h2d_bw
    if h_stream[e]:
        end += (chunks_pos[h_r[e]] - 1) * link.h2d_lat
    return end


@nb.njit(cache=True)
def _h2d_usable(e, s, end, h_bytes, h_stream, h_r, chunks_pos, last_in, link):
    """When the op needing swap-in e can use it (started at s, over at end): a split op's
    streamed input once its first chunk is in (its last chunk noted in `last_in`)."""
    if not h_stream[e]:
        return end
    last_in[h_r[e]] = max(last_in[h_r[e]], end)
    return s + link.h2d_lat + h_bytes[e] / chunks_pos[h_r[e]] / link.h2d_bw


@nb.njit(cache=True, nogil=True)
def simulate(dur_pos, d_p, d_bytes, d_order, h_q, h_r, h_dep, h_bytes, h_order, op_wait,
             link, big, chunks_pos, h_stream, d_stream):
    """Three streams: compute runs ops in position order; d2h and h2d run their copies in
    FIFO order. A d2h (issued after position d_p) starts after the op it follows; an h2d
    (issued after h_q, needed at h_r) after the op it is issued after and the d2h h_dep; an op
    after its swap-ins and the d2h op_wait. Dependencies name d2h events by key.
    The compute stream issues the copies after the op they follow (swap-outs first, then
    swap-ins, as the pass emits them; those at the start before op 0): a copy to an idle
    stream costs it time and starts after a delay, both growing with how long the stream
    was idle (`_hand_over`); a stream that stalls on another's event resumes `link.sync` after it
    (`_after_wait`).
    A split op (`chunks_pos` > 0) pipelines its streamed copies (a copy per chunk, each paying
    the link's latency) with its chunks: it starts once
    the first chunk of each input (`h_stream`) is in and ends no sooner than a chunk's compute
    after the last; each output's stream (`d_stream`) starts after the first chunk's compute
    and ends no sooner than a chunk's copy after the op.
    Each stream's order must have non-decreasing issue positions (the IR order).
    Returns a Timeline."""
    n = dur_pos.shape[0]
    op_s = np.zeros(n)
    op_e = np.zeros(n)
    op_r = np.zeros(n)
    nd = d_p.shape[0]
    d_s = np.zeros(nd)
    d_e = np.zeros(nd)
    nh = h_q.shape[0]
    h_s = np.zeros(nh)
    h_e = np.zeros(nh)
    ready = np.zeros(n + 1)
    last_in = np.zeros(n + 1)  # a split op's last streamed chunk in
    pd = 0
    ph = 0
    d_free = 0.0
    h_free = 0.0
    clock = 0.0  # the compute stream: free from here on
    for i in range(n + 1):
        while pd < nd and d_p[d_order[pd]] < i:
            e = d_order[pd]
            s, clock = _hand_over(d_free, clock, link)
            d_s[e], d_e[e] = _d2h_span(e, s, d_free, d_p, d_bytes, d_stream, op_s, op_e,
                                       dur_pos, chunks_pos, link)
            d_free = d_e[e]
            pd += 1
        if i == n:
            break
        while ph < h_order.shape[0] and h_q[h_order[ph]] < i:
            e = h_order[ph]
            s, clock = _hand_over(h_free, clock, link)
            if h_dep[e] >= 0:
                s = _after_wait(s, d_e[h_dep[e] % big], link.sync)
            h_s[e] = s
            h_e[e] = _h2d_end(e, s, h_bytes, h_stream, h_r, chunks_pos, link)
            h_free = h_e[e]
            ready[h_r[e]] = max(ready[h_r[e]], _h2d_usable(e, s, h_e[e], h_bytes, h_stream, h_r,
                                                           chunks_pos, last_in, link))
            ph += 1
        wait = ready[i]
        if op_wait[i] >= 0:
            wait = max(wait, d_e[op_wait[i] % big])
        op_r[i] = clock
        op_s[i] = _after_wait(clock, wait, link.sync)
        op_e[i] = op_s[i] + dur_pos[i]
        if chunks_pos[i] > 0:
            op_e[i] = max(op_e[i], last_in[i] + dur_pos[i] / chunks_pos[i])
        clock = op_e[i]
    return Timeline(op_s, op_e, d_s, d_e, h_s, h_e, op_r, clock)
