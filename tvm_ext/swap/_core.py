"""Compiled hot loops of the swap planners (numba): swap derivation and the three-stream
simulation. Plain integer/float arrays in and out; `derive.py` and `simulator.py` wrap them.

Positions are places in the schedule: op `order[i]` runs at position i. The device memory for
planned tensors is one arena of `arena` bytes (256-aligned); a tensor occupies a contiguous,
aligned window of it for each residency interval.

Derivation walks the schedule once. At each position the op's needs are locked; each one not
resident gets a window. A window's cost depends on the policy (`mode`):
  * SWAPADVISOR: the link time of evicting its occupants and bringing them back (weight beta),
    the stall that bringing them back before their next use would cause, a Belady term
    favouring occupants used furthest in the future (weight delta), and the stall of the new
    tensor itself if its window frees too late to prefetch it in time (weight gamma). Evicted
    tensors leave right after their last use; a swap-in is issued as soon as its window is free
    (after the last use, and the swap-out, of everything that occupied it).
  * LRU: evict the window whose occupants were least recently used; swaps happen on demand,
    right before the op that needs the tensor (no prefetch).
  * VDNN: LRU on demand, plus the vDNN policy: forward activations that the backward pass reads
    are offloaded right after their last forward use and prefetched one op ahead of their use.
If no window avoids the op's other needs (fragmentation), every need of the op is evicted and
the op's working set is packed from offset 0, which always fits once the budget is feasible.
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
def _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k0, k1):
    """Delete segments k0..k1 (inclusive); return the new count."""
    cnt = k1 - k0 + 1
    for k in range(k1 + 1, ns):
        seg_off[k - cnt] = seg_off[k]
        seg_size[k - cnt] = seg_size[k]
        seg_t[k - cnt] = seg_t[k]
        seg_fp[k - cnt] = seg_fp[k]
        seg_dk[k - cnt] = seg_dk[k]
    return ns - cnt


@nb.njit(cache=True)
def _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k, off, size, t, fp, dk):
    for j in range(ns, k, -1):
        seg_off[j] = seg_off[j - 1]
        seg_size[j] = seg_size[j - 1]
        seg_t[j] = seg_t[j - 1]
        seg_fp[j] = seg_fp[j - 1]
        seg_dk[j] = seg_dk[j - 1]
    seg_off[k] = off
    seg_size[k] = size
    seg_t[k] = t
    seg_fp[k] = fp
    seg_dk[k] = dk
    return ns + 1


@nb.njit(cache=True)
def _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k, fp, dk):
    """Mark segment k free (ready after position fp and d2h key dk) and merge free
    neighbours; return the new count."""
    seg_t[k] = _NONE
    seg_fp[k] = fp
    seg_dk[k] = dk
    if k + 1 < ns and seg_t[k + 1] == _NONE:
        seg_size[k] += seg_size[k + 1]
        seg_fp[k] = max(seg_fp[k], seg_fp[k + 1])
        seg_dk[k] = max(seg_dk[k], seg_dk[k + 1])
        ns = _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k + 1, k + 1)
    if k > 0 and seg_t[k - 1] == _NONE:
        seg_size[k - 1] += seg_size[k]
        seg_fp[k - 1] = max(seg_fp[k - 1], seg_fp[k])
        seg_dk[k - 1] = max(seg_dk[k - 1], seg_dk[k])
        ns = _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k, k)
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
           offload_after):
    """Swap derivation for one schedule; see the module docstring.

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
    # Arena segments, sorted by offset, covering [0, arena).
    seg_off = np.zeros(2 * cap + 4, np.int64)
    seg_size = np.zeros(2 * cap + 4, np.int64)
    seg_t = np.full(2 * cap + 4, _NONE, np.int64)
    seg_fp = np.full(2 * cap + 4, -1, np.int64)
    seg_dk = np.full(2 * cap + 4, -1, np.int64)
    seg_size[0] = arena
    ns = 1
    # Tensor state.
    resident = np.zeros(n_t, np.bool_)
    offset = np.zeros(n_t, np.int64)
    host_copy = host_start.copy()
    last_use = np.full(n_t, -1, np.int64)
    release = np.full(n_t, -1, np.int64)  # position after which its last residency ended
    own_d2h = np.full(n_t, -1, np.int64)  # key of the tensor's swap-out
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
    r_valid = np.zeros(cap, np.bool_)
    nr = 0
    h_t = np.empty(cap, np.int64)
    h_q = np.empty(cap, np.int64)
    h_r = np.empty(cap, np.int64)
    h_dep = np.empty(cap, np.int64)
    h_valid = np.zeros(cap, np.bool_)
    nh = 0
    d_t = np.empty(n_t + 1, np.int64)
    d_p = np.empty(n_t + 1, np.int64)
    nd = 0
    op_wait = np.full(n, -1, np.int64)
    fallbacks = 0
    step_res = np.empty(cap, np.int64)
    needs = np.empty(cap, np.int64)

    for i in range(n):
        op = order[i]
        m = 0
        for k in range(need_ptr[op], need_ptr[op + 1]):
            t = need_idx[k]
            if not fixed[t]:
                needs[m] = t
                m += 1
                locked[t] = i
        # Largest first: fewer fragmentation failures.
        srt = np.argsort(-sizes[needs[:m]], kind="mergesort")
        on_demand = mode != SWAPADVISOR
        attempt = 0
        while True:
            n_step = 0
            failed = False
            for jj in range(m):
                t = needs[srt[jj]]
                if resident[t]:
                    continue
                size = sizes[t]
                produced = prod_pos[t] == i
                if not produced and not host_copy[t]:
                    raise ValueError("a tensor is needed before it was produced")
                best_cost = np.inf
                best_o = -1
                if attempt == 0:
                    for s in range(ns):
                        for variant in range(2):
                            if variant == 0:
                                o = seg_off[s]
                            else:
                                o = seg_off[s] + seg_size[s] - size
                                if o == seg_off[s] or o < 0:
                                    continue
                            if o + size > arena:
                                continue
                            k = s if variant == 0 else _seg_find(seg_off, ns, o)
                            cost = 0.0
                            avail = release[t] if not produced else -1
                            wait_key = own_d2h[t] if not produced else -1
                            maxlu = -2
                            victims_bytes = 0
                            ok = True
                            while k < ns and seg_off[k] < o + size:
                                v = seg_t[k]
                                if v == _NONE:
                                    avail = max(avail, seg_fp[k])
                                    wait_key = max(wait_key, seg_dk[k])
                                else:
                                    if locked[v] == i:
                                        ok = False
                                        break
                                    lu = last_use[v]
                                    maxlu = max(maxlu, lu)
                                    victims_bytes += sizes[v]
                                    if mode == SWAPADVISOR:
                                        avail = max(avail, lu)
                                        c = cursor[v]
                                        while c < use_ptr[v + 1] and use_pos[c] < i:
                                            c += 1
                                        nu = use_pos[c] if c < use_ptr[v + 1] else n
                                        out_v = 0.0 if host_copy[v] else xout[v]
                                        in_v = xin[v] if nu < n else 0.0
                                        stall_v = 0.0
                                        if nu < n:
                                            stall_v = max(0.0, T[i] + out_v + in_v - T[nu])
                                        cost += (beta * (in_v + out_v) + stall_v
                                                 + delta * in_v * n / (nu - i + 1.0))
                                    else:
                                        avail = max(avail, i - 1)
                                if mode == SWAPADVISOR and cost >= best_cost:
                                    ok = False
                                    break
                                k += 1
                            if not ok:
                                continue
                            if mode == SWAPADVISOR:
                                ready = T[avail + 1]
                                need_in = 0.0 if produced else xin[t]
                                cost += gamma * max(0.0, ready + need_in - T[i])
                                # Tie-break: keep free space in large pieces.
                                cost += 1e-15 * victims_bytes
                            else:
                                cost = (maxlu + 2) * 1e12 + victims_bytes / (arena + 1.0)
                            if cost < best_cost:
                                best_cost = cost
                                best_o = o
                else:
                    # Fallback: pack the op's needs from offset 0 in size order.
                    best_o = 0
                    for j2 in range(jj):
                        best_o += sizes[needs[srt[j2]]]
                if best_o < 0:
                    failed = True
                    break
                # Evict the window's occupants and carve it out.
                o = best_o
                k0 = _seg_find(seg_off, ns, o)
                avail = release[t] if not produced else -1
                wait_key = own_d2h[t] if not produced else -1
                k = k0
                while k < ns and seg_off[k] < o + size:
                    v = seg_t[k]
                    if v != _NONE:
                        # Evict v.
                        p = i - 1 if on_demand else last_use[v]
                        c = cursor[v]
                        while c < use_ptr[v + 1] and use_pos[c] < i:
                            c += 1
                        cursor[v] = c
                        future = c < use_ptr[v + 1] or is_output[v]
                        dk = -1
                        if future and not host_copy[v]:
                            d_t[nd] = v
                            d_p[nd] = p
                            dk = p * big + nd
                            own_d2h[v] = dk
                            nd += 1
                            host_copy[v] = True
                        resident[v] = False
                        release[v] = p
                        r_end[cur_res[v]] = p
                        seg_t[k] = _NONE
                        seg_fp[k] = p
                        seg_dk[k] = dk
                    avail = max(avail, seg_fp[k])
                    wait_key = max(wait_key, seg_dk[k])
                    k += 1
                k1 = k - 1
                left_end = seg_off[k1] + seg_size[k1]
                lfp, ldk = seg_fp[k0], seg_dk[k0]
                rfp, rdk = seg_fp[k1], seg_dk[k1]
                left_off = seg_off[k0]
                ns = _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k0, k1)
                kk = k0
                if left_off < o:
                    ns = _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, kk,
                                     left_off, o - left_off, _NONE, lfp, ldk)
                    kk += 1
                ns = _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, kk, o, size, t,
                                 -1, -1)
                kk += 1
                if left_end > o + size:
                    ns = _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, kk, o + size,
                                     left_end - o - size, _NONE, rfp, rdk)
                resident[t] = True
                offset[t] = o
                r_t[nr] = t
                r_off[nr] = o
                r_end[nr] = i
                r_wait[nr] = wait_key
                r_avail[nr] = avail
                r_valid[nr] = True
                if produced:
                    r_begin[nr] = i
                    r_h2d[nr] = -1
                    op_wait[i] = max(op_wait[i], wait_key)
                else:
                    q = i - 1 if on_demand else avail
                    h_t[nh] = t
                    h_q[nh] = q
                    h_r[nh] = i
                    h_dep[nh] = wait_key
                    h_valid[nh] = True
                    r_begin[nr] = q + 1
                    r_h2d[nr] = nh
                    nh += 1
                cur_res[t] = nr
                step_res[n_step] = nr
                n_step += 1
                nr += 1
            if not failed:
                break
            # Undo this step's placements, evict every need of the op, and pack them.
            fallbacks += 1
            for j2 in range(n_step):
                rr = step_res[j2]
                t = r_t[rr]
                r_valid[rr] = False
                if r_h2d[rr] >= 0:
                    h_valid[r_h2d[rr]] = False
                s = _seg_find(seg_off, ns, r_off[rr])
                resident[t] = False
                ns = _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, s, r_avail[rr],
                               r_wait[rr])
            for jj in range(m):
                t = needs[jj]
                if resident[t]:
                    p = last_use[t]
                    if not host_copy[t]:
                        d_t[nd] = t
                        d_p[nd] = p
                        own_d2h[t] = p * big + nd
                        nd += 1
                        host_copy[t] = True
                    resident[t] = False
                    release[t] = p
                    r_end[cur_res[t]] = p
                    s = _seg_find(seg_off, ns, offset[t])
                    ns = _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, s, p,
                                   own_d2h[t] if seg_dk[s] < 0 else max(seg_dk[s], own_d2h[t]))
            op_wait[i] = -1
            attempt = 1
            for jj in range(m):
                # The packed windows may overlap other tensors: the main loop evicts them.
                locked[needs[jj]] = i
        # vDNN: prefetch the next op's offloaded inputs one op ahead.
        if mode == VDNN and i + 1 < n:
            nxt = order[i + 1]
            for k2 in range(need_ptr[nxt], need_ptr[nxt + 1]):
                t = need_idx[k2]
                if fixed[t] or resident[t] or prod_pos[t] == i + 1 or offload_after[t] < 0:
                    continue
                size = sizes[t]
                best_cost = np.inf
                best_o = -1
                for s in range(ns):
                    o = seg_off[s]
                    if o + size > arena:
                        continue
                    k = s
                    maxlu = -2
                    ok = True
                    while k < ns and seg_off[k] < o + size:
                        v = seg_t[k]
                        if v != _NONE:
                            if locked[v] >= i:
                                ok = False
                                break
                            maxlu = max(maxlu, last_use[v])
                        k += 1
                    if ok and (maxlu + 2) < best_cost:
                        best_cost = maxlu + 2
                        best_o = o
                if best_o < 0:
                    continue
                o = best_o
                k0 = _seg_find(seg_off, ns, o)
                avail = release[t]
                wait_key = own_d2h[t]
                k = k0
                while k < ns and seg_off[k] < o + size:
                    v = seg_t[k]
                    if v != _NONE:
                        p = i - 1
                        c = cursor[v]
                        while c < use_ptr[v + 1] and use_pos[c] < i:
                            c += 1
                        cursor[v] = c
                        future = c < use_ptr[v + 1] or is_output[v]
                        dk = -1
                        if future and not host_copy[v]:
                            d_t[nd] = v
                            d_p[nd] = p
                            dk = p * big + nd
                            own_d2h[v] = dk
                            nd += 1
                            host_copy[v] = True
                        resident[v] = False
                        release[v] = p
                        r_end[cur_res[v]] = p
                        seg_t[k] = _NONE
                        seg_fp[k] = p
                        seg_dk[k] = dk
                    avail = max(avail, seg_fp[k])
                    wait_key = max(wait_key, seg_dk[k])
                    k += 1
                k1 = k - 1
                left_end = seg_off[k1] + seg_size[k1]
                rfp, rdk = seg_fp[k1], seg_dk[k1]
                ns = _seg_remove(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k0, k1)
                ns = _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k0, o, size, t,
                                 -1, -1)
                if left_end > o + size:
                    ns = _seg_insert(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, k0 + 1,
                                     o + size, left_end - o - size, _NONE, rfp, rdk)
                q = max(i - 1, avail)
                resident[t] = True
                offset[t] = o
                locked[t] = i + 1
                r_t[nr] = t
                r_off[nr] = o
                r_end[nr] = i + 1
                r_wait[nr] = wait_key
                r_avail[nr] = avail
                r_valid[nr] = True
                h_t[nh] = t
                h_q[nh] = q
                h_r[nh] = i + 1
                h_dep[nh] = wait_key
                h_valid[nh] = True
                r_begin[nr] = q + 1
                r_h2d[nr] = nh
                nh += 1
                cur_res[t] = nr
                nr += 1
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
                s = _seg_find(seg_off, ns, offset[t])
                ns = _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, s, i, -1)
        # vDNN: offload forward activations after their last forward use.
        if mode == VDNN:
            for jj in range(m):
                t = needs[jj]
                if offload_after[t] == i and resident[t] and cursor[t] < use_ptr[t + 1]:
                    dk = -1
                    if not host_copy[t]:
                        d_t[nd] = t
                        d_p[nd] = i
                        dk = i * big + nd
                        own_d2h[t] = dk
                        nd += 1
                        host_copy[t] = True
                    resident[t] = False
                    release[t] = i
                    s = _seg_find(seg_off, ns, offset[t])
                    ns = _seg_free(seg_off, seg_size, seg_t, seg_fp, seg_dk, ns, s, i, dk)
    end_on_device = np.zeros(n_t, np.bool_)
    for t in range(n_t):
        if resident[t]:
            end_on_device[t] = True
            r_end[cur_res[t]] = n - 1
    return (r_t[:nr], r_off[:nr], r_begin[:nr], r_end[:nr], r_h2d[:nr], r_wait[:nr],
            r_valid[:nr], h_t[:nh], h_q[:nh], h_r[:nh], h_dep[:nh], h_valid[:nh], d_t[:nd],
            d_p[:nd], op_wait, end_on_device, fallbacks, big)


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
