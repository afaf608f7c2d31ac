"""The causal line of a mask computed from an input (`tvm_ext.ir.mask_bounds`): transformers'
sdpa path combines its causal pattern with the `attention_mask` input's padding in one tensor,
which has no compile-time value; its causal part is certain for every input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvm_ext.ir.attention_kernel import FUSED_ATTENTION_ATTR, attention_kernel
from tvm_ext.ir.attention_mask import causal_offset
from tvm_ext.ir.attention_pattern import find_attention
from tvm_ext.ir.constant_eval import ConstantEvaluator
from tvm_ext.ir.kernel_cost import analyze_kernel
from tvm_ext.ir.mask_bounds import MaskBounds
from tvm_ext.passes import FuseAttention

SEQ = 12
LONG = 128  # four tiles of keys and of query rows: the fused kernels have tiles to skip


def _mask_function(combine: str, fill: float):
    """main(padding [2, SEQ] bool) -> the bias where(combine(causal, padding), 0, fill), the
    causal part computed from `arange`s as torch.export writes it."""
    bb = relax.BlockBuilder()
    padding = relax.Var("padding", relax.TensorType((2, SEQ), "bool"))
    with bb.function("main", [padding]):
        with bb.dataflow():
            keys = bb.emit(relax.op.expand_dims(relax.op.arange(0, SEQ, 1, "int64"), [0]))
            rows = bb.emit(relax.op.expand_dims(relax.op.arange(0, SEQ, 1, "int64"), [1]))
            causal = bb.emit(relax.op.expand_dims(relax.op.less_equal(keys, rows), [0, 1]))
            pad = bb.emit(relax.op.reshape(padding, (2, 1, 1, SEQ)))
            op = {"and": relax.op.bitwise_and, "or": relax.op.logical_or}[combine]
            seen = bb.emit(relax.op.broadcast_to(op(causal, pad), (2, 1, SEQ, SEQ)))
            bias = bb.emit_output(bb.emit(relax.op.where(
                seen, relax.const(0.0, "float32"), relax.const(fill, "float32"))))
        bb.emit_func_output(bias)
    return bb.get()["main"]


def _certain(func):
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    bounds = MaskBounds(bindings, ConstantEvaluator(bindings))
    return bounds.certain_bias(func.body.body)


def test_the_causal_part_of_a_mask_and_ed_with_an_input_is_certain():
    certain = _certain(_mask_function("and", float("-inf")))
    assert certain.shape == (2, 1, SEQ, SEQ)
    above = np.triu(np.ones((SEQ, SEQ), bool), 1)
    assert np.isneginf(certain[:, :, above]).all() and (certain[:, :, ~above] == 0).all()
    assert causal_offset([certain], SEQ, SEQ) == 0


@pytest.mark.parametrize("combine,fill", [
    ("or", float("-inf")),  # the input may unmask any key
    ("and", float(np.finfo(np.float32).min)),  # not -inf: exp of it need not be 0
])
def test_nothing_is_certain_where_the_input_decides_or_the_fill_is_finite(combine, fill):
    assert _certain(_mask_function(combine, fill)) is None


@pytest.fixture(scope="module")
def padded_llama(tmp_path_factory):
    """The corpus's left-padded Llama (sdpa, an `attention_mask` input; its second row's first
    query rows see no key) at LONG tokens, loaded as `compile.py` does, its inputs and
    PyTorch's logits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import corpus

    from tvm_ext.models.loaders import load_file

    module, inputs = corpus.llama("sdpa", seq=LONG, left_padded=True)()
    path = str(tmp_path_factory.mktemp("padded") / "llama.pt2")
    with torch.no_grad():
        want = module(*inputs).numpy()
        torch.export.save(torch.export.export(module, inputs), path)
    return load_file(path), [x.numpy() for x in inputs], want


def _run(mod, arrays):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return [o.numpy() for o in out] if not hasattr(out, "numpy") else [out.numpy()]


def test_an_exported_padded_llamas_attention_skips_past_the_causal_line(padded_llama):
    """Every layer's mask gets the causal line though it reads the input; the fused module
    computes what the unfused one and PyTorch do, the padded row's empty query rows included."""
    model, inputs, want = padded_llama
    matches = find_attention(model.mod["main"])
    assert len(matches) == 2 and all(m.spec.causal_offset == 0 for m in matches)
    assert all(m.spec.zero_masked_rows for m in matches)
    fuse = FuseAttention(tvm.target.Target("llvm"))
    fused = fuse(model.mod)
    assert fuse.fused == 2
    full = analyze_kernel(attention_kernel(dataclasses.replace(matches[0].spec,
                                                               causal_offset=None))).flops
    kernels = [f for _, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)
               and f.attrs is not None and FUSED_ATTENTION_ATTR in f.attrs]
    assert kernels and all(analyze_kernel(k).flops < 0.7 * full for k in kernels)
    arrays = [*inputs, *model.weights]
    [got], [unfused] = _run(fused, arrays), _run(model.mod, arrays)
    np.testing.assert_allclose(got, unfused, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_its_training_step_fuses_the_backward_with_the_same_line(padded_llama):
    """The step's backward kernels skip the same tiles; loss and every gradient equal the
    unfused step's (the empty query rows' gradients zero in both)."""
    from tvm_ext.models.base import make_training_step

    model, inputs, _ = padded_llama
    step = make_training_step(model, loss="mse")
    fuse = FuseAttention(tvm.target.Target("llvm"))
    fused = fuse(step.mod)
    assert fuse.fused == fuse.fused_backward == 2
    assert all(m.spec.causal_offset == 0 for m in find_attention(step.mod["main"]))
    params = step.mod["main"].params
    rng = np.random.default_rng(0)
    labels = [rng.standard_normal([int(d) for d in p.ty.shape]).astype(str(p.ty.dtype))
              for p in params[len(inputs):len(params) - len(model.weights)]]
    arrays = [*inputs, *labels, *model.weights]
    got, want = _run(fused, arrays), _run(step.mod, arrays)
    scale = max(float(np.abs(w).max()) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale)
