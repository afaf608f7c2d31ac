"""Operator splitting in time: an op whose working set does not fit runs as a sequence of chunks
along one of its dims, its big inputs and outputs streamed through the device a chunk at a time.

What an op may be split along comes from the kernel's TIR (`tvm_ext.ir.time_splits`, the
partitioner's index analysis): a `SplitOption` is a dim that cuts an axis of some inputs and
leaves the other inputs whole. Either it cuts an axis of every output too, with no reduction
over it, so that the chunks of the output are independent (outputs concatenated), or
(`accumulate`) every output is reduced over it with an update the kernel states (sum, max,
min, product): no output is cut, each stays whole on the device and every chunk after the
first adds its part to it (its init starts from the output's value), so the sum runs in another
order where the kernel's schedule reorders it (the output within float tolerance). A kernel
that reduces into intermediates and computes its outputs from them (`epilogue`: a bias add, a
mean's division) adds up the intermediates so and finishes once after the last chunk. Chunk j of
a tensor cut along its leading axis is one contiguous byte range of it; along a later axis its
bytes are strided (`strided`), copied in and out row by row. A split may also cut a second,
outer dim (`outer_dim`: a batch) into its finest items, each run in the inner dim's chunks (a
convolution split by images and rows at once): chunk j is inner chunk j % inner of outer item
j // inner, a chunk of a tensor an inner chunk of one item's bytes (strided: copied, not
viewed), its halo rows one item's. Chunk buffers sit at aligned offsets; a chunk of a cut
input kept on the device is read in place, so only chunk counts that start its chunks at
aligned offsets allow that.

An op that overwrites tensors in place (an optimizer's update) splits only where each chunk
reads only the slice it writes (`SplitOption.in_place_safe`): each tensor it overwrites is a cut
input and a cut output, chunk j the same byte range both ways, so its chunks stream in from its
host buffer and back into it, and no chunk reads bytes an earlier chunk's copy out wrote.

A split op streams: its cut inputs come from their host copies (a tensor made on the device is
copied out first, if it is not already on the host), chunk by chunk, into chunk buffers, and its
cut outputs leave chunk by chunk, from chunk buffers, into the output's host copy: after the op
the output is on the host only. With two buffers per cut tensor the next chunk is copied in (and
the previous one out) while the current one is computed; with one, chunk after chunk, each copy
in its turn: half the memory, no overlap. Its working set on the device is its whole inputs plus
`scratch_bytes`: `buffers` chunks of every cut tensor. `choose_splits` splits exactly the ops
that do not fit the memory the plan has for them, each the way that fits and that
`estimated_seconds` finds fastest: every chunk is one more kernel call and one more copy per
streamed tensor, so that is the fewest chunks that fit with two buffers, unless fewer chunks
with one buffer are faster; `finest_working_set` is what an op needs at the finest split with
one buffer, which sets the smallest feasible budget.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .alignment import ALIGNMENT, align


@dataclasses.dataclass(frozen=True)
class SplitOption:
    """One dim an op may be split along (see the module docstring)."""

    dim: int  # the dim's index in the kernel's analysis
    divisor: int  # chunk counts must divide it
    cut_inputs: tuple[int, ...]  # base tensors read a leading-axis chunk at a time
    whole_inputs: tuple[int, ...]  # base tensors read whole by every chunk
    cut_outputs: tuple[int, ...]  # base tensors written a leading-axis chunk at a time
    # Cut inputs kept on the device for the whole call: chunks are views of them, not streams.
    viewed_inputs: tuple[int, ...] = ()
    # (cut input, its bytes unaligned): a chunk kept on the device is read in place only at an
    # aligned offset; streamed chunks may start anywhere. Empty: the aligned sizes.
    cut_bytes: tuple[tuple[int, int], ...] = dataclasses.field(default=(), compare=False)
    # Cut tensors whose chunks are strided (cut along an axis after one that is not 1): copied
    # in and out row by row, never read in place.
    strided: tuple[int, ...] = dataclasses.field(default=(), compare=False)
    # A reduction dim: the outputs stay whole and every chunk adds its part to them.
    accumulate: bool = False
    # An accumulating split of a kernel that reduces into intermediates and computes its
    # outputs from them (`tvm_ext.ir.epilogue_kernels`): the chunks add up the intermediates,
    # the epilogue runs once after the last; `epilogue_bytes` of intermediates stay on the
    # device while the op runs (0: they are the outputs' own buffers, finished in place).
    epilogue: bool = False
    epilogue_bytes: int = 0
    # (cut input, bytes of its halo rows): a dim read through windows (a convolution's rows)
    # reads each chunk's input range with rows of its neighbours (`tvm_ext.ir.halo_chunks`);
    # such inputs are streamed, never read in place.
    halo_bytes: tuple[tuple[int, int], ...] = ()
    # A second dim cut into `outer_chunks` items (every cut tensor along its axis 0), each run
    # in chunks of `dim`: the chunk counts are multiples of `outer_chunks`. -1: none.
    outer_dim: int = -1
    outer_chunks: int = 1

    def in_place_safe(self, written) -> bool:
        """Whether chunk after chunk of an op that overwrites the base tensors `written` in
        place reads only what it writes: each is cut as an input and as an output, along the
        leading axis (chunk j the same byte range of it both ways), read whole nowhere, and
        the chunks are independent (no reduction, halo or outer dim). Chunk j's copy in then
        reads bytes no earlier chunk's copy out wrote."""
        written = set(written)
        return written <= set(self.cut_inputs) and written <= set(self.cut_outputs) and \
            not written & (set(self.whole_inputs) | set(self.strided)) and \
            not (self.accumulate or self.epilogue or self.halo_bytes) and self.outer_dim < 0

    def inner_chunks(self, chunks: int) -> int:
        """The chunks of `dim` in each outer item of a split in `chunks` chunks."""
        return chunks // self.outer_chunks

    def on_device(self, fixed) -> SplitOption | None:
        """This option where the `fixed` tensors stay on the device: its cut inputs among them
        are read as views of their device copies instead of streamed; None when one of them
        has strided chunks (no view reads those) or is also a cut output (an update in place:
        its chunks would leave for the host, where a tensor kept on the device has none)."""
        viewed = tuple(t for t in self.cut_inputs if fixed[t])
        if not viewed:
            return self
        if set(viewed) & (set(self.strided) | set(self.cut_outputs)):
            return None
        return dataclasses.replace(self, cut_inputs=tuple(t for t in self.cut_inputs
                                                          if not fixed[t]),
                                   viewed_inputs=viewed)

    def to_list(self) -> list:
        """[dim, divisor, cut inputs, whole inputs, cut outputs, [[cut input, bytes], ...],
        strided, accumulate, epilogue, epilogue bytes, [[cut input, halo bytes], ...], outer dim,
        outer chunks]."""
        return [self.dim, self.divisor, list(self.cut_inputs), list(self.whole_inputs),
                list(self.cut_outputs), [list(pair) for pair in self.cut_bytes],
                list(self.strided), self.accumulate, self.epilogue, self.epilogue_bytes,
                [list(pair) for pair in self.halo_bytes], self.outer_dim, self.outer_chunks]

    @classmethod
    def from_list(cls, data) -> SplitOption:
        dim, divisor, cut_in, whole_in, cut_out, *rest = data
        pairs = tuple((int(t), int(n)) for t, n in (rest[0] if rest else ()))
        strided = tuple(int(t) for t in (rest[1] if len(rest) > 1 else ()))
        accumulate = bool(rest[2]) if len(rest) > 2 else False
        epilogue = bool(rest[3]) if len(rest) > 3 else False
        epilogue_bytes = int(rest[4]) if len(rest) > 4 else 0
        halo = tuple((int(t), int(n)) for t, n in (rest[5] if len(rest) > 5 else ()))
        outer_dim = int(rest[6]) if len(rest) > 6 else -1
        outer_chunks = int(rest[7]) if len(rest) > 7 else 1
        return cls(int(dim), int(divisor), tuple(cut_in), tuple(whole_in), tuple(cut_out),
                   cut_bytes=pairs, strided=strided, accumulate=accumulate,
                   epilogue=epilogue, epilogue_bytes=epilogue_bytes, halo_bytes=halo,
                   outer_dim=outer_dim, outer_chunks=outer_chunks)


