"""Compiled hot loops of the swap planners (numba): swap derivation and the three-stream
simulation. Plain integer/float arrays in and out; `derive.py` and `simulator.py` wrap them.

Positions are places in the schedule: op `order[i]` runs at position i. The device memory for
planned tensors is one region of `arena` bytes; a tensor occupies a contiguous, 256-aligned
window of it for each residency interval. Two layouts: the arena (a window may start at any
aligned offset) and SwapAdvisor's size classes (the region is cut into `cls_count[c]` objects
of `cls_size[c]` bytes per class; a tensor may only occupy one object of its class).

Derivation walks the schedule once. At each position the op's needs are locked; each one not
resident gets a window. A window's cost depends on the policy (`mode`):
  * SWAPADVISOR: the link time of evicting its occupants and bringing them back (weight beta),
    the stall that bringing them back before their next use would cause, a Belady term
    favouring occupants used furthest in the future (weight delta), and how late the op would
    start because of this window (weight gamma): the window frees when its occupants' last
    ops end and their swap-outs finish, then the swap-in waits for the host-to-device link.
    Evicted tensors leave right after their last use; a swap-in is issued as soon as its
    window is free (after the last use, and the swap-out, of everything that occupied it).
  * LRU: evict the window whose occupants were least recently used; swaps happen on demand,
    right before the op that needs the tensor (no prefetch).
  * VDNN: LRU on demand, plus the vDNN policy: forward activations that the backward pass reads
    are offloaded right after their last forward use and prefetched one op ahead of their use.
Those times come from a running estimate of the iteration kept during the walk (`est`: end of
each op so far, `clock`: when each copy stream frees up), so choices see stalls and link load.
If no window avoids the op's other needs (arena fragmentation), every need of the op is
evicted and the op's working set is packed from offset 0, which always fits once the budget is
feasible.
"""

from __future__ import annotations

import numba as nb
import numpy as np

SWAPADVISOR, LRU, VDNN = 0, 1, 2
_NONE = -1


@nb.njit(cache=True)
def _xfer(nbytes, bw, lat):
    return lat + nbytes / bw


@nb.njit(cache=True)
def _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, ns, k0, k1):
    """Delete segments k0..k1 (inclusive); return the new count."""
    cnt = k1 - k0 + 1
    for k in range(k1 + 1, ns):
        seg_off[k - cnt] = seg_off[k]
        seg_size[k - cnt] = seg_size[k]
        seg_t[k - cnt] = seg_t[k]
        seg_fp[k - cnt] = seg_fp[k]
        seg_dk[k - cnt] = seg_dk[k]
        seg_rt[k - cnt] = seg_rt[k]
    return ns - cnt


@nb.njit(cache=True)
def _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, ns, k, off, size, t, fp,
                dk, rt):
    for j in range(ns, k, -1):
        seg_off[j] = seg_off[j - 1]
        seg_size[j] = seg_size[j - 1]
        seg_t[j] = seg_t[j - 1]
        seg_fp[j] = seg_fp[j - 1]
        seg_dk[j] = seg_dk[j - 1]
        seg_rt[j] = seg_rt[j - 1]
    seg_off[k] = off
    seg_size[k] = size
    seg_t[k] = t
    seg_fp[k] = fp
    seg_dk[k] = dk
    seg_rt[k] = rt
    return ns + 1


@nb.njit(cache=True)
def _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, ns, k, fp, dk, rt):
    """Mark segment k free (after position fp, d2h key dk, estimated time rt) and merge free
    neighbours; return the new count."""
    seg_t[k] = _NONE
    seg_fp[k] = fp
    seg_dk[k] = dk
    seg_rt[k] = rt
    if k + 1 < ns and seg_t[k + 1] == _NONE:
        seg_size[k] += seg_size[k + 1]
        seg_fp[k] = max(seg_fp[k], seg_fp[k + 1])
        seg_dk[k] = max(seg_dk[k], seg_dk[k + 1])
        seg_rt[k] = max(seg_rt[k], seg_rt[k + 1])
        ns = _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, ns, k + 1, k + 1)
    if k > 0 and seg_t[k - 1] == _NONE:
        seg_size[k - 1] += seg_size[k]
        seg_fp[k - 1] = max(seg_fp[k - 1], seg_fp[k])
        seg_dk[k - 1] = max(seg_dk[k - 1], seg_dk[k])
        seg_rt[k - 1] = max(seg_rt[k - 1], seg_rt[k])
        ns = _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, ns, k, k)
    return ns


