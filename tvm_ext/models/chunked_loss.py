"""A training step's head and cross entropy computed in chunks of tokens, when the logits are
large: a 1B decoder's 4 x 1024 tokens over a 128256-token vocabulary make 2.1 GB of float32
logits, and as many for their log-softmax and their gradient, each one tensor that a device
budget must hold or move whole.

    logits = reshape(matmul(A, B))                A: [N, D] rows of the last hidden state
    loss   = nll_loss(log_softmax(logits), labels, mean)

becomes, with A and the labels split into k chunks of rows,

    loss = sum(concat_c sum(nll_loss(log_softmax(matmul(A_c, B)), labels_c))) / count(kept)

the same loss (summed in another order: equal within float rounding). Differentiated, each chunk
makes its own logits' gradient and its share of dA and dB, so no tensor of the logits' size
exists; B's gradient is the sum of the k shares (`tvm_ext.passes.GroupAccumulations` fuses
each share with the add that takes it). `interleave_chunks` then moves each chunk's forward
to its gradient, so that one chunk's logits exist at a time. k is the least divisor of N that
brings a chunk's logits within `max_bytes`; below that the step is left as it is.
"""
from __future__ import annotations

import re

import tvm
from tvm import relax

from ..ir.var_readers import readers

# A chunk's logits at most this many bytes (the float32 logits of 512 tokens of a 128k vocab).
CHUNK_BYTES = 256 << 20
# The names of the bindings of chunk c (`{CHUNK}{c}_...`) and of the loss's sum (`{SUM}...`).
CHUNK, SUM = "loss_chunk", "loss_sum"
_OPS = {name: tvm.ir.Op.get(f"relax.{name}") for name in
        ("nn.nll_loss", "nn.log_softmax", "reshape", "matmul")}


def chunk_logits_loss(func: relax.Function, max_bytes: int | None = None) -> relax.Function:
    """`func` (a loss function in one dataflow block, its forward inlined, returning the cross
    entropy) with its head and loss in chunks of rows (see the module docstring); `func`
    itself where the pattern is not there or the logits fit in `max_bytes` (default
    `CHUNK_BYTES`)."""
    max_bytes = CHUNK_BYTES if max_bytes is None else max_bytes
    found = _find(func)
    if found is None:
        return func
    loss_binding, chain, a, b, labels, out_dtype = found
    rows, vocab = (int(d) for d in loss_binding.value.args[0].ty.shape.values)
    hidden = int(a.ty.shape.values[-1])
    itemsize = tvm.runtime.DataType(out_dtype).bits // 8
    chunks = _chunks(rows, rows * vocab * itemsize, max_bytes)
    if chunks == 1:
        return func
    ignore = int(loss_binding.value.attrs.ignore_index)
    op = relax.op
    bb = relax.BlockBuilder()
    attrs = dict(func.attrs) if func.attrs is not None else {}
    with bb.function("main", func.params, attrs, pure=func.is_pure):
        with bb.dataflow():
            for binding in func.body.blocks[0].bindings:
                if binding.var.same_as(loss_binding.var):
                    break
                if not any(binding.var.same_as(v) for v in chain):
                    bb.emit_normalized(binding)
            if len(a.ty.shape.values) != 2:  # rows of a batched product: merged, as a view
                a = bb.emit(op.reshape(a, (rows, hidden)))
            a_parts = bb.emit(op.split(a, chunks, axis=0))
            label_parts = bb.emit(op.split(labels, chunks, axis=0))
            parts = []
            for c in range(chunks):
                # (named so that `interleave_chunks` finds each chunk's bindings in the step)
                rows_c = bb.emit(relax.TupleGetItem(a_parts, c), f"{CHUNK}{c}_rows")
                logits = bb.emit(op.matmul(rows_c, b, out_dtype=out_dtype), f"{CHUNK}{c}_logits")
                logp = bb.emit(op.nn.log_softmax(logits, axis=-1), f"{CHUNK}{c}_logp")
                labels_c = bb.emit(relax.TupleGetItem(label_parts, c), f"{CHUNK}{c}_labels")
                rows_loss = bb.emit(op.nn.nll_loss(logp, labels_c, reduction="none",
                                                   ignore_index=ignore), f"{CHUNK}{c}_loss")
                parts.append(bb.emit(op.sum(rows_loss, axis=[0], keepdims=True),
                                     f"{CHUNK}{c}_part"))
            # The k sums are reductions, which FuseOps fuses with nothing after them: no kernel
            # takes the losses of two chunks but the one concatenation at the end. (FuseOps
            # emits a fused kernel where its first operator was, made after all its inputs: a
            # chain of adds, or reshapes fused with the concatenation, would move every chunk's
            # forward to the first chunk's place and hold all k log-softmaxes again.)
            losses = bb.emit(op.concat(parts, axis=0), f"{SUM}_parts")
            total = bb.emit(op.sum(losses), f"{SUM}_total")
            kept = op.not_equal(labels, relax.const(ignore, str(labels.ty.dtype)))
            count = bb.emit(op.sum(op.astype(kept, str(total.ty.dtype))))
            loss = bb.emit_output(op.divide(total, count), f"{SUM}_mean")
        bb.emit_func_output(loss)
    out = bb.get()["main"]
    # (the block builder names the function; `func` had no such attribute)
    return out if "global_symbol" in attrs else out.without_attr("global_symbol")


