"""PlaceUpdatesAfterReaders: each binding that makes a new value of an argument (an optimizer
step's update) placed after every other reader of that argument.

Input: a fused module (`tvm_ext.pipeline.legalize_passes`) whose `main` says in the attribute
`tvm_ext.updates` which of its results are new values of which arguments. The optimizer step
is built with each update after the argument's last reader, but TVM's FuseOps emits a fused
kernel where its group's last op was: a group that reads a weight early (a convolution's data
gradient) and ends late is placed after that weight's update. As data flow that is still right;
updated in place (`UpdateArgumentsInPlace`) it would read the new weight. The bindings of each
block are put back in a topological order in which an update follows those readers, keeping
the IR's order wherever it allows (a module already in such an order is returned unchanged).
Where the order cannot be had (a reader in a later block, or one that needs the update's own
result) the module is left as it is, and the graph builder refuses it by name.
"""

from __future__ import annotations

import heapq

import tvm
from tvm import relax

from tvm_ext.ir.pass_records import argument_writers
from tvm_ext.ir.relax_exprs import viewed


@tvm.transform.module_pass(opt_level=0, name="PlaceUpdatesAfterReaders")
class PlaceUpdatesAfterReaders:
    """Order each argument's update after the argument's other readers (module docstring)."""

    def __init__(self, function: str = "main"):
        self.function = function

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.function not in [gv.name_hint for gv in mod.functions]:
            return mod
        func = mod[self.function]
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            return mod
        updated = _updating_bindings(func)
        if not updated:
            return mod
        old = list(func.body.blocks)
        blocks = [_reordered(block, updated) for block in old]
        if all(new.same_as(block) for new, block in zip(blocks, old, strict=True)):
            return mod
        mod = mod.clone()
        mod[self.function] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                            func.ret_ty, func.is_pure, func.attrs)
        return mod


def _updating_bindings(func: relax.Function) -> dict:
    """Binding var that makes a new value of an argument -> the arguments it updates."""
    values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    return {var: [func.params[arg] for arg in writes.values()]
            for var, writes in argument_writers(func, values).items()}


def _reordered(block, updated: dict):
    """`block` with each update after the block's other readers of what it updates, or
    `block` itself when it already is, or when no order of its bindings has that."""
    bindings = list(block.bindings)
    index = {b.var: i for i, b in enumerate(bindings)}
    values = {b.var: b.value for b in bindings}
    reads = [list(relax.analysis.free_vars(b.value)) for b in bindings]
    readers: dict = {}  # argument -> indices of the bindings that read it (or a view of it)
    for i, used in enumerate(reads):
        for v in used:
            readers.setdefault(viewed(v, values), set()).add(i)
    after: list[set[int]] = [{index[v] for v in used if v in index} for used in reads]
    late = False
    for var, args in updated.items():
        if var not in index:
            continue
        u = index[var]
        for arg in args:
            for r in readers.get(arg, ()):
                if r != u:
                    after[u].add(r)
                    late |= r > u
    if not late:
        return block
    order = _stable_topological(after)
    if order is None:
        return block
    return type(block)([bindings[i] for i in order])


def _stable_topological(after: list[set[int]]) -> list[int] | None:
    """Indices in an order that puts every i after each of after[i], taking the lowest ready
    index first (so the IR's order where it is allowed); None when there is a cycle."""
    waiting: list[list[int]] = [[] for _ in after]
    unmet = [len(deps) for deps in after]
    for i, deps in enumerate(after):
        for d in deps:
            waiting[d].append(i)
    ready = [i for i, n in enumerate(unmet) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in waiting[i]:
            unmet[j] -= 1
            if unmet[j] == 0:
                heapq.heappush(ready, j)
    return order if len(order) == len(after) else None