@nb.njit(cache=True)
def _seg_find(seg_off, ns, off):
    """Index of the segment containing byte `off`."""
    lo, hi = 0, ns - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if seg_off[mid] <= off:
            lo = mid
        else:
            hi = mid - 1
    return lo


@nb.njit(cache=True)
def derive(order, need_ptr, need_idx, producer_op, sizes, host_start, fixed, is_output,
           durations, arena, h2d_bw, h2d_lat, d2h_bw, d2h_lat, mode, beta, gamma, delta,
           offload_after, obj_class, cls_base, cls_size, cls_count):
    """Swap derivation for one schedule; see the module docstring.

    Size-class layout: if obj_class[t] >= 0, t may only occupy one of the cls_count[c]
    objects of cls_size[c] bytes laid out from offset cls_base[c] (c = obj_class[t]).

    Returns the residency, swap-in (h2d) and swap-out (d2h) tables, per-position d2h waits,
    which tensors end on the device, and the number of fragmentation fallbacks.
    """
    n = order.shape[0]
    n_t = sizes.shape[0]
    big = n_t + 1  # d2h keys are position * big + event id: larger key = later in the FIFO
    pos_of_op = np.empty(n, np.int64)
    for i in range(n):
        pos_of_op[order[i]] = i
    # Uses of each tensor, as sorted positions.
    use_cnt = np.zeros(n_t + 1, np.int64)
    total = 0
    for i in range(n):
        op = order[i]
        for k in range(need_ptr[op], need_ptr[op + 1]):
            t = need_idx[k]
            if not fixed[t]:
                use_cnt[t + 1] += 1
                total += 1
    use_ptr = np.cumsum(use_cnt)
    use_pos = np.empty(max(total, 1), np.int64)
    fill = use_ptr[:-1].copy()
    for i in range(n):
        op = order[i]
        for k in range(need_ptr[op], need_ptr[op + 1]):
            t = need_idx[k]
            if not fixed[t]:
                use_pos[fill[t]] = i
                fill[t] += 1
    cursor = use_ptr[:-1].copy()
    prod_pos = np.full(n_t, -1, np.int64)
    for t in range(n_t):
        if producer_op[t] >= 0:
            prod_pos[t] = pos_of_op[producer_op[t]]
    T = np.zeros(n + 1)
    for i in range(n):
        T[i + 1] = T[i] + durations[order[i]]
    xin = np.empty(n_t)
    xout = np.empty(n_t)
    for t in range(n_t):
        xin[t] = _xfer(sizes[t], h2d_bw, h2d_lat)
        xout[t] = _xfer(sizes[t], d2h_bw, d2h_lat)

    cap = 3 * total + n_t + 4  # fallbacks and vDNN prefetches add residencies
    # Arena segments, sorted by offset, covering [0, arena): occupant (or _NONE), and for a
    # free segment the position after which it is free, the swap-out to wait for (key) and
    # the estimated time it is free.
    nseg = 2 * cap + 4
    seg_off = np.zeros(nseg, np.int64)
    seg_size = np.zeros(nseg, np.int64)
    seg_t = np.full(nseg, _NONE, np.int64)
    seg_fp = np.full(nseg, -1, np.int64)
    seg_dk = np.full(nseg, -1, np.int64)
    seg_rt = np.zeros(nseg)
    seg_size[0] = arena
    # Tensor state.
    resident = np.zeros(n_t, np.bool_)
    offset = np.zeros(n_t, np.int64)
    host_copy = host_start.copy()
    last_use = np.full(n_t, -1, np.int64)
    release = np.full(n_t, -1, np.int64)  # position after which its last residency ended
    own_d2h = np.full(n_t, -1, np.int64)  # key of the tensor's swap-out
    own_rt = np.zeros(n_t)  # estimated end of the tensor's swap-out
    cur_res = np.full(n_t, -1, np.int64)
    locked = np.full(n_t, -1, np.int64)
    # Output tables.
    r_t = np.empty(cap, np.int64)
    r_off = np.empty(cap, np.int64)
    r_begin = np.empty(cap, np.int64)
    r_end = np.empty(cap, np.int64)
    r_h2d = np.empty(cap, np.int64)
    r_wait = np.empty(cap, np.int64)  # d2h key to finish before the window is written
    r_avail = np.empty(cap, np.int64)
    r_rt = np.empty(cap)
    r_valid = np.zeros(cap, np.bool_)
    h_t = np.empty(cap, np.int64)
    h_q = np.empty(cap, np.int64)
    h_r = np.empty(cap, np.int64)
    h_dep = np.empty(cap, np.int64)
    h_valid = np.zeros(cap, np.bool_)
    d_t = np.empty(n_t + 1, np.int64)
    d_p = np.empty(n_t + 1, np.int64)
    op_wait = np.full(n, -1, np.int64)
    # Estimated end time of each position's op, and when each copy stream frees up: the
    # derivation runs a running simulation so that its choices see stalls and link load.
    est = np.zeros(n)
    clock = np.zeros(2)  # [d2h stream free, h2d stream free]
    # segments, residencies, swap-ins, swap-outs, fallbacks, most segments, placements
    cnt = np.zeros(7, np.int64)
    cnt[0] = 1
    step_res = np.empty(cap, np.int64)
    needs = np.empty(cap, np.int64)
    state = (seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, resident, offset, host_copy,
             last_use, release, own_d2h, own_rt, cur_res, locked, cursor, use_ptr, use_pos,
             is_output, r_t, r_off, r_begin, r_end, r_h2d, r_wait, r_avail, r_rt, r_valid,
             h_t, h_q, h_r, h_dep, h_valid, d_t, d_p, op_wait, est, clock, cnt, xin, xout)
    layout = (obj_class, cls_base, cls_size, cls_count)
    on_demand = mode != SWAPADVISOR

    for i in range(n):
        op = order[i]
        now = est[i - 1] if i > 0 else 0.0
        m = 0
        for k in range(need_ptr[op], need_ptr[op + 1]):
            t = need_idx[k]
            if not fixed[t]:
                needs[m] = t
                m += 1
                locked[t] = i
        # Largest first: fewer fragmentation failures.
        srt = np.argsort(-sizes[needs[:m]], kind="mergesort")
        start = now
        attempt = 0
        while True:
            n_step = 0
            failed = False
            start = now
            packed = 0
            for jj in range(m):
                t = needs[srt[jj]]
                if resident[t]:
                    continue
                size = sizes[t] if obj_class[t] < 0 else cls_size[obj_class[t]]
                produced = prod_pos[t] == i
                if not produced and not host_copy[t]:
                    raise ValueError("a tensor is needed before it was produced")
                if attempt == 0:
                    o = _best_window(state, layout, t, i, n, size, produced, arena, mode, beta,
                                     gamma, delta, T, now)
                elif obj_class[t] >= 0:
                    raise ValueError("a size class has fewer objects than an op needs")
                else:
                    o = packed  # fallback: pack the op's needs from offset 0
                packed += size
                if o < 0:
                    failed = True
                    break
                q = i - 1 if on_demand else -2
                ready = _place(state, t, i, o, size, produced, q, on_demand, now)
                cnt[5] = max(cnt[5], cnt[0])
                cnt[6] += 1
                start = max(start, ready)
                step_res[n_step] = cnt[1] - 1
                n_step += 1
            if not failed:
                break
            # Undo this step's placements, evict every need of the op, and pack them.
            cnt[4] += 1
            for j2 in range(n_step):
                _cancel(state, step_res[j2])
            for jj in range(m):
                t = needs[jj]
                if resident[t] and last_use[t] < r_begin[cur_res[t]]:
                    _cancel(state, cur_res[t])  # prefetched (vDNN), unused: cancel the fetch
                elif resident[t]:
                    _evict(state, t, _seg_find(seg_off, cnt[0], offset[t]), last_use[t])
            op_wait[i] = -1
            attempt = 1
        est[i] = start + durations[op]
        # vDNN: prefetch the next op's offloaded inputs one op ahead.
        if mode == VDNN and i + 1 < n:
            nxt = order[i + 1]
            for k2 in range(need_ptr[nxt], need_ptr[nxt + 1]):
                t = need_idx[k2]
                if fixed[t] or resident[t] or prod_pos[t] == i + 1 or offload_after[t] < 0:
                    continue
                size = sizes[t] if obj_class[t] < 0 else cls_size[obj_class[t]]
                o = _best_window(state, layout, t, i, n, size, False, arena, LRU, 0.0, 0.0, 0.0,
                                 T, now)
                if o >= 0:
                    _place(state, t, i + 1, o, size, False, i - 1, True, now)
                    locked[t] = i + 1
        # After the op: release what is dead, extend what lives on.
        for jj in range(m):
            t = needs[jj]
            last_use[t] = i
            r_end[cur_res[t]] = i
            c = cursor[t]
            while c < use_ptr[t + 1] and use_pos[c] <= i:
                c += 1
            cursor[t] = c
            if c == use_ptr[t + 1] and not is_output[t]:
                resident[t] = False
                release[t] = i
                s = _seg_find(seg_off, cnt[0], offset[t])
                cnt[0] = _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, cnt[0], s,
                                   i, -1, est[i])
        # vDNN: offload forward activations after their last forward use.
        if mode == VDNN:
            for jj in range(m):
                t = needs[jj]
                if offload_after[t] == i and resident[t] and cursor[t] < use_ptr[t + 1]:
                    _evict(state, t, _seg_find(seg_off, cnt[0], offset[t]), i)
    end_on_device = np.zeros(n_t, np.bool_)
    for t in range(n_t):
        if resident[t]:
            end_on_device[t] = True
            r_end[cur_res[t]] = n - 1
    nr, nh, nd = cnt[1], cnt[2], cnt[3]
    return (r_t[:nr], r_off[:nr], r_begin[:nr], r_end[:nr], r_h2d[:nr], r_wait[:nr],
            r_valid[:nr], h_t[:nh], h_q[:nh], h_r[:nh], h_dep[:nh], h_valid[:nh], d_t[:nd],
            d_p[:nd], op_wait, end_on_device, cnt[4], big, cnt[5], cnt[6])


