"""FuseAttention: scaled dot-product attention computed by one fused kernel.

Every attention `tvm_ext.ir.attention_pattern.find_attention` finds in a Relax function (the
scores' product, scaling, mask, softmax and the second product, as the frontends write them)
is replaced by one `call_tir` of `tvm_ext.ir.attention_kernel` (FlashAttention-2's online
softmax: the score matrix never reaches device memory). The intermediates it made dead are
removed. A bias of lower rank is reshaped to 4-D (a view).

In a training step, the backward of each attention whose backward
`tvm_ext.ir.attention_backward_pattern.find_attention_backward` finds (dP, the softmax's
gradient and the four gradient products, as relax.transform.Gradient writes them) is first
replaced by the two backward kernels of `tvm_ext.ir.attention_backward_kernel`
(FlashAttention-2's backward: dQ, then dK' and dV', each recomputing its tiles of P from the
row's log-sum-exp, which the forward's kernel writes beside its output), so the step holds
and makes no tensor of the scores' size at all. In a
mixed-precision step the kernels round each product's operands to the low dtype, as the
unfused backward's products read them.

Where the backward stays (a trainable bias whose gradient reads the scores' adjoint, or any
other reader of a scores-sized tensor of the backward), the intermediates it reads (the
probabilities, the operands' views) are kept, but computed right before their first such
reader instead of in the forward: the forward's output comes from the kernel, and the
scores and probabilities are made for the backward rather than held from the forward to it,
which takes a layer's B x H x S x S probabilities off the activations a training step keeps.
The kernel's work is then on top of the unfused step's, so the pipeline does that only under
a device budget (`recompute_for_backward`); without one, such an attention stays unfused.

On CUDA the kernels come scheduled (their loops bound to blocks and threads, their scratch in
shared and local memory); on other targets it is the same TIR with serial loops, which is what
tests check against the unfused graph on the CPU. The pipeline runs it on GPU targets only,
before LegalizeOps, and not with a partition: Tofu's index analysis reads the unfused
operators (their batch and head dims split), where it would replicate the fused kernel.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from tvm_ext.ir.attention_backward_kernel import attention_backward_kernels, key_splits
from tvm_ext.ir.attention_backward_pattern import (
    BackwardMatch,
    CanonicalViews,
    dataflow_bindings,
    find_attention_backward,
)
from tvm_ext.ir.attention_kernel import attention_kernel
from tvm_ext.ir.attention_pattern import AttentionMatch, find_attention
from tvm_ext.ir.targets import is_gpu
from tvm_ext.ir.var_readers import readers


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
        args = _kernel_args(self, match)
        self._bind(var, relax.op.call_tir(self._kernel(match), relax.Tuple(args), var.ty))
        self.fused += 1

    def _emit(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        if value.same_as(binding.value):
            self.builder_.emit_normalized(binding)
        else:
            self._bind(binding.var, value)

    def _bind(self, var: relax.Var, value: relax.Expr) -> None:
        _rebind(self, var, value)


def _kernel_args(mutator: relax.expr_functor.PyExprMutator, match: AttentionMatch) -> list:
    """Q, K, V and the biases of `match` as the kernels take them (a bias of lower rank
    reshaped to 4-D, a view)."""
    args = [mutator.visit_expr(x) for x in (match.q, match.k, match.v)]
    for bias, shape in zip(match.biases, match.spec.bias_shapes, strict=True):
        bias = mutator.visit_expr(bias)
        if len(bias.ty.shape) < 4:
            bias = mutator.builder_.emit(relax.op.reshape(bias, shape))
        args.append(bias)
    return args


def _rebind(mutator: relax.expr_functor.PyExprMutator, var: relax.Var,
            value: relax.Expr) -> None:
    """Emits `value` bound to a new var of `var`'s name (and its new type), read for `var`."""
    value = mutator.builder_.normalize(value)
    new = type(var)(var.name, value.ty)
    mutator.builder_.emit_normalized(relax.VarBinding(new, value))
    mutator.set_var_remap(var, new)


