"""Baseline partitions in the same cost model (no IR).

* `data_parallel_layouts`: every tensor that carries the batch is cut along it at every level,
  everything else (weights, their gradients, the loss) is replicated; gradients become
  replicated by an allreduce. The batch axis is followed from the model inputs' axis 0 through
  each operator's dims. None when the batch does not divide by the device count.
* `megatron_layouts`: in each MLP and attention block, the first linear layers' weights are
  split by output features (column parallel, with their biases) and the next ones' by input
  features (row parallel, bias replicated). The weights are found from the graph: a forward
  operator with a reduction dim over a rank-2 parameter (or its transpose) is a linear layer;
  one whose input derives from a column-parallel output is row parallel; a column layer with no
  row layer after it is no block. Everything else (activations, embeddings, norms, an LM head)
  is left to the search under the same rules (data-path operators split), so the baseline is
  Megatron's weight layout with the best activation layouts for it.
"""

from __future__ import annotations

from .layout import REP
from .model import PartitionModel
from .search import gradient_pairs


def data_parallel_layouts(model: PartitionModel):
    """Fixed (tensor layouts, op strategies) of data parallelism, or None if the batch does
    not split k ways: every op on the data path splits its batch dim, the others replicate."""
    g = model.graph
    axes = model.batch_axes
    k = model.prefix[-1]
    fixed = {}
    for t in g.tensors:
        if model.free[t.id]:
            continue
        axis = axes.get(t.id)
        if axis is not None and t.shape[axis] % k == 0:
            fixed[t.id] = [axis] * model.levels
        else:
            fixed[t.id] = [REP] * model.levels
    inputs = [t for t in g.tensors if t.kind == "input" and t.shape]
    if not inputs or any(fixed[t.id][0] == REP for t in inputs):
        return None
    ops = {}
    for op in g.ops:
        dim = _batch_dim(model, op.id)
        legal = dim is not None and all(dim in model.op_dims[op.id][lvl]
                                        for lvl in range(model.levels))
        ops[op.id] = [dim if legal else REP] * model.levels
    return fixed, ops


def zero_layouts(model: PartitionModel, stage: int):
    """Fixed (tensor layouts, op strategies) of ZeRO stage 1, 2 or 3 over data parallelism,
    for an optimizer step (`tvm_ext.models.optimizer`), or None where data parallelism does not
    apply. On top of `data_parallel_layouts`: stage 1 shards the optimizer state along its
    first axis, stage 2 the gradients the updates read too, stage 3 the parameters too (each
    in-place update keeps its argument's layout). The updates' own strategies are left to the
    search, which so picks each update's cheapest split under those layouts (the state's:
    each device updates its shard, then the parameters are gathered where they are stored
    whole). Tensors whose first axis does not divide by k stay replicated.

    Closed form per device per step with ring collectives, for P bytes of trained parameters
    and as many of gradients (`zero_bytes`): data parallel 2(k-1)/k P (allreduce the
    gradients); stage 1 3(k-1)/k P (that, and allgather the updated parameters); stage 2
    2(k-1)/k P (reduce-scatter the gradients, allgather the parameters); stage 3 3(k-1)/k P
    (reduce-scatter the gradients, gather the parameters for the forward and the backward
    use)."""
    base = data_parallel_layouts(model)
    if base is None:
        return None
    fixed, ops = base
    g = model.graph
    k = model.prefix[-1]
    updates = [op.id for op in g.ops if op.phase == "update"]
    if not updates:
        return None
    shard = set()
    for t in g.tensors:
        if t.arg_index is None or t.kind not in ("state", "parameter"):
            continue
        if (t.kind == "state" and stage >= 1) or (t.kind == "parameter" and stage >= 3):
            shard.add(t.id)
    if stage >= 2:
        for op_id in updates:
            shard |= {t for t in g.ops[op_id].inputs if g.tensors[t].arg_index is None
                      and g.tensors[t].overwrites is None and g.tensors[t].producer is not None}
    for t in g.tensors:  # an in-place version is stored as its argument
        if t.overwrites is not None and g.base(t.id) in shard:
            shard.add(t.id)
    for t in shard:
        shape = g.tensors[t].shape
        if shape and shape[0] % k == 0 and not model.free[t]:
            fixed[t] = [0] * model.levels
    for op_id in updates:
        del ops[op_id]
    return fixed, ops


def zero_bytes(trained_bytes: float, k: int, stage: int) -> float:
    """The closed-form bytes each device sends per step (see `zero_layouts`); stage 0 is data
    parallelism."""
    f = (k - 1) / k
    return {0: 2 * f, 1: 3 * f, 2: 2 * f, 3: 3 * f}[stage] * trained_bytes