@nb.njit(cache=True)
def _next_use(state, v, i, n):
    cursor, use_ptr, use_pos, is_output = state[15], state[16], state[17], state[18]
    c = cursor[v]
    while c < use_ptr[v + 1] and use_pos[c] < i:
        c += 1
    cursor[v] = c
    if c < use_ptr[v + 1]:
        return use_pos[c]
    return n if is_output[v] else -1


@nb.njit(cache=True)
def _evict(state, v, k, p):
    """Evict resident tensor v (segment k) whose residency ends after position p: swap it out
    after p if it has no host copy and is needed again (or returned)."""
    seg_off = state[0]
    seg_size = state[1]
    seg_t = state[2]
    seg_fp = state[3]
    seg_dk = state[4]
    seg_rt = state[5]
    resident = state[6]
    host_copy = state[8]
    release = state[10]
    own_d2h = state[11]
    own_rt = state[12]
    cur_res = state[13]
    cursor = state[15]
    use_ptr = state[16]
    is_output = state[18]
    r_end = state[22]
    d_t = state[33]
    d_p = state[34]
    est = state[36]
    clock = state[37]
    cnt = state[38]
    xout = state[40]
    big = host_copy.shape[0] + 1
    c = cursor[v]
    future = c < use_ptr[v + 1] or is_output[v]
    dk = -1
    rt = est[p] if p >= 0 else 0.0
    if future and not host_copy[v]:
        nd = cnt[3]
        d_t[nd] = v
        d_p[nd] = p
        dk = p * big + nd
        own_d2h[v] = dk
        s = max(clock[0], rt)
        clock[0] = s + xout[v]
        rt = clock[0]
        own_rt[v] = rt
        cnt[3] = nd + 1
        host_copy[v] = True
    resident[v] = False
    release[v] = p
    r_end[cur_res[v]] = p
    cnt[0] = _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, cnt[0], k, p, dk, rt)


