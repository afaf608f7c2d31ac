"""Ops run in chunks (`tvm_ext.swap.split`): each chunk's kernel (`local_kernel`, made once per
kernel and split) on chunk buffers in the split's window, the cut inputs copied in a chunk at
a time (with two buffers the next chunk's copy is issued before the current chunk computes) and
the cut outputs copied out, a chunk of a reshape view cut from its base's bytes, a chunk along a
later axis copied row by row and a window of rows with its halo copied whole. A reduction split
along the dim it reduces keeps its outputs whole: the first chunk's kernel starts them, every
later chunk's (`<kernel>_chunkN_dD_acc`, outputs passed twice) adds to them, and an epilogue
after the reduction (`<kernel>_chunkN_dD_epilogue`) runs once after the last chunk."""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_ext.ir.accumulating_kernels import accumulating_kernel, output_params
from tvm_ext.ir.epilogue_kernels import reduction_epilogue
from tvm_ext.ir.halo_chunks import chunk_rows
from tvm_ext.ir.kernel_cost import buffer_bytes
from tvm_ext.ir.kernel_dims import kernel_dims
from tvm_ext.ir.local_kernels import LoweringError, chunk_params, has_halo, local_kernel
from tvm_ext.runtime import swap_calls
from tvm_ext.swap.alignment import align
from tvm_ext.swap.split import chunk_kernel_name, tensor_chunk_bytes

from .emission import D2H, H2D, Emission, SwapOffloadError


