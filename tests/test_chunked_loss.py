"""A training step's head and cross entropy in chunks of tokens (tvm_ext.models.chunked_loss):
the loss and every gradient of the unchunked step, within float32 rounding, and no tensor of
the logits' size."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tvm_ext import driver
from tvm_ext.models import base, chunked_loss, get_model, make_training_step
from tvm_ext.models.mixed_precision import low_precision_step

LOGITS_BYTES = 2 * 16 * 64 * 4  # the zoo gpt `tiny`: batch 2 x 16 tokens, vocabulary 64


def _outputs(step, args):
    return driver.run(driver.build(step, tvm.target.Target("llvm")), args, tvm.cpu(),
                      repeat=0).outputs


@pytest.fixture
def steps(monkeypatch):
    """The zoo gpt's training step as it is, and with its logits in chunks of a quarter."""
    model = get_model("gpt", "tiny")
    plain = make_training_step(model)
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", LOGITS_BYTES // 4)
    return plain, make_training_step(model)


def test_same_loss_and_gradients(steps):
    plain, chunked = steps
    assert chunked.mod["main"].script().count("R.nn.log_softmax") == 4
    args = plain.random_arguments(0)
    # The head's gradient sums the 32 tokens' products chunk by chunk where the plain step
    # sums them in one GEMM (in the BLAS's own blocking): float32 sums of 32 terms of up to
    # ~0.5 associated otherwise differ by a few 1e-7; a chunk lost or counted twice by ~1e-2.
    for ours, theirs in zip(_outputs(chunked, args), _outputs(plain, args), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    # The logits and their gradient ([2, 16, 64]) exist only a chunk of 8 rows at a time.
    assert {(2, 16, 64)} <= _shapes(plain) and (2, 16, 64) not in _shapes(chunked)
    assert (8, 64) in _shapes(chunked) and (8, 64) not in _shapes(plain)


def _shapes(step) -> set[tuple[int, ...]]:
    graph = driver.fused_graph(step, tvm.target.Target("llvm"))
    return {tuple(t.shape) for t in graph.tensors if t.kind in ("activation", "gradient")}


def test_ignored_labels_leave_the_mean(steps):
    """Cross entropy's mean is over the labels not ignored (-100), in every chunk at once."""
    plain, chunked = steps
    args = plain.random_arguments(1)
    labels = args[plain.num_input - 1]
    labels[0, :12] = -100  # most of the first chunk, part of the second
    loss = _outputs(chunked, args)[0]
    np.testing.assert_allclose(loss, _outputs(plain, args)[0], rtol=1e-6)


def test_small_logits_are_left_alone():
    model = get_model("gpt", "tiny")
    step = make_training_step(model)
    assert step.mod["main"].script().count("R.nn.log_softmax") == 1


def test_each_chunk_is_made_where_its_gradient_is(steps, monkeypatch):
    """In the step as fused, a chunk's logits and log-softmax live for a few kernels, from
    their chunk's forward to its gradient, and two chunks' are never live together; in the
    order differentiation leaves, every chunk's log-softmax waits from the end of the forward
    to its place in the backward."""
    _, chunked = steps
    monkeypatch.setattr(base, "interleave_chunks", lambda func: func)
    as_differentiated = make_training_step(get_model("gpt", "tiny"))

    def spans(step) -> tuple[int, int]:
        graph = driver.fused_graph(step, tvm.target.Target("llvm"), budgeted=False)
        start, end = graph.lifetimes()
        logits = [t for t in graph.tensors if tuple(t.shape) == (8, 64) and t.kind == "activation"
                  and t.alias_of is None]
        assert len(logits) == 8  # each chunk's logits and log-softmax
        longest = max(end[t.id] - start[t.id] for t in logits)
        return longest, max(sum(1 for t in logits if start[t.id] <= step <= end[t.id])
                            for step in range(graph.num_ops))

    assert spans(chunked) == (5, 2)
    longest, live = spans(as_differentiated)
    assert longest > 20 and live == 5


def test_a_low_precision_head_casts_its_weight_once(steps):
    """bf16: the chunks' products read one bfloat16 copy of the head's weight (one for the
    logits, one for the rows' gradient), not one a chunk; the loss is the unchunked bf16
    step's within bfloat16 rounding."""
    plain, chunked = (low_precision_step(s, "bf16") for s in steps)
    script = chunked.mod["main"].script()
    assert script.count("R.astype(head_weight") == 1
    assert script.count("R.astype(permute_dims22") == 1  # transposed, as the logits read it
    args = plain.random_arguments(0)
    np.testing.assert_allclose(_outputs(chunked, args)[0], _outputs(plain, args)[0], rtol=1e-2)
