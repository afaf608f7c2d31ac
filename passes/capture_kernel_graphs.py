"""CaptureKernelGraphs: each run of static kernel calls replayed as one CUDA graph.

TVM's `RewriteCUDAGraph` (after `StaticPlanBlockMemory`) lifts each run of kernel calls that
reads only memory at fixed addresses (the storage it allocates once, and the parameters after
the function's `num_input`: the weights, and in a training step the optimizer state) into a
function, called through a builtin that captures it into a CUDA graph on the first call and
replays it afterwards. Kernels reading an input (an embedding's lookup of the token ids) or
writing an output (allocated per call, so the caller may keep it) stay outside, launched one by
one.

This pass runs that rewrite and points its calls at tvm_ext's builtins (`src/graph/
kernel_graphs.cc`): the graph builtin captures a region again when one of its arguments has
moved (new weight tensors, say) instead of replaying kernels on the old addresses, and runs a
region that cannot be captured (or whose arguments keep moving) without a graph. It is for
modules whose every call is a kernel TVM's runtime launches on the VM's stream: the pipeline
leaves it out of swapped modules (their copies run on streams of their own, the host waiting
for them) and partitioned ones (collectives), and the pass leaves alone a module whose
function carries SwapOffload's or PartitionOperators' record (a partitioned worker's code is
compiled from its swap phase on, without the options that say it is partitioned).

Before it, each block's allocations of constant size move to the block's start. The rewrite
allocates them all at the first one, but starts a region at its first kernel: an optimizer
step's first kernel (the step count's increment, on a parameter) comes before any allocation,
and its region would read storage not yet allocated. The allocations depend on nothing, and
with the rewrite they are made once per VM anyway.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_ext.ir.kernel_graphs import BUILTINS
from tvm_ext.ir.pass_records import PARTITION_ATTR, SWAP_PLAN_ATTR, has_record

_CONFIG = "relax.backend.use_cuda_graph"


@relax.expr_functor.mutator
class _PointAtOurBuiltin(relax.PyExprMutator):
    def visit_extern_func_(self, op: relax.ExternFunc) -> relax.Expr:
        ours = BUILTINS.get(str(op.global_symbol))
        return relax.ExternFunc(ours) if ours else op


def _hoist_static_storage(func: relax.Function) -> relax.Function:
    """`func` with each block's constant-size `R.memory.alloc_storage` bindings first."""
    alloc_storage = tvm.ir.Op.get("relax.memory.alloc_storage")

    def static(binding) -> bool:
        call = binding.value if isinstance(binding, relax.VarBinding) else None
        return (isinstance(call, relax.Call) and call.op.same_as(alloc_storage)
                and all(isinstance(v, tvm.tirx.IntImm) for v in call.args[0].values))

    blocks = []
    for block in func.body.blocks:
        first = [b for b in block.bindings if static(b)]
        rest = [b for b in block.bindings if not static(b)]
        kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else \
            relax.BindingBlock
        blocks.append(kind(first + rest))
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="CaptureKernelGraphs")
class CaptureKernelGraphs:
    """`RewriteCUDAGraph`, its calls on tvm_ext's builtin (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext
                         ) -> tvm.IRModule:
        functions = [f for f in mod.functions.values() if isinstance(f, relax.Function)]
        if any(has_record(f, PARTITION_ATTR) or has_record(f, SWAP_PLAN_ATTR)
               for f in functions):
            return mod
        mod = tvm.IRModule(dict(mod.functions), attrs=mod.attrs, global_infos=mod.global_infos)
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                mod[gv] = _hoist_static_storage(func)
        with tvm.transform.PassContext(config={_CONFIG: True}):
            mod = relax.transform.RewriteCUDAGraph()(mod)
        functions = [(gv, f) for gv, f in mod.functions.items() if isinstance(f, relax.Function)]
        for gv, func in functions:
            mod[gv] = _PointAtOurBuiltin().visit_expr(func)
        return mod