class ChunkedOps:
    """Emits the ops the plan splits in time, and makes their chunk kernels."""

    def __init__(self, em: Emission):
        self.em = em
        # Shortcuts to what does not change during a rewrite.
        self.g, self.plan, self.bindings, self.mod, self.bb = \
            em.g, em.plan, em.bindings, em.mod, em.bb
        self.emit, self.value_of = em.emit, em.value_of
        self.chunk_kernels: dict[tuple, tuple] = {}  # (kernel, dim, chunks, adds) -> (gv, PrimFunc)
        # kernel -> its KernelDims; (kernel, dim, "epilogue") -> its ReductionEpilogue
        self.analyses: dict = {}

    def split_op(self, sp, residencies: list[int]) -> None:
        """An op run in chunks (`tvm_ext.swap.split`): its cut inputs come in from their host
        copies a chunk at a time into its buffers (with two, the next chunk is copied while
        the current one is read), its cut outputs leave for their host copies from its
        buffers, and the chunk kernel runs once per chunk with its chunk's index. A split that
        accumulates writes its outputs whole into their windows (`residencies`): chunk 0's
        kernel starts them, every later chunk's adds to them; with an epilogue they add up
        its intermediates, and the epilogue runs once after the last chunk."""
        g = self.g
        op = g.ops[sp.op]
        value = self.bindings[sp.op].value
        self.em.wait_swap_out(sp.wait_swap_out)
        cut_in, cut_out = set(sp.cut_inputs), set(sp.cut_outputs)
        offset = [sp.offset]
        axis = self._cut_axes(op, sp)
        halos = self._halos(op, sp)

        def buffers(tid: int) -> list:
            pair, offset[0] = self._chunk_buffers(sp, tid, axis[tid], halos.get(tid), offset[0])
            return pair

        # One pair per tensor, also where the op reads it twice; copied in the plan's stream
        # order (its cut inputs' order).
        ins: dict[int, list] = {}
        for tid in sorted((t for t in op.inputs if g.base(t) in cut_in),
                          key=lambda t: list(sp.cut_inputs).index(g.base(t))):
            if tid not in ins:
                ins[tid] = buffers(tid)
        viewed = {tid for tid in op.inputs if g.base(tid) in set(sp.viewed_inputs)}
        outs = [] if sp.accumulate else [buffers(tid) for tid in op.outputs]
        whole = self._place_whole_outputs(op, residencies) if sp.accumulate else []
        # What the chunks add up: the outputs, or an epilogue's intermediates (in the outputs'
        # own buffers where the epilogue finishes in place, else after the chunk buffers).
        epilogue = self._epilogue(op, sp) if sp.epilogue else None
        targets = whole if epilogue is None else \
            self._intermediates(epilogue, whole, sp, offset[0])
        for tid in cut_out:
            self.em.host_copy_of(tid)
        gv = self._chunk_kernel(op, sp)
        gv_rest = self._accumulating_chunk_kernel(op, sp) if sp.accumulate else gv
        index_params = self._new_chunk_params(op, sp)
        inner = sp.option().inner_chunks(sp.chunks)
        fields = value.args[1].fields if isinstance(value.args[1], relax.Tuple) \
            else [value.args[1]]
        nb = sp.buffers
        if offset[0] - sp.offset > sp.nbytes:
            raise SwapOffloadError(f"plan error: {op.name}'s chunk buffers take "
                                   f"{offset[0] - sp.offset} bytes, the plan has {sp.nbytes}")
        for tid, pair in ins.items():
            self._copy_chunk(tid, axis[tid], sp, 0, pair[0], H2D, halos.get(tid))
        for j in range(sp.chunks):
            b = j % nb
            for tid, pair in ins.items():
                if j > 0 and nb == 1:  # the buffer is free again: the kernel has run
                    self._copy_chunk(tid, axis[tid], sp, j, pair[0], H2D, halos.get(tid))
                if j + 1 < sp.chunks and nb == 2:
                    self._copy_chunk(tid, axis[tid], sp, j + 1, pair[1 - b], H2D,
                                     halos.get(tid))
                self.emit(swap_calls.wait_call(pair[b], H2D))
            if j >= nb:
                for pair in outs:  # its previous chunk has left
                    self.emit(swap_calls.wait_call(pair[b], D2H))
            args = self._chunk_args(op, fields, sp, j, {t: p[b] for t, p in ins.items()},
                                    viewed, axis)
            if epilogue is not None:  # the reduction part reads some of the inputs
                args = [args[k[1]] for k in epilogue.reduction.inputs]
            # The index of the chunk along the split dim (within its item, with an outer dim,
            # whose index no kernel takes).
            chunk = [relax.prim_value(tvm.tirx.IntImm("int64", j % inner))
                     for _ in range(index_params)]
            # Chunks after the first start from what the targets hold: passed as inputs.
            prev = targets if j > 0 else []
            self.emit(relax.Call(gv if j == 0 else gv_rest,
                                 [*args, *chunk, *prev, *(pair[b] for pair in outs), *targets]))
            for tid, pair in zip(op.outputs if outs else [], outs, strict=True):
                self._copy_chunk(tid, axis[tid], sp, j, pair[b], D2H)
        if epilogue is not None:
            self._finish(op, sp, epilogue, targets, whole)
        self._note_last_chunks_swapped_out(op, sp, outs)

    def _note_last_chunks_swapped_out(self, op, sp, outs: list) -> None:
        """A cut output's swap-out is done when its last chunk's copy is: later waits on the
        swap-out wait on that chunk buffer."""
        cut_out = set(sp.cut_outputs)
        # By base: an update in place writes a new value of the tensor it overwrites.
        bases = [self.g.base(tid) for tid in op.outputs]
        for k, s in enumerate(self.plan.swap_outs):
            if s.tensor in cut_out and s.after == sp.position:
                self.em.swapped_out_var[k] = outs[bases.index(s.tensor)][
                    (sp.chunks - 1) % sp.buffers]

    def _epilogue(self, op, sp):
        """`op`'s kernel cut after its reduction over the split dim (`epilogue_kernels`)."""
        key = (op.kernel, sp.dim, "epilogue")
        if key not in self.analyses:
            self.analyses[key] = reduction_epilogue(self._kernel_dims(op), sp.dim)
            if self.analyses[key] is None:
                raise SwapOffloadError(f"{op.name}: {op.kernel} has no epilogue after its "
                                       f"reduction over dim {sp.dim} to run once")
        return self.analyses[key]

    def _intermediates(self, epilogue, whole: list, sp, offset: int) -> list:
        """The buffers an epilogue split's chunks add up: the output's own where the
        epilogue finishes in place, else scratch placed after the chunk buffers."""
        if epilogue.in_place:
            return whole
        out = []
        for buf in output_params(epilogue.reduction.func, len(epilogue.reduction.outputs)):
            alloc = relax.op.memory.alloc_tensor(
                self.em.pools[sp.pool], relax.prim_value(offset),
                relax.ShapeExpr([int(n) for n in buf.ty.shape]), str(buf.ty.dtype))
            out.append(self.emit(relax.op.memory.ensure_zero_offset(self.emit(alloc))))
            offset += align(buffer_bytes(buf.ty.shape, buf.ty.dtype))
        return out

    def _finish(self, op, sp, epilogue, targets: list, whole: list) -> None:
        """After the last chunk: the epilogue computes the outputs from the intermediates
        (`targets`) and the inputs it reads whole, in place or into the outputs."""
        key = (op.kernel, sp.dim, sp.chunks, "epilogue")
        if key not in self.chunk_kernels:
            name = chunk_kernel_name(op.kernel, sp.chunks, sp.dim, epilogue=True,
                                     outer_dim=sp.outer_dim)
            kernel = epilogue.epilogue.func.with_attr("global_symbol", name)
            self.chunk_kernels[key] = (self.bb.add_func(kernel, name), kernel)
        # In place, the intermediate is the output's buffer: passed as both.
        made = dict(zip(epilogue.reduction.outputs, targets, strict=True))
        args = [made[k] if k[0] == "tmp" else self.value_of(op.inputs[k[1]])
                for k in epilogue.epilogue.inputs]
        self.emit(relax.Call(self.chunk_kernels[key][0], [*args, *whole]))

    def _chunk_args(self, op, fields, sp, j: int, buffers: dict, viewed: set,
                    axis: dict) -> list:
        """The arguments of chunk j's kernel call before its chunk indices: each cut input's
        chunk (its buffer now, or a view of it where it stays on the device), the other
        tensors whole, and the call's other arguments as they are."""
        inputs = iter(op.inputs)
        args = []
        for f in fields:
            if isinstance(f.ty, relax.TensorType):
                tid = next(inputs)
                if tid in viewed:  # kept on the device: chunk j is a view of it
                    args.append(self._device_chunk(tid, axis[tid], sp, j))
                else:
                    args.append(buffers[tid] if tid in buffers else self.value_of(tid))
            else:
                args.append(f)
        return args

    def _place_whole_outputs(self, op, residencies: list[int]) -> list[relax.Var]:
        """The outputs of a split that accumulates, each in its window."""
        by_tensor = {self.plan.residencies[ri].tensor: ri for ri in residencies}
        missing = [self.g.tensors[t].name for t in op.outputs if t not in by_tensor]
        if missing:
            raise SwapOffloadError(f"plan error: {', '.join(missing)} has no window at its "
                                   f"producer {op.name}")
        return [self.em.place(by_tensor[t]) for t in op.outputs]

    def _device_chunk(self, tid: int, axis: int, sp, j: int) -> relax.Var:
        """Chunk j of a cut input kept on the device: a view of its bytes (its leading axis is
        cut, at an offset that is a multiple of the alignment, so a kernel may read it)."""
        t = self.g.tensors[tid]
        if sp.outer_dim >= 0:
            raise SwapOffloadError(f"plan error: {t.name} is read in place by a split with an "
                                   "outer dim (its chunks are strided)")
        view = self.emit(relax.op.memory.view(
            self.value_of(tid), relax.ShapeExpr(_cut_shape(t.shape, axis, sp.chunks)), None,
            relax.prim_value(tvm.tirx.IntImm("int64",
                                             j * self._chunked_bytes(tid) // sp.chunks))))
        return self.emit(relax.op.memory.ensure_zero_offset(view))

    def _copy_chunk(self, tid: int, axis: int, sp, j: int, buffer: relax.Var,
                    stream: int, halo: tuple[int, int] | None = None) -> None:
        """Chunk j of tensor `tid` (cut along `axis` as the op reads or writes it) from its
        base's host copy into `buffer` (H2D), or from `buffer` back (D2H); the runtime copies
        it whole when every axis before `axis` is 1, else row by row (`copy_chunk_async`). With
        a `halo` (rows before, after), the chunk's input range in (`copy_window_async`). With
        an outer dim, the inner chunk of its item (`SplitOption.outer_dim`)."""
        t = self.g.tensors[tid]
        host = self.em.host_copy_of(self.g.base(tid))
        item, j = divmod(j, sp.option().inner_chunks(sp.chunks))
        if tid != self.g.base(tid) or sp.outer_dim >= 0:
            # The base's bytes, shaped as the op reads them; of a split with an outer dim, those
            # of the chunk's item (its axis 0 cut so), whose inner chunk j this copies.
            shape = _cut_shape(t.shape, 0, sp.outer_chunks)
            host = self.emit(relax.op.memory.view(
                host, relax.ShapeExpr(shape), None,
                relax.prim_value(item * self._chunked_bytes(tid) // sp.outer_chunks)))
        inner = sp.option().inner_chunks(sp.chunks)
        name = self.g.tensors[self.g.base(tid)].name
        if halo is not None:
            start = j * (int(t.shape[axis]) // inner) - halo[0]
            self.emit(swap_calls.copy_window_async_call(host, buffer, stream, axis, start, name))
            return
        self.emit(swap_calls.copy_chunk_async_call(host, buffer, stream, axis, j,
                                                   stream == H2D, name))

    def _chunked_bytes(self, tid: int) -> int:
        """Bytes of tensor `tid` as a split op cuts it: a view's are its base's (a view holds no
        bytes of its own in the graph; `time_splits` offers only views that cover their base)."""
        return self.g.tensors[self.g.base(tid)].nbytes

    @staticmethod
    def _chunk_key(op, sp, accumulating: bool = False) -> tuple:
        return (op.kernel, sp.dim, sp.outer_dim, sp.chunks, accumulating)

    def _kernel_dims(self, op):
        """The index analysis of `op`'s kernel (once per kernel)."""
        if op.kernel not in self.analyses:
            self.analyses[op.kernel] = kernel_dims(self.mod[op.kernel], len(op.outputs),
                                                      op.kernel)
        return self.analyses[op.kernel]

    def _cut_axes(self, op, sp) -> dict[int, int]:
        """The axis split op `op`'s dim cuts in each of its cut inputs and outputs, as the op
        reads and writes them."""
        dim = self._kernel_dims(op).spec.dims[sp.dim]
        axes = {tid: c.axis for tid, c in zip(op.inputs, dim.inputs, strict=True)
                if c is not None}
        if not sp.accumulate:  # (a reduction's outputs are not cut)
            axes.update(zip(op.outputs, dim.outputs, strict=True))
        return axes

    def _chunk_buffers(self, sp, tid: int, axis: int, halo: tuple[int, int] | None,
                       offset: int) -> tuple[list, int]:
        """`sp.buffers` chunk buffers of tensor `tid` (cut along `axis`; with a `halo`, the
        chunk's input range, halo rows included) in the split's window from `offset`; and the
        offset after them."""
        t = self.g.tensors[tid]
        inner = sp.option().inner_chunks(sp.chunks)
        shape = _cut_shape(_cut_shape(t.shape, 0, sp.outer_chunks), axis, inner)
        if halo is not None:
            shape[axis] = chunk_rows(int(t.shape[axis]), inner, *halo)
        # As the plan sized them (its halo rows included).
        nbytes = tensor_chunk_bytes(sp.option(), self.g.base(tid), self._chunked_bytes(tid),
                                    sp.chunks)
        pair = []
        for _ in range(sp.buffers):
            alloc = relax.op.memory.alloc_tensor(self.em.pools[sp.pool], relax.prim_value(offset),
                                                 relax.ShapeExpr(shape), t.dtype)
            pair.append(self.emit(relax.op.memory.ensure_zero_offset(self.emit(alloc))))
            offset += nbytes
        return pair, offset

    def _halos(self, op, sp) -> dict[int, tuple[int, int]]:
        """The inputs split op `op` reads through windows: (halo rows before, after)."""
        dim = self._kernel_dims(op).spec.dims[sp.dim]
        return {tid: (c.halo_lo, c.halo_hi) for tid, c in zip(op.inputs, dim.inputs, strict=True)
                if c is not None and c.halo}

    def _new_chunk_params(self, op, sp) -> int:
        """How many chunk indices the chunk kernel of `op` takes beyond those of the op's own
        kernel (a kernel partitioned across devices already takes its device's chunk, which
        the op's call passes)."""
        chunk_kernel = self.chunk_kernels[self._chunk_key(op, sp)][1]
        return len(chunk_params(chunk_kernel)) - len(chunk_params(self._kernel_dims(op).func))

    def _chunk_kernel(self, op, sp):
        """The kernel of one chunk of `op` (`local_kernel`), made once per kernel and split."""
        key = self._chunk_key(op, sp)
        if key not in self.chunk_kernels:
            part = self._epilogue(op, sp).reduction if sp.epilogue else None
            try:
                kd = self._kernel_dims(op)
                factors = {sp.dim: sp.option().inner_chunks(sp.chunks)}
                if sp.outer_dim >= 0:
                    factors[sp.outer_dim] = sp.outer_chunks
                kernel = local_kernel(kd, factors,
                                      func=part.func if part else None, halo=has_halo(kd, sp.dim),
                                      num_outputs=len(part.outputs) if part else None)
            except LoweringError as err:
                raise SwapOffloadError(f"{op.name}: cannot run in {sp.chunks} chunks: {err}") \
                    from err
            name = chunk_kernel_name(op.kernel, sp.chunks, sp.dim, outer_dim=sp.outer_dim)
            kernel = kernel.with_attr("global_symbol", name)
            self.chunk_kernels[key] = (self.bb.add_func(kernel, name), kernel)
        return self.chunk_kernels[key][0]

    def _accumulating_chunk_kernel(self, op, sp):
        """The kernel of every chunk of `op` after the first in a split that accumulates: the
        chunk kernel starting from what the outputs hold (`accumulating_kernel`; the outputs
        are passed twice, as its `_prev` inputs and as its outputs)."""
        key = self._chunk_key(op, sp, accumulating=True)
        if key not in self.chunk_kernels:
            self._chunk_kernel(op, sp)
            first = self.chunk_kernels[self._chunk_key(op, sp)][1]
            n_out = len(self._epilogue(op, sp).reduction.outputs) if sp.epilogue \
                else len(op.outputs)
            try:
                kernel = accumulating_kernel(first, output_params(first, n_out))
            except ValueError as err:
                raise SwapOffloadError(f"{op.name}: cannot add its chunks up: {err}") from err
            name = chunk_kernel_name(op.kernel, sp.chunks, sp.dim, accumulating=True,
                                     outer_dim=sp.outer_dim)
            kernel = kernel.with_attr("global_symbol", name)
            self.chunk_kernels[key] = (self.bb.add_func(kernel, name), kernel)
        return self.chunk_kernels[key][0]


def _cut_shape(shape, axis: int, chunks: int) -> list[int]:
    """The shape of one of `chunks` chunks of a tensor cut along `axis`."""
    dims = [int(x) for x in shape]
    dims[axis] //= chunks
    return dims
