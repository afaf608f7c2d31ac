"""FuseAttention: scaled dot-product attention computed by one fused kernel.

Every attention `tvm_ext.ir.attention_pattern.find_attention` finds in a Relax function (the
scores' product, scaling, mask, softmax and the second product, as the frontends write them)
is replaced by one `call_tir` of `tvm_ext.ir.attention_kernel` (FlashAttention-2's online
softmax: the score matrix never reaches device memory). The intermediates it made dead are
removed. A bias of lower rank is reshaped to 4-D (a view).

Intermediates something else reads (a training step's backward reads the probabilities, and
the operands' views for its products) are kept, but computed right before their first such
reader instead of in the forward: the forward's output comes from the kernel, and the scores
and probabilities are made for the backward rather than held from the forward to it, which
takes a layer's B x H x S x S probabilities off the activations a training step keeps. The
kernel's work is then on top of the unfused step's, so the pipeline does it only under a
device budget (`recompute_for_backward`); without one, such an attention stays unfused.

On CUDA the kernel comes scheduled (its loops bound to blocks and threads, its scratch in
shared and local memory); on other targets it is the same TIR with serial loops, which is what
tests check against the unfused graph on the CPU. The pipeline runs it on GPU targets only,
before LegalizeOps, and not with a partition: Tofu's index analysis reads the unfused
operators (their batch and head dims split), where it would replicate the fused kernel.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvm_ext.ir.attention_kernel import attention_kernel
from tvm_ext.ir.attention_pattern import AttentionMatch, find_attention
from tvm_ext.ir.targets import is_gpu


@relax.expr_functor.mutator
class _Rewrite(relax.expr_functor.PyExprMutator):
    """Binds each match's output to its kernel's call instead of the second product; its kept
    intermediates move to right before their first reader outside the pattern, the others
    are dropped."""

    def __init__(self, mod: tvm.IRModule, gpu: bool):
        super().__init__(mod)
        self.gpu = gpu
        self.kernels: dict = {}  # spec -> GlobalVar (one kernel per distinct shape)
        self.fused = 0
        self.set_matches([])

    def set_matches(self, matches: list[AttentionMatch]) -> None:
        self.matches = {m.output: m for m in matches}
        self.dead = {v for m in matches for v in m.internal - m.kept}
        self.deferred = {v: m.output for m in matches for v in m.kept}
        self.pending: dict = {}  # match output -> its kept bindings not yet emitted

    def _kernel(self, match: AttentionMatch):
        if match.spec not in self.kernels:
            func = attention_kernel(match.spec, gpu=self.gpu)
            self.kernels[match.spec] = self.builder_.add_func(func, "fused_attention")
        return self.kernels[match.spec]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var = binding.var
        if var in self.dead:
            return
        if var in self.deferred:
            self.pending.setdefault(self.deferred[var], []).append(binding)
            return
        match = self.matches.get(var)
        if match is None:
            # A reader of kept intermediates (not the kernel's call, which replaces their
            # reader in the pattern): they are computed first.
            for group in {self.deferred[v] for v in relax.analysis.free_vars(binding.value)
                          if v in self.deferred}:
                for kept in self.pending.pop(group, []):
                    self._emit(kept)
            self._emit(binding)
            return
        args = [self.visit_expr(x) for x in (match.q, match.k, match.v)]
        for bias, shape in zip(match.biases, match.spec.bias_shapes, strict=True):
            bias = self.visit_expr(bias)
            if len(bias.ty.shape) < 4:
                bias = self.builder_.emit(relax.op.reshape(bias, shape))
            args.append(bias)
        self._bind(var, relax.op.call_tir(self._kernel(match), relax.Tuple(args), var.ty))
        self.fused += 1

    def _emit(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        if value.same_as(binding.value):
            self.builder_.emit_normalized(binding)
        else:
            self._bind(binding.var, value)

    def _bind(self, var: relax.Var, value: relax.Expr) -> None:
        value = self.builder_.normalize(value)
        new = type(var)(var.name, value.ty)
        self.builder_.emit_normalized(relax.VarBinding(new, value))
        self.set_var_remap(var, new)


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Fuse each attention of every Relax function into one kernel (see the module doc).
    `target`: the kernel's form (scheduled for CUDA on a GPU target; default: the current
    target's). `recompute_for_backward`: fuse attentions whose intermediates a backward reads
    (made again for it), or leave them unfused."""

    def __init__(self, target: tvm.target.Target | None = None,
                 recompute_for_backward: bool = True):
        self.target = target
        # False: an attention whose intermediates something else reads stays unfused (a
        # training step with memory to spare keeps its probabilities rather than make them
        # twice)
        self.recompute_for_backward = recompute_for_backward
        self.fused = 0  # attentions fused by the last run

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        rewrite = _Rewrite(mod, gpu=target is not None and is_gpu(target))
        funcs = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
        for gv, func in funcs:
            matches = [m for m in find_attention(func)
                       if self.recompute_for_backward or not m.kept]
            if not matches:
                continue
            rewrite.set_matches(matches)
            new = rewrite.visit_expr(func)
            rewrite.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
        self.fused = rewrite.fused
        return rewrite.builder_.get() if rewrite.fused else mod