@nb.njit(cache=True)
def _best_window(state, layout, t, i, n, size, produced, arena, mode, beta, gamma, delta, T,
                 now):
    """The offset of the cheapest window for t (see the module docstring), -1 if every
    window holds a tensor the op needs. Candidate windows start where a segment starts or
    end where one ends (arena), or are the objects of t's size class; a two-pointer sweep
    scores them all in time linear in the segments."""
    obj_class, cls_base, cls_size, cls_count = layout
    seg_off = state[0]
    seg_size = state[1]
    seg_t = state[2]
    seg_rt = state[5]
    host_copy = state[8]
    last_use = state[9]
    own_rt = state[12]
    locked = state[14]
    est = state[36]
    clock = state[37]
    cnt = state[38]
    xin = state[39]
    xout = state[40]
    ns = cnt[0]
    # Per segment: eviction cost, ready time (clean / dirty), swap-out time, lock, last use.
    vc = np.zeros(ns)
    rt_plain = np.full(ns, -np.inf)
    rt_dirty = np.full(ns, -np.inf)
    out = np.zeros(ns)
    lk = np.zeros(ns, np.int64)
    lu = np.full(ns, -2.0)
    vb = np.zeros(ns)
    for k in range(ns):
        v = seg_t[k]
        if v == _NONE:
            rt_plain[k] = seg_rt[k]
            continue
        if locked[v] >= i:
            lk[k] = 1
            continue
        luv = last_use[v]
        lu[k] = luv
        vb[k] = seg_size[k]
        rt = est[luv] if luv >= 0 else 0.0
        if mode != SWAPADVISOR:
            rt_plain[k] = max(rt, now)
            continue
        nu = _next_use(state, v, i, n)
        out_v = 0.0
        if not host_copy[v] and nu >= 0:
            out_v = xout[v]
            rt_dirty[k] = rt
            out[k] = out_v
        else:
            rt_plain[k] = rt
        if 0 <= nu < n:
            in_v = xin[v]
            vc[k] = (beta * (in_v + out_v) + max(0.0, out_v + in_v - (T[nu] - T[i]))
                     + delta * in_v * n / (nu - i + 1.0))
        else:
            vc[k] = beta * out_v
    base_ready = 0.0 if produced else own_rt[t]
    best_cost = np.inf
    best_o = -1
    dq_p = np.empty(ns, np.int64)  # sliding-window maxima (indices, values decreasing)
    dq_d = np.empty(ns, np.int64)
    dq_l = np.empty(ns, np.int64)
    c = obj_class[t]
    passes = 2 if c < 0 else 1
    cand = np.empty(max(ns, cls_count[c] if c >= 0 else 0), np.int64)
    for variant in range(passes):
        nc = 0
        if c >= 0:
            for j in range(cls_count[c]):
                cand[nc] = cls_base[c] + j * cls_size[c]
                nc += 1
        else:
            for k in range(ns):
                o = seg_off[k] if variant == 0 else seg_off[k] + seg_size[k] - size
                if variant == 1 and o == seg_off[k]:
                    continue
                cand[nc] = o
                nc += 1
        hp = tp = hd = td = hl = tl = 0
        b = 0
        e = -1  # window covers segments b..e
        s_vc = 0.0
        s_out = 0.0
        s_lk = 0
        s_vb = 0.0
        for ci in range(nc):
            o = cand[ci]
            if o < 0 or o + size > arena:
                continue
            # Advance the end pointer over segments starting before o + size.
            while e + 1 < ns and seg_off[e + 1] < o + size:
                e += 1
                s_vc += vc[e]
                s_out += out[e]
                s_lk += lk[e]
                s_vb += vb[e]
                while tp > hp and rt_plain[dq_p[tp - 1]] <= rt_plain[e]:
                    tp -= 1
                dq_p[tp] = e
                tp += 1
                while td > hd and rt_dirty[dq_d[td - 1]] <= rt_dirty[e]:
                    td -= 1
                dq_d[td] = e
                td += 1
                while tl > hl and lu[dq_l[tl - 1]] <= lu[e]:
                    tl -= 1
                dq_l[tl] = e
                tl += 1
            # Advance the start pointer past segments ending at or before o.
            while b <= e and seg_off[b] + seg_size[b] <= o:
                s_vc -= vc[b]
                s_out -= out[b]
                s_lk -= lk[b]
                s_vb -= vb[b]
                if hp < tp and dq_p[hp] == b:
                    hp += 1
                if hd < td and dq_d[hd] == b:
                    hd += 1
                if hl < tl and dq_l[hl] == b:
                    hl += 1
                b += 1
            if s_lk > 0:
                continue
            if mode == SWAPADVISOR:
                ready = base_ready
                if hp < tp:
                    ready = max(ready, rt_plain[dq_p[hp]])
                if s_out > 0.0:
                    ready = max(ready, max(clock[0], rt_dirty[dq_d[hd]]) + s_out)
                if produced:
                    late = ready - now
                else:
                    late = max(ready, clock[1]) + xin[t] - now
                # Tie-break: evict fewer bytes.
                cost = s_vc + gamma * max(0.0, late) + 1e-15 * s_vb
            else:
                maxlu = lu[dq_l[hl]] if hl < tl else -2.0
                cost = (maxlu + 2.0) * 1e12 + s_vb / (arena + 1.0)
            if cost < best_cost:
                best_cost = cost
                best_o = o
                if cost <= 0.0:
                    return best_o  # a free window, ready in time: nothing can beat it
    return best_o