@relax.expr_functor.mutator
class _RewriteBackward(relax.expr_functor.PyExprMutator):
    """Binds each forward's output to the fused kernel's, which also writes each row's
    log-sum-exp, and the backward's dV', dQ' and dK' (or their views) to the fused backward
    kernels' outputs, both kernels called where the first of the three was bound."""

    def __init__(self, mod: tvm.IRModule, gpu: bool):
        super().__init__(mod)
        self.gpu = gpu
        self.kernels: dict = {}  # (spec, 0 rows / 1 keys / 2 forward) -> GlobalVar
        self.fused = 0
        self.set_matches([])

    def set_matches(self, matches: list[BackwardMatch]) -> None:
        self.forwards = {m.forward.output: m for m in matches}
        self.lse: dict = {}  # match -> its forward's log-sum-exp
        self.args: dict = {}  # match -> the kernels' Q, K, V and biases (emitted once)
        self.targets = {}
        for m in matches:
            for which, (var, transposed) in enumerate(((m.d_q, False),
                                                       (m.d_k, m.d_k_transposed),
                                                       (m.d_v, m.d_v_transposed))):
                if var is not None:
                    self.targets[var] = (m, which, transposed)
        self.outputs: dict = {}  # match -> (dq, dk', dv')

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        forward = self.forwards.get(binding.var)
        if forward is not None:
            self._forward(binding.var, forward)
            return
        hit = self.targets.get(binding.var)
        if hit is None:
            super().visit_var_binding_(binding)
            return
        match, which, transposed = hit
        if match not in self.outputs:
            self.outputs[match] = self._call(match)
        value = self.outputs[match][which]
        if transposed:
            value = self.builder_.emit(relax.op.permute_dims(value, [0, 1, 3, 2]))
        shape = [int(d) for d in binding.var.ty.shape]
        if [int(d) for d in value.ty.shape] != shape:
            value = relax.op.reshape(value, shape)
        _rebind(self, binding.var, value)

    def _kernel(self, spec, which: int) -> relax.GlobalVar:
        """The rows (0) or keys (1) kernel of backward `spec`, or (2) the forward kernel with
        its log-sum-exp of forward `spec`, added once."""
        if (spec, which) not in self.kernels:
            func = attention_kernel(spec, gpu=self.gpu, with_lse=True) if which == 2 \
                else attention_backward_kernels(spec, gpu=self.gpu)[which]
            name = ("fused_attention_rows", "fused_attention_keys", "fused_attention")[which]
            self.kernels[spec, which] = self.builder_.add_func(func, name)
        return self.kernels[spec, which]

    def _forward(self, var: relax.Var, match: BackwardMatch) -> None:
        spec = match.spec.forward
        self.args[match] = _kernel_args(self, match.forward)
        out = self.builder_.emit(relax.op.call_tir(
            self._kernel(spec, 2), relax.Tuple(self.args[match]),
            [var.ty, relax.TensorType((spec.batch, spec.heads, spec.q_len), "float32")]))
        self.lse[match] = self.builder_.emit(relax.TupleGetItem(out, 1))
        _rebind(self, var, relax.TupleGetItem(out, 0))

    def _call(self, match: BackwardMatch) -> tuple:
        fwd, spec = match.forward, match.spec.forward
        q, k, v, *biases = self.args[match]  # bound with the forward, which comes first
        d_out = self.visit_expr(match.d_out)
        four = (spec.batch, spec.heads, spec.q_len, spec.value_dim)
        if tuple(int(d) for d in d_out.ty.shape) != four:
            d_out = self.builder_.emit(relax.op.reshape(d_out, four))
        dtype = spec.dtype
        rows_out = self.builder_.emit(relax.op.call_tir(
            self._kernel(dataclasses.replace(match.spec, lse_from_forward=True), 0),
            relax.Tuple([q, k, v, *biases, self.visit_expr(fwd.output), d_out,
                         self.lse[match]]),
            [relax.TensorType(q.ty.shape, dtype),
             relax.TensorType(four[:3], "float32"), relax.TensorType(four[:3], "float32")]))
        dq, lse, delta = (self.builder_.emit(relax.TupleGetItem(rows_out, i)) for i in range(3))
        self.fused += 1
        if match.d_k is None and match.d_v is None:
            return dq, None, None  # K and V not trained: the keys kernel is not needed
        splits = key_splits(spec)[0]
        primed = (spec.batch, spec.heads, spec.kv_len)
        keys_out = self.builder_.emit(relax.op.call_tir(
            self._kernel(match.spec, 1), relax.Tuple([q, k, v, *biases, d_out, lse, delta]),
            [relax.TensorType((splits, *primed, spec.head_dim), dtype),
             relax.TensorType((splits, *primed, spec.value_dim), dtype)]))
        summed = []
        for i, dim in enumerate((spec.head_dim, spec.value_dim)):
            part = self.builder_.emit(relax.TupleGetItem(keys_out, i))
            # the query walk's parts (one: a free view)
            summed.append(self.builder_.emit(
                relax.op.sum(part, axis=[0]) if splits > 1
                else relax.op.reshape(part, (*primed, dim))))
        return (dq, *summed)


def _fuse_backward(func: relax.Function, rewrite: _RewriteBackward) -> relax.Function:
    """`func` with the backward of each attention it can compute fused (or as it was): one
    whose forward and backward are in one dataflow block."""
    uses, forward = readers(func), find_attention(func)
    found = []
    for bindings in dataflow_bindings(func):
        views = CanonicalViews(bindings)
        found += [m for m in (find_attention_backward(f, bindings, uses, views)
                              for f in forward if f.output in bindings) if m is not None]
    if not found:
        return func
    rewrite.set_matches(found)
    return relax.analysis.remove_all_unused(rewrite.visit_expr(func))


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Fuse each attention of every Relax function into one kernel, and its backward into two
    (see the module doc). `target`: the kernels' form (scheduled for CUDA on a GPU target;
    default: the current target's). `recompute_for_backward`: fuse attentions whose
    intermediates an unfused backward reads (made again for it), or leave them unfused."""

    def __init__(self, target: tvm.target.Target | None = None,
                 recompute_for_backward: bool = True):
        self.target = target
        # False: an attention whose intermediates something else reads stays unfused (a
        # training step with memory to spare keeps its probabilities rather than make them
        # twice)
        self.recompute_for_backward = recompute_for_backward
        self.fused = 0  # attentions fused by the last run
        self.fused_backward = 0  # of which backward fused as well

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        gpu = target is not None and is_gpu(target)
        backward = _RewriteBackward(mod, gpu=gpu)
        funcs = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
        for gv, func in funcs:
            new = _fuse_backward(func, backward)
            if not new.same_as(func):
                backward.builder_.update_func(gv, new)
        self.fused_backward = backward.fused
        if backward.fused:
            mod = backward.builder_.get()
        rewrite = _Rewrite(mod, gpu=gpu)
        funcs = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
        for gv, func in funcs:
            matches = [m for m in find_attention(func)
                       if self.recompute_for_backward or not m.kept]
            if not matches:
                continue
            rewrite.set_matches(matches)
            new = rewrite.visit_expr(func)
            rewrite.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
        self.fused = rewrite.fused + backward.fused  # each fused backward's forward too
        return rewrite.builder_.get() if rewrite.fused else mod
