"""Multi-level layouts of tensors and the collectives that convert between them (no IR).

The k devices form a mesh of levels `mesh = (p_1, ..., p_L)` with `prod(p) = k`, level 1
outermost (the slowest links); device `(c_1, ..., c_L)`. At each level a tensor is replicated
(`REP`) or cut along one axis (an int >= 0). Index convention (what a pass must implement):
along an axis of extent n, index i has mesh digits `digit_l(i)`: the mixed-radix digits of
`i // (n / (p_1 * ... * p_m))` in radices `(p_1, ..., p_m)`, level 1 most significant, m the
deepest level cutting the axis; a device holds the indices whose digit at every level that
cuts the axis equals its coordinate there. When the cutting levels are 1..m the device holds one
contiguous block; otherwise a strided set of blocks. This convention makes every conversion at
one level a collective among the p_l devices that differ only in c_l, whatever the other
levels hold.

An operator input edge converts the tensor's stored scheme into the scheme the operator's
strategy requires (`Req`: an axis, possibly with halo rows, or REP); an output edge converts the
produced scheme (`PARTIAL` after a reduction split) into the stored one. Per level:

| from \\ to       | REP          | cut a                  |
| --------------- | ------------ | ---------------------- |
| REP             | -            | slice (free)           |
| cut a           | allgather    | - (halo exchange)      |
| cut b           | allgather    | all_to_all (+ halo)    |
| PARTIAL         | allreduce    | reduce_scatter         |

Conversions of one edge run level by level in three phases (shrinking: slices and
reduce-scatters; size-preserving: all-to-alls, allreduces, halos; growing: allgathers), deepest
level first within a phase, so each works on the smallest data: at level l the group holds
`nbytes / prod(p_m for other levels m whose current scheme is a cut)`. Allreduces at several
levels are one hierarchical allreduce (reduce-scatter inward, allreduce, allgather outward): the
step at level l works on the data divided by the deeper allreduced levels, and counts both its
reduce-scatter and its allgather, so the total equals a flat ring allreduce over all of them.
A level not decided yet (`None`, during the top-down search) counts as cut, the assumption of
Tofu's recursion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..cost.collectives import collective_bytes, collective_steps
from ..cost.hardware import Link

REP = -1
PARTIAL = -2

_PHASE = {"slice": 0, "reduce_scatter": 0, "all_to_all": 1, "allreduce": 1, "halo": 1,
          "allgather": 2}


@dataclasses.dataclass(frozen=True)
class Req:
    """What an operator needs of an input at one level: REP, or cut `axis` with halo rows."""

    axis: int
    halo_lo: int = 0
    halo_hi: int = 0


REQ_REP = Req(REP)


@dataclasses.dataclass(frozen=True)
class Step:
    """One collective of a conversion."""

    level: int
    kind: str  # see tvm_ext.cost.collectives.COLLECTIVES
    src: int  # scheme before (REP, PARTIAL or an axis)
    dst: int  # scheme after
    group_bytes: float  # data the level's group holds between them
    bytes: float  # sent per device
    rounds: int  # message rounds (each pays the link latency)
    time: float  # seconds on the link's bandwidth
    latency: float  # seconds of link latency (rounds * latency)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def conversion_kind(src: int, dst: int, halo: int = 0) -> str | None:
    """The collective turning scheme `src` into `dst` at one level (None: nothing to do)."""
    if src == PARTIAL:
        return "allreduce" if dst == REP else "reduce_scatter"
    if dst == REP:
        return None if src == REP else "allgather"
    if src == REP:
        return "slice"
    if src == dst:
        return "halo" if halo else None
    return "all_to_all"


def is_cut(scheme: int | None) -> bool:
    """Unknown levels count as cut (Tofu's even-split assumption)."""
    return scheme is None or scheme >= 0


def edge_steps(
    nbytes: int,
    shape: Sequence[int],
    mesh: Sequence[int],
    links: Sequence[Link],
    src: Sequence[int | None],
    dst: Sequence[Req | int | None],
) -> list[Step]:
    """The collectives converting `src` into `dst` (one scheme per level) on one edge.

    `dst` holds `Req`s for an input edge (halo known) or plain schemes for an output edge.
    Levels with `None` on either side are undecided: no step, and counted as cut.
    """
    levels = len(mesh)
    kinds: list[str | None] = []
    targets: list[int | None] = []
    halos: list[int] = []
    for m in range(levels):
        d = dst[m]
        if isinstance(d, Req):
            target, halo = d.axis, d.halo_lo + d.halo_hi
        else:
            target, halo = d, 0
        targets.append(target)
        halos.append(halo)
        s = src[m]
        kinds.append(None if s is None or target is None else conversion_kind(s, target, halo))
    steps = []
    for lvl in range(levels):
        kind = kinds[lvl]
        if kind is None or kind == "slice":
            continue
        phase = _PHASE[kind]
        group = float(nbytes)
        axis = targets[lvl] if targets[lvl] is not None and targets[lvl] >= 0 else src[lvl]
        axis_extent = shape[axis] if axis is not None and axis >= 0 else 0
        for m in range(levels):
            if m == lvl:
                continue
            if kinds[m] is None:
                now = src[m] if src[m] is not None else targets[m]
            elif kind == "allreduce" and kinds[m] == "allreduce":
                # A hierarchical allreduce: reduce-scatter the deeper levels first, allreduce
                # the piece, allgather back (the mirrored allgather is counted here too).
                now = 0 if m > lvl else PARTIAL
            else:
                done = _PHASE[kinds[m]] < phase or (_PHASE[kinds[m]] == phase and m > lvl)
                now = targets[m] if done else src[m]
            if is_cut(now):
                group /= mesh[m]
                if now is not None and now == axis:
                    axis_extent //= mesh[m]
        p = mesh[lvl]
        if kind == "halo" or (kind == "all_to_all" and halos[lvl]):
            row = group / axis_extent if axis_extent else 0.0
            halo_bytes = halos[lvl] * row
            sent = halo_bytes + (collective_bytes("all_to_all", p, group)
                                 if kind == "all_to_all" else 0.0)
            rounds = collective_steps("halo", p) + (collective_steps("all_to_all", p)
                                                    if kind == "all_to_all" else 0)
        else:
            sent = collective_bytes(kind, p, group)
            rounds = collective_steps(kind, p)
        link = links[lvl]
        rounds = rounds if sent > 0 else 0
        steps.append(Step(lvl, kind, int(src[lvl]), int(targets[lvl]), group, sent, rounds,
                          sent / link.bandwidth, rounds * link.latency))
    return steps


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One collective (or local slice) of a conversion, as a lowering runs it."""

    level: int | None  # None: one collective over every device (each level does the same)
    kind: str  # slice, reduce_scatter, all_to_all, allreduce, allgather
    before: tuple[int, ...]  # the scheme of every level before the step
    after: tuple[int, ...]  # and after it


def conversion_sequence(src: Sequence[int], dst: Sequence[int],
                        combiners: Sequence[str] | None = None) -> list[Conversion]:
    """The steps turning schemes `src` into `dst` (one per level; `dst` without PARTIAL), in
    the execution order of `edge_steps` (shrinking, size-preserving, growing; deepest level
    first). When every level does the same allreduce (one combiner) or gathers the same axis,
    one collective over all devices does it. This is the order
    `tvm_ext.passes.PartitionOperators` emits, and what the plan's memory accounting counts."""
    levels = len(src)
    kinds = {lvl: k for lvl in range(levels)
             if (k := conversion_kind(src[lvl], dst[lvl])) is not None}
    if not kinds:
        return []
    before = tuple(int(s) for s in src)
    after = tuple(int(d) for d in dst)
    if levels > 0 and len(kinds) == levels and len(set(kinds.values())) == 1:
        kind = kinds[0]
        same = combiners is None or len(set(combiners)) == 1
        if (kind == "allreduce" and same) or (kind == "allgather" and len(set(before)) == 1):
            return [Conversion(None, kind, before, after)]
    steps = []
    cur = list(before)
    for lvl in sorted(kinds, key=lambda m: (_PHASE[kinds[m]], -m)):
        nxt = list(cur)
        nxt[lvl] = after[lvl]
        steps.append(Conversion(lvl, kinds[lvl], tuple(cur), tuple(nxt)))
        cur = nxt
    return steps


def local_shape(shape: Sequence[int], mesh: Sequence[int], layout: Sequence[int]) -> tuple:
    """The shape of one device's piece of a tensor stored with `layout`."""
    out = list(shape)
    for p, scheme in zip(mesh, layout, strict=True):
        if scheme >= 0:
            out[scheme] //= p
    return tuple(out)


def split_factor(mesh: Sequence[int], layout: Sequence[int | None]) -> int:
    """How many pieces a layout cuts a tensor into."""
    f = 1
    for p, scheme in zip(mesh, layout, strict=True):
        if is_cut(scheme):
            f *= p
    return f


def factorize(k: int) -> list[int]:
    """Prime factors of k, largest first (k = 12 -> [3, 2, 2])."""
    if k < 1:
        raise ValueError(f"the number of devices must be at least 1, got {k}")
    factors, n, f = [], k, 2
    while f * f <= n:
        while n % f == 0:
            factors.append(f)
            n //= f
        f += 1
    if n > 1:
        factors.append(n)
    return sorted(factors, reverse=True)
