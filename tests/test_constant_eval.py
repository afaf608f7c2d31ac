"""ConstantEvaluator: an expression computed from constants alone (a causal mask from
`arange`s, as torch.export writes it) is evaluated at compile time; one that reads a parameter
has no value; equal computations are built once."""

from __future__ import annotations

import numpy as np
from tvm import relax

from tvm_ext.ir.constant_eval import ConstantEvaluator


def _mask_function(seq: int, from_param: bool = False):
    """main(x) = x + where(arange(seq)[None] <= arange(seq)[:, None], 0, -inf), twice over
    (two layers computing the same mask); with `from_param` the comparison reads x."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((seq, seq), "float32"))
    masks = []
    with bb.function("main", [x]):
        with bb.dataflow():
            out = x
            for _ in range(2):
                keys = bb.emit(relax.op.expand_dims(relax.op.arange(0, seq, 1, "int64"), [0]))
                rows = bb.emit(relax.op.expand_dims(relax.op.arange(0, seq, 1, "int64"), [1]))
                seen = bb.emit(relax.op.less_equal(keys, rows))
                if from_param:
                    seen = bb.emit(relax.op.logical_and(
                        seen, relax.op.greater(x, relax.const(0.0, "float32"))))
                mask = bb.emit(relax.op.where(seen, relax.const(0.0, "float32"),
                                              relax.const(float("-inf"), "float32")))
                masks.append(mask)
                out = bb.emit(relax.op.add(out, mask))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    func = bb.get()["main"]
    bindings = {b.var: b.value for b in func.body.blocks[0].bindings}
    return bindings, masks


def test_a_mask_from_aranges_is_evaluated_once_per_computation():
    bindings, masks = _mask_function(6)
    evaluator = ConstantEvaluator(bindings)
    want = np.where(np.arange(6)[None] <= np.arange(6)[:, None], 0, -np.inf)
    for mask in masks:
        np.testing.assert_array_equal(evaluator.value(mask), want)
    assert evaluator.builds == 1  # the second layer's mask: the first's build


def test_what_reads_a_parameter_or_is_too_large_has_no_value():
    bindings, masks = _mask_function(6, from_param=True)
    assert ConstantEvaluator(bindings).value(masks[0]) is None
    bindings, masks = _mask_function(6)
    assert ConstantEvaluator(bindings, max_elements=35).value(masks[0]) is None
    assert ConstantEvaluator(bindings).value(relax.const(np.ones(3, "float32"))).sum() == 3


def test_a_computation_tvm_cannot_build_has_no_value(monkeypatch):
    def fail(func):
        raise RuntimeError("no legalization")

    bindings, masks = _mask_function(6)
    evaluator = ConstantEvaluator(bindings)
    monkeypatch.setattr(ConstantEvaluator, "_run", staticmethod(fail))
    assert evaluator.value(masks[0]) is None
    assert evaluator.value(masks[1]) is None and evaluator.builds == 1