@nb.njit(cache=True)
def _place(state, t, i, o, size, produced, q, on_demand, now):
    """Evict the occupants of [o, o + size), put t there for position i (produced by the op
    there, or swapped in after position q; q = -2: as early as the window allows). Returns
    the estimated time the op at i can use it."""
    seg_off = state[0]
    seg_size = state[1]
    seg_t = state[2]
    seg_fp = state[3]
    seg_dk = state[4]
    seg_rt = state[5]
    resident = state[6]
    offset = state[7]
    host_copy = state[8]
    last_use = state[9]
    release = state[10]
    own_d2h = state[11]
    own_rt = state[12]
    cur_res = state[13]
    r_t = state[19]
    r_off = state[20]
    r_begin = state[21]
    r_end = state[22]
    r_h2d = state[23]
    r_wait = state[24]
    r_avail = state[25]
    r_rt = state[26]
    r_valid = state[27]
    h_t = state[28]
    h_q = state[29]
    h_r = state[30]
    h_dep = state[31]
    h_valid = state[32]
    op_wait = state[35]
    est = state[36]
    clock = state[37]
    cnt = state[38]
    xin = state[39]
    k0 = _seg_find(seg_off, cnt[0], o)
    k = k0
    # Evict the occupants (each becomes a free segment in place).
    while k < cnt[0] and seg_off[k] < o + size:
        v = seg_t[k]
        if v != _NONE:
            _next_use(state, v, i, host_copy.shape[0] + 10**9)
            _evict(state, v, k, i - 1 if on_demand else last_use[v])
            k = _seg_find(seg_off, cnt[0], o)  # merging may have shifted segments
            continue
        k += 1
    k0 = _seg_find(seg_off, cnt[0], o)
    avail = release[t] if not produced else -1
    wait_key = own_d2h[t] if not produced else -1
    ready = 0.0 if produced else own_rt[t]
    k = k0
    while k < cnt[0] and seg_off[k] < o + size:
        avail = max(avail, seg_fp[k])
        wait_key = max(wait_key, seg_dk[k])
        ready = max(ready, seg_rt[k])
        k += 1
    k1 = k - 1
    seg_end = seg_off[k1] + seg_size[k1]
    lfp, ldk, lrt = seg_fp[k0], seg_dk[k0], seg_rt[k0]
    rfp, rdk, rrt = seg_fp[k1], seg_dk[k1], seg_rt[k1]
    left_off = seg_off[k0]
    ns = _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, cnt[0], k0, k1)
    kk = k0
    if left_off < o:
        ns = _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, ns, kk, left_off,
                         o - left_off, _NONE, lfp, ldk, lrt)
        kk += 1
    ns = _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, ns, kk, o, size, t, -1,
                     -1, 0.0)
    kk += 1
    if seg_end > o + size:
        ns = _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, ns, kk, o + size,
                         seg_end - o - size, _NONE, rfp, rdk, rrt)
    cnt[0] = ns
    resident[t] = True
    offset[t] = o
    nr = cnt[1]
    r_t[nr] = t
    r_off[nr] = o
    r_end[nr] = i
    r_wait[nr] = wait_key
    r_avail[nr] = avail
    r_rt[nr] = ready
    r_valid[nr] = True
    if produced:
        r_begin[nr] = i
        r_h2d[nr] = -1
        op_wait[i] = max(op_wait[i], wait_key)
        usable = ready
    else:
        if q == -2:
            q = avail
        q = max(q, avail)
        nh = cnt[2]
        h_t[nh] = t
        h_q[nh] = q
        h_r[nh] = i
        h_dep[nh] = wait_key
        h_valid[nh] = True
        r_begin[nr] = q + 1
        r_h2d[nr] = nh
        cnt[2] = nh + 1
        issue = est[q] if q >= 0 else 0.0
        s = max(clock[1], ready, issue)
        clock[1] = s + xin[t]
        usable = clock[1]
    cur_res[t] = nr
    cnt[1] = nr + 1
    return usable