def chunk_kernel_name(kernel: str, chunks: int, dim: int, accumulating: bool = False,
                      epilogue: bool = False, outer_dim: int = -1) -> str:
    """The name of the kernel that computes one of `chunks` chunks of `kernel` split along its
    dim `dim` (and its dim `outer_dim`, when that is not -1) (what a trace of the swapped
    module calls); `accumulating`: the kernel of the chunks after the first of a split that
    accumulates, which adds to the outputs; `epilogue`: the kernel that finishes such a split's
    outputs after its last chunk."""
    base = f"{kernel}_chunk{chunks}_d{dim}" + (f"_o{outer_dim}" if outer_dim >= 0 else "")
    if epilogue:
        return base + "_epilogue"
    return base + ("_acc" if accumulating else "")


def chunk_bytes(nbytes: int, chunks: int) -> int:
    """Bytes of one chunk buffer of a tensor of `nbytes` (aligned like every window)."""
    return align(-(-int(nbytes) // chunks))


def tensor_chunk_bytes(option: SplitOption, tensor: int, nbytes: int, chunks: int) -> int:
    """Bytes of one chunk buffer of a cut tensor of `nbytes` (its halo rows included)."""
    return align(-(-int(nbytes) // chunks) + dict(option.halo_bytes).get(tensor, 0))


def scratch_bytes(sizes, option: SplitOption, chunks: int, buffers: int = 2) -> int:
    """The chunk buffers of a split, `buffers` per cut tensor, and its epilogue's
    intermediates."""
    return sum(buffers * tensor_chunk_bytes(option, t, sizes[t], chunks)
               for t in (*option.cut_inputs, *option.cut_outputs)) + option.epilogue_bytes


def chunk_counts(option: SplitOption, sizes) -> list[int]:
    """The chunk counts an option allows (more than one), fewest first: divisors of its
    divisor (chunks of whole rows of every cut tensor) whose chunks of the cut inputs kept on
    the device start at aligned offsets (streamed chunks are copied from anywhere); with an
    outer dim, each such count times the outer items."""
    if option.outer_dim >= 0:  # its cut tensors are strided: never viewed
        return [option.outer_chunks * c for c in _divisors(option.divisor)]
    if not option.viewed_inputs:
        return list(_divisors(option.divisor))
    nbytes = dict(option.cut_bytes)
    return [c for c in _divisors(option.divisor)
            if all(nbytes.get(t, int(sizes[t])) % (c * ALIGNMENT) == 0
                   for t in option.viewed_inputs)]


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of `n` above 1, increasing (the search asks for the same few divisors
    again and again: a vocabulary's, a batch's)."""
    small = [d for d in range(2, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if n // d != d]
    return tuple(small + large + ([n] if n > 1 else []))


def working_set(sizes, needs, fixed, option: SplitOption, chunks: int,
                buffers: int = 2) -> int:
    """Device bytes an op needs while it runs split so, besides the `fixed` tensors: its needs
    but the cut tensors, plus the chunk buffers (`option` as `on_device(fixed)` gives it)."""
    cut = {*option.cut_inputs, *option.cut_outputs}
    rest = sum(int(sizes[t]) for t in needs if t not in cut and not fixed[t])
    return rest + scratch_bytes(sizes, option, chunks, buffers)


def finest_working_set(sizes, needs, fixed, options) -> int | None:
    """The least working set of any split of an op (its finest chunks, one buffer each);
    None: no split."""
    best = None
    for option in (o.on_device(fixed) for o in options):
        if option is None:
            continue
        counts = chunk_counts(option, sizes)
        if counts:
            ws = working_set(sizes, needs, fixed, option, counts[-1], 1)
            best = ws if best is None else min(best, ws)
    return best


def largest_working_set(problem, fixed) -> tuple[int, int]:
    """(the most any op needs in the pools besides the `fixed` tensors, split in time where
    that needs less (`finest_working_set`); the op that needs it, -1 when there are no ops).
    Ops are visited largest whole working set first, and the visit stops at the first whose
    whole working set is less than the largest found (a split never needs more); of ops that
    need as much, the first."""
    whole = problem.whole_working_sets(fixed)
    options = problem.split_options()
    best, best_op = -1, -1
    for op in np.argsort(-whole, kind="stable"):
        op = int(op)
        if whole[op] < best:
            break
        finest = finest_working_set(problem.sizes, problem.needs(op), fixed, options[op])
        ws = int(whole[op]) if finest is None else min(int(whole[op]), finest)
        if ws > best or (ws == best and op < best_op):
            best, best_op = ws, op
    return max(best, 0), best_op


def choose_splits(problem, room: int, fixed) -> dict[int, tuple[SplitOption, int, int]]:
    """{op: (option, chunks, buffers)} for every op whose needs (not `fixed`) exceed `room`
    bytes: per option and buffer count, the fewest chunks that fit (each chunk more is a kernel
    call and a copy per streamed tensor more, and a smaller kernel); of those, the one
    `estimated_seconds` finds fastest (ties: the least scratch, then the fewest chunks). Ops
    that cannot fit either way are left whole (the caller refuses the budget)."""
    out: dict[int, tuple[SplitOption, int, int]] = {}
    options = problem.split_options()
    for op in np.nonzero(problem.whole_working_sets(fixed) > room)[0].tolist():
        needs = problem.needs(op)
        best = None
        for option in (o.on_device(fixed) for o in options[op]):
            if option is None:
                continue
            counts = chunk_counts(option, problem.sizes)
            for b in (2, 1):
                chunks = next((c for c in counts if working_set(
                    problem.sizes, needs, fixed, option, c, b) <= room), None)
                if chunks is None:
                    continue
                key = (estimated_seconds(problem, op, option, chunks, b),
                       scratch_bytes(problem.sizes, option, chunks, b), chunks)
                if best is None or key < best[0]:
                    best = (key, option, chunks, b)
        if best is not None:
            out[op] = best[1:]
    return out


def _chunk_in_seconds(problem, option: SplitOption, chunks: int) -> float:
    """A chunk of each streamed cut input copied in (its halo rows too), one after another."""
    halo = dict(option.halo_bytes)
    return sum(problem.transfer_time(problem.sizes[t] / chunks + halo.get(t, 0), "h2d")
               for t in option.cut_inputs)


def _chunk_out_seconds(problem, option: SplitOption, chunks: int) -> float:
    """A chunk of each cut output copied out, one after another."""
    return sum(problem.transfer_time(problem.sizes[t] / chunks, "d2h")
               for t in option.cut_outputs)


def chunk_copy_seconds(problem, option: SplitOption, chunks: int) -> float:
    """The copies of one chunk, one after another: a chunk of each streamed cut input in and
    of each cut output out, each a copy paying the link's latency."""
    return _chunk_in_seconds(problem, option, chunks) + \
        _chunk_out_seconds(problem, option, chunks)


def added_seconds(problem, option: SplitOption, chunks: int, buffers: int) -> float:
    """Compute-stream time a split adds to its op's work: each chunk after the first is one
    more kernel call (`launch_overhead`) that issues a copy per streamed cut tensor
    (`copy_issue`); with one buffer per cut tensor each also waits for its copies (its
    chunk in, the previous chunk out) and resumes `sync_latency` after them."""
    extra = chunks - 1
    copies = len(option.cut_inputs) + len(option.cut_outputs)
    seconds = extra * (problem.launch_overhead + copies * problem.copy_issue)
    if option.epilogue:  # one more kernel after the last chunk
        seconds += problem.launch_overhead
    if buffers == 1 and copies:
        seconds += extra * (chunk_copy_seconds(problem, option, chunks) + problem.sync_latency)
    return seconds


def estimated_seconds(problem, op: int, option: SplitOption, chunks: int,
                      buffers: int) -> float:
    """How long op `op` takes split so, from its first chunk's copies to its last chunk's
    (the chooser's estimate; the simulator times the plan): its work plus `added_seconds`,
    and with two buffers no less than its input stream (a copy per chunk) and a chunk's work
    after it."""
    work = float(problem.durations[op]) + added_seconds(problem, option, chunks, buffers)
    first_in = _chunk_in_seconds(problem, option, chunks)
    last_out = _chunk_out_seconds(problem, option, chunks)
    if buffers > 1:
        halo = dict(option.halo_bytes)
        stream = sum(problem.transfer_time(problem.sizes[t] + chunks * halo.get(t, 0), "h2d")
                     + (chunks - 1) * problem.h2d_latency for t in option.cut_inputs)
        return max(first_in + work, stream + work / chunks) + last_out
    return first_in + work + last_out