def _batch_dim(model: PartitionModel, op_id: int) -> int | None:
    """The dim of an op that cuts its tensors along their batch axes."""
    op = model.graph.ops[op_id]
    axes = model.batch_axes
    spec = model.specs[op_id]
    for d, dim in enumerate(spec.dims):
        if not dim.valid:
            continue
        ins = [cut is not None and axes.get(t) == cut.axis
               for i, (t, cut) in enumerate(zip(op.inputs, dim.inputs, strict=True))
               if t in axes and i not in spec.unused_inputs]
        outs = [isinstance(o, int) and axes.get(t) == o
                for t, o in zip(op.outputs, dim.outputs, strict=True) if t in axes]
        if (ins or outs) and all(ins) and all(outs):
            return d
    return None


def _linear_uses(model: PartitionModel) -> dict[int, tuple[int, int, int]]:
    """Forward op -> (parameter, contraction axis of the parameter, output-feature axis)."""
    g = model.graph
    params = {t.id for t in g.tensors if t.kind == "parameter" and len(t.shape) == 2}
    # A parameter seen through one single-input operator (its transpose) keeps its axes mapped.
    source: dict[int, tuple[int, dict[int, int]]] = {p: (p, {0: 0, 1: 1}) for p in params}
    for op in g.ops:
        if op.phase != "forward" or len(op.inputs) != 1 or op.inputs[0] not in source:
            continue
        p, amap = source[op.inputs[0]]
        spec = model.specs[op.id]
        mapping = {}
        for dim in spec.dims:
            cut = dim.inputs[0]
            if cut is not None and dim.outputs and isinstance(dim.outputs[0], int):
                mapping[dim.outputs[0]] = amap.get(cut.axis)
        if len(op.outputs) == 1 and sorted(mapping) == [0, 1]:
            source[op.outputs[0]] = (p, mapping)
    uses = {}
    for op in g.ops:
        if op.phase != "forward":
            continue
        spec = model.specs[op.id]
        for i, t in enumerate(op.inputs):
            if t not in source:
                continue
            p, amap = source[t]
            contraction = feature = None
            for dim in spec.dims:
                cut = dim.inputs[i]
                if cut is None or not dim.valid:
                    continue
                if dim.reduction or dim.inner:
                    contraction = amap.get(cut.axis)
                elif any(isinstance(o, int) for o in dim.outputs):
                    feature = amap.get(cut.axis)
            if contraction is not None and feature is not None and op.id not in uses:
                uses[op.id] = (p, contraction, feature)
    return uses


def megatron_layouts(model: PartitionModel) -> dict[int, list[int]]:
    """Fixed layouts of the weights of Megatron-style tensor parallelism (see the docstring)."""
    g = model.graph
    uses = _linear_uses(model)
    derived: set[int] = set()  # tensors computed from a column-parallel output
    role: dict[int, str] = {}
    for op in g.ops:
        if op.phase != "forward":
            continue
        if op.id in uses:
            p = uses[op.id][0]
            others = [t for t in op.inputs if t != p and t in derived]
            if others and p not in role:
                role[op.id] = "row"
            else:
                role[op.id] = "column"
                derived.update(op.outputs)
            continue
        if any(t in derived for t in op.inputs):
            derived.update(op.outputs)
    fixed: dict[int, list[int]] = {}
    k = model.prefix[-1]
    bias_of = _biases(model, uses)
    rows = [o for o, r in role.items() if r == "row"]
    for op_id, r in role.items():
        p, contraction, feature = uses[op_id]
        shape = g.tensors[p].shape
        if r == "column" and not any(o > op_id for o in rows):
            continue
        axis = feature if r == "column" else contraction
        if shape[axis] % k:
            continue
        fixed[p] = [axis] * model.levels
        bias = bias_of.get(op_id)
        if bias is not None and r == "column" and g.tensors[bias].shape[0] % k == 0:
            fixed[bias] = [0] * model.levels
        elif bias is not None:
            fixed[bias] = [REP] * model.levels
    for p, grad in gradient_pairs(model):
        if p in fixed:
            fixed[grad] = fixed[p]
    return fixed


def _biases(model: PartitionModel, uses) -> dict[int, int]:
    """Linear op -> its bias parameter (a rank-1 parameter input of the same fused kernel)."""
    g = model.graph
    out = {}
    for op_id in uses:
        for t in g.ops[op_id].inputs:
            if g.tensors[t].kind == "parameter" and len(g.tensors[t].shape) == 1:
                out[op_id] = t
    return out