def interleave_chunks(func: relax.Function) -> relax.Function:
    """`func`, a step differentiated from a function `chunk_logits_loss` rewrote, with each
    chunk's forward moved to right before the first binding that reads it (its gradient's),
    and the sum of the chunks' losses to the end of its block. The backward takes the chunks
    last first, so in the order differentiation leaves, chunk c's log-softmax is held from
    the end of the forward to its place in the backward: all k at once at the turn. Here
    each chunk's logits are made where their gradient is, one chunk's at a time. `func`
    itself where it has no chunks or the new order would read a value before making it."""
    if not isinstance(func.body, relax.SeqExpr) or not any(
            _CHUNK_NAME.match(b.var.name) for block in func.body.blocks for b in block.bindings):
        return func
    # Gradient collects the rows' gradients in tuples of zeros; with those tuples resolved to
    # their fields, each zeros tensor is read first by its own chunk's gradient.
    mod = relax.transform.CanonicalizeBindings()(tvm.IRModule({"main": func}))
    func = relax.transform.DeadCodeElimination(["main"])(mod)["main"]
    blocks = list(func.body.blocks)
    for i, block in enumerate(blocks):
        new = _interleaved(block) if isinstance(block, relax.DataflowBlock) else None
        if new is not None:
            blocks[i] = new
            return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                  func.ret_ty, func.is_pure, func.attrs)
    return func


# (exact names: differentiation names the gradients `<name>_adjoint...`)
_CHUNK_NAME = re.compile(rf"^{CHUNK}(\d+)_(rows|logits|logp|labels|loss|part)$")
_SUM_NAME = re.compile(rf"^{SUM}_(parts|total|mean)$")


_HEAD_PRODUCT = re.compile(rf"^{CHUNK}\d+_(logits|rows_adjoint)$")


def reads_head(name: str) -> bool:
    """Whether the binding `name` is a chunk's product with the head's weight (its logits, or
    its rows' gradient): a cast of that weight made for one chunk serves them all."""
    return _HEAD_PRODUCT.match(name) is not None