@nb.njit(cache=True)
def _cancel(state, rr):
    """Undo residency rr (and its swap-in): its window is free again as it was before."""
    seg_off = state[0]
    seg_size = state[1]
    seg_t = state[2]
    seg_fp = state[3]
    seg_dk = state[4]
    seg_rt = state[5]
    resident = state[6]
    r_t = state[19]
    r_off = state[20]
    r_h2d = state[23]
    r_wait = state[24]
    r_avail = state[25]
    r_rt = state[26]
    r_valid = state[27]
    h_valid = state[32]
    cnt = state[38]
    t = r_t[rr]
    r_valid[rr] = False
    if r_h2d[rr] >= 0:
        h_valid[r_h2d[rr]] = False
    resident[t] = False
    s = _seg_find(seg_off, cnt[0], r_off[rr])
    cnt[0] = _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, seg_rt, cnt[0], s, r_avail[rr],
                       r_wait[rr], r_rt[rr])


@nb.njit(cache=True)
def fifo_orders(h_q, h_r, h_valid, d_p, big):
    """Stream orders: swap-outs by issue position, swap-ins by the position that needs them
    (earliest deadline first), their issue positions raised so the IR order is that order."""
    nd = d_p.shape[0]
    dkey = np.empty(nd, np.int64)
    for e in range(nd):
        dkey[e] = d_p[e] * big + e
    d_order = np.argsort(dkey, kind="mergesort")
    idx = np.nonzero(h_valid)[0]
    hkey = np.empty(idx.shape[0], np.int64)
    for j in range(idx.shape[0]):
        hkey[j] = h_r[idx[j]] * (h_r.shape[0] + 1) + idx[j]
    h_order = idx[np.argsort(hkey, kind="mergesort")]
    q_final = h_q.copy()
    prev = -1
    for j in range(h_order.shape[0]):
        e = h_order[j]
        q_final[e] = max(h_q[e], prev)
        prev = q_final[e]
    return d_order, h_order, q_final


@nb.njit(cache=True)
def simulate(dur_pos, d_p, d_bytes, d_order, h_q, h_r, h_dep, h_bytes, h_order, op_wait,
             h2d_bw, h2d_lat, d2h_bw, d2h_lat, big):
    """Three streams: compute runs ops in position order; d2h and h2d run their copies in
    FIFO order. A d2h starts after the op it follows; an h2d after the op it is issued after
    and the d2h it depends on; an op after its swap-ins and the d2h it waits for.
    Each stream's order must have non-decreasing issue positions (the IR order).
    Dependencies name d2h events by key (position * big + id).
    Returns (op start, op end, d2h start/end by event id, h2d start/end by event id)."""
    n = dur_pos.shape[0]
    op_s = np.zeros(n)
    op_e = np.zeros(n)
    nd = d_p.shape[0]
    d_s = np.zeros(nd)
    d_e = np.zeros(nd)
    nh = h_q.shape[0]
    h_s = np.zeros(nh)
    h_e = np.zeros(nh)
    ready = np.zeros(n + 1)
    pd = 0
    ph = 0
    d_free = 0.0
    h_free = 0.0
    prev = 0.0
    for i in range(n + 1):
        while pd < nd and d_p[d_order[pd]] < i:
            e = d_order[pd]
            s = max(d_free, op_e[d_p[e]])
            d_s[e] = s
            d_e[e] = s + d2h_lat + d_bytes[e] / d2h_bw
            d_free = d_e[e]
            pd += 1
        if i == n:
            break
        while ph < h_order.shape[0] and h_q[h_order[ph]] < i:
            e = h_order[ph]
            s = h_free
            if h_q[e] >= 0:
                s = max(s, op_e[h_q[e]])
            if h_dep[e] >= 0:
                s = max(s, d_e[h_dep[e] % big])
            h_s[e] = s
            h_e[e] = s + h2d_lat + h_bytes[e] / h2d_bw
            h_free = h_e[e]
            ready[h_r[e]] = max(ready[h_r[e]], h_e[e])
            ph += 1
        s = max(prev, ready[i])
        if op_wait[i] >= 0:
            s = max(s, d_e[op_wait[i] % big])
        op_s[i] = s
        op_e[i] = s + dur_pos[i]
        prev = op_e[i]
    return op_s, op_e, d_s, d_e, h_s, h_e