def _interleaved(block: relax.DataflowBlock) -> relax.DataflowBlock | None:
    """`block` with each chunk's bindings, and each tensor made from nothing (the zeros a
    gradient of the split rows starts from), moved to right before their first reader (the
    loss's sum last), or None where the block has no chunks or the order would not hold.
    (FuseOps emits a fused kernel where its first operator was, with all its inputs made
    before it: zeros left at the top of the backward, fused with a chunk's gradient kernels,
    would bring every chunk's forward and backward up to them.)"""
    units: dict = {}  # (chunk index or -1 - binding position) -> its bindings
    sums, rest = [], []
    for i, binding in enumerate(block.bindings):
        match = _CHUNK_NAME.match(binding.var.name)
        if match:
            units.setdefault(int(match.group(1)), []).append(binding)
        elif _SUM_NAME.match(binding.var.name):
            sums.append(binding)
        else:
            rest.append((i, binding))
    if not units:
        return None
    for i, binding in rest:
        if _is_fill(binding):
            units[-1 - i] = [binding]
    rest = [b for i, b in rest if -1 - i not in units]
    unit_of = {b.var: key for key, bindings in units.items() for b in bindings}
    first_reader: dict = {}
    for j, binding in enumerate(rest):
        for var in _read(binding):
            key = unit_of.get(var)
            if key is not None:
                first_reader.setdefault(key, j)
    unread = [key for key in units if key not in first_reader]
    order = [b for key in unread if key < 0 for b in units[key]]  # they read nothing
    for j, binding in enumerate(rest):
        for key in [k for k, at in first_reader.items() if at == j]:
            order += units[key]
        order.append(binding)
    order += [b for key in unread if key >= 0 for b in units[key]]  # read by the sum only
    order += sums
    made = {b.var for b in block.bindings}
    seen: set = set()
    for binding in order:
        if any(v in made and v not in seen for v in _read(binding)):
            return None
        seen.add(binding.var)
    return relax.DataflowBlock(order)


_FILLS = ("relax.zeros", "relax.ones", "relax.full")


def _is_fill(binding) -> bool:
    value = binding.value
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
        value.op.name in _FILLS and not _read(binding)


def _read(binding) -> list:
    return list(relax.analysis.free_vars(binding.value))


def _chunks(rows: int, nbytes: int, max_bytes: int) -> int:
    for k in range(1, rows + 1):
        if rows % k == 0 and nbytes / k <= max_bytes:
            return k
    return rows


def _find(func: relax.Function):
    """(the loss binding, the bindings it replaces, A, B, the labels, the logits' dtype), or
    None: the output is nll_loss(log_softmax(X), labels, mean) of one dataflow block, X
    reshapes (the vocabulary last throughout) of matmul(A, B) with A [..., D] and B [D, V],
    each used only on that path."""
    body = func.body
    if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
        return None
    bindings = body.blocks[0].bindings
    values = {b.var: b.value for b in bindings}
    uses = readers(func)
    loss = next((b for b in bindings if b.var.same_as(body.body)), None)
    if loss is None or not _is_call(loss.value, "nn.nll_loss") \
            or loss.value.attrs.reduction != "mean" \
            or (len(loss.value.args) != 2 and not _is_none(loss.value.args[2])):
        return None
    logp, labels = loss.value.args[0], loss.value.args[1]
    chain = [logp]
    value = values.get(logp)
    if not _is_call(value, "nn.log_softmax") or int(value.attrs.axis) not in (-1, 1):
        return None
    x = value.args[0]
    while isinstance(x, relax.Var) and _is_call(values.get(x), "reshape"):
        chain.append(x)
        x = values[x].args[0]
    matmul = values.get(x)
    if not _is_call(matmul, "matmul") or not isinstance(x, relax.Var):
        return None
    chain.append(x)
    a, b = matmul.args
    if len(a.ty.shape.values) < 2 or len(b.ty.shape.values) != 2 \
            or len(labels.ty.shape.values) != 1:
        return None
    # Reshapes keep each row whole only while the vocabulary stays the last axis.
    vocab = int(b.ty.shape.values[-1])
    if any(int(v.ty.shape.values[-1]) != vocab for v in chain[1:]):
        return None
    if any(len(uses.get(v, ())) != 1 for v in chain):
        return None
    out_dtype = str(matmul.attrs.out_dtype)
    if out_dtype in ("", "void", "None"):
        out_dtype = str(x.ty.dtype)
    return loss, chain, a, b, labels, out_dtype


def _is_call(value, name: str) -> bool:
    return isinstance(value, relax.Call) and value.op.same_as(_OPS[name])


def _is_none(expr) -> bool:
    return expr is None or (isinstance(expr, relax.Call) and expr.op.name == "relax.null_value")
