"""FuseAttention: every attention the frontends write becomes one fused kernel computing what
the unfused graph computes; intermediates a training step's backward reads are made again
right before it; the pipeline fuses on GPU targets, not with a partition."""

from __future__ import annotations

import corpus
import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvm_ext import pipeline
from tvm_ext.ir.attention_kernel import FUSED_ATTENTION_ATTR
from tvm_ext.passes import FuseAttention

LLVM = tvm.target.Target("llvm")


def _fused_kernels(mod: tvm.IRModule) -> int:
    return sum(1 for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)
               and f.attrs is not None and FUSED_ATTENTION_ATTR in f.attrs)


def _ops(mod: tvm.IRModule) -> list[str]:
    names = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                names.append(value.op.name)
    return names


def _attention(also_return_probabilities: bool = False, scale_after_mask: bool = False):
    """GPT-2's eager attention on [2, 4, 24, 8]: (q @ k^T) * 1/sqrt(8) + mask, softmax, @ v."""
    bb = relax.BlockBuilder()
    shape = (2, 4, 24, 8)
    q, k, v = (relax.Var(n, relax.TensorType(shape, "float32")) for n in "qkv")
    mask = relax.Var("mask", relax.TensorType((2, 1, 24, 24), "float32"))
    with bb.function("main", [q, k, v, mask]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.matmul(q, kt))
            scale = relax.const(1 / np.sqrt(8), "float32")
            if scale_after_mask:
                s = bb.emit(relax.op.multiply(bb.emit(relax.op.add(s, mask)), scale))
            else:
                s = bb.emit(relax.op.add(bb.emit(relax.op.multiply(s, scale)), mask))
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            o = bb.emit(relax.op.matmul(p, v))
            out = bb.emit_output(relax.Tuple([o, p]) if also_return_probabilities else o)
        bb.emit_func_output(out)
    return bb.get()


def _inputs(mod: tvm.IRModule, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for param in mod["main"].params:
        shape = [int(s) for s in param.ty.shape]
        if param.name == "mask":
            arrays.append(np.where(np.tril(np.ones(shape[-2:])) > 0, 0, -1e9)
                          .astype("float32") * np.ones(shape, "float32"))
        else:
            arrays.append(rng.standard_normal(shape).astype("float32"))
    return arrays


def _run(mod: tvm.IRModule, arrays) -> list[np.ndarray]:
    vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    outs = list(out) if not hasattr(out, "numpy") else [out]
    return [o.numpy() for o in outs]


def test_the_eager_pattern_becomes_one_kernel_with_the_same_outputs():
    before = _attention()
    fuse = FuseAttention(LLVM)
    after = fuse(before)
    assert fuse.fused == 1 and _fused_kernels(after) == 1
    assert "relax.nn.softmax" not in _ops(after) and "relax.matmul" not in _ops(after)
    arrays = _inputs(before)
    np.testing.assert_allclose(_run(after, arrays)[0], _run(before, arrays)[0],
                               rtol=1e-5, atol=1e-6)
    again = FuseAttention(LLVM)
    again(after)
    assert again.fused == 0  # idempotent: nothing left to fuse


@pytest.mark.parametrize("variant", ["probabilities_returned", "scale_after_mask"])
def test_what_the_kernel_does_not_compute_stays_unfused(variant):
    """Probabilities something else reads (here the output; in training the backward) must be
    made, so nothing is fused; (s + mask) * c is not scale * s + mask."""
    mod = _attention(also_return_probabilities=variant == "probabilities_returned",
                     scale_after_mask=variant == "scale_after_mask")
    fuse = FuseAttention(LLVM)
    assert fuse(mod).same_as(mod) and fuse.fused == 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (Relax module, inputs + weights) of corpus models."""
    from tvm_ext.models.loaders import load_file

    directory = str(tmp_path_factory.mktemp("attention"))
    out = {}
    for name in ("llama_sdpa", "t5_eager", "falcon", "gpt2_eager", "sdpa_causal"):
        path, inputs = corpus.export(corpus.BY_NAME[name], directory)
        model = load_file(path)
        out[name] = (model, [*inputs, *model.weights])
    return out


@pytest.mark.parametrize("name,count,run", [
    ("llama_sdpa", 2, True),  # GQA through repeat_kv, sqrt-scales on q and k, zeroed -inf rows
    ("falcon", 2, False),  # multi-query: one key head broadcast to all (the kernel test's)
    # No scale, position bias + mask (two biases; their sum is the kernel test's), cross
    # attention.
    ("t5_eager", 3, False),
])
def test_corpus_attentions_fuse_and_match_the_unfused_module(exported, name, count, run):
    model, arrays = exported[name]
    fuse = FuseAttention(LLVM)
    fused = fuse(model.mod)
    assert fuse.fused == count
    if not run:
        return
    for got, want in zip(_run(fused, arrays), _run(model.mod, arrays), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _computed_shapes(mod: tvm.IRModule) -> list[tuple[int, ...]]:
    shapes = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            ty = binding.var.ty
            if isinstance(ty, relax.TensorType) and ty.shape is not None:
                shapes.append(tuple(int(d) for d in ty.shape))
    return shapes


@pytest.mark.parametrize("name", [
    "llama_sdpa",  # grouped heads, sqrt-scales on q and k, zeroed -inf rows
    "gpt2_eager",  # torch.export's bmm form, a scaled product and a causal mask
    "falcon",  # one key head for all, broadcast after K's transpose (multi-query)
])
def test_a_training_steps_backward_is_fused_with_the_forward(exported, name):
    """The backward of each attention is the two fused backward kernels: no softmax, and no
    tensor of the scores' size left in the step; loss and every gradient equal the unfused
    step's."""
    from tvm_ext.models.base import make_training_step

    model, arrays = exported[name]
    step = make_training_step(model, loss="mse")
    fuse = FuseAttention(LLVM)
    fused = fuse(step.mod)
    assert fuse.fused == fuse.fused_backward == 2
    assert "relax.nn.softmax" not in _ops(fused)
    # the forward kernel writes each row's log-sum-exp; the rows kernel reads it
    params = {gv.name_hint: [p.name for p in f.params] for gv, f in fused.functions_items()
              if isinstance(f, tirx.PrimFunc)}
    assert params["fused_attention"][-2:] == ["o", "lse"]
    assert "lse_in" in params["fused_attention_rows"]
    scores = [s for s in _computed_shapes(step.mod) if s[-2:] == (16, 16) and s[1] == 4]
    assert scores  # the unfused step makes them
    assert not [s for s in _computed_shapes(fused) if s[-2:] == (16, 16) and s[1] == 4]
    _check_step(fused, step, model, arrays)


def test_a_step_that_trains_only_the_queries_runs_the_rows_kernel_alone(exported):
    """sdpa_causal trains a scale on Q alone: the step computes dQ' but neither dK' nor dV',
    so its backward is the rows kernel (dQ) without the keys kernel; no tensor of the scores'
    size is left, and loss and gradient equal the unfused step's."""
    from tvm_ext.models.base import make_training_step

    model, arrays = exported["sdpa_causal"]
    step = make_training_step(model, loss="mse")
    fuse = FuseAttention(LLVM)
    fused = fuse(step.mod)
    assert fuse.fused == fuse.fused_backward == 1
    names = sorted(gv.name_hint for gv, f in fused.functions_items()
                   if isinstance(f, tirx.PrimFunc))
    assert names == ["fused_attention", "fused_attention_rows"]
    assert not [s for s in _computed_shapes(fused) if s[-2:] == (16, 16) and len(s) == 4
                and s[1] > 1]
    _check_step(fused, step, model, arrays)


def test_the_zoo_gpt_step_fuses_its_backward():
    """relax.frontend.nn's 4-D form (the zoo's gpt): the same kernels, the same numbers."""
    from tvm_ext.models import gpt
    from tvm_ext.models.base import make_training_step

    model = gpt.build(batch=2, seq=16, hidden=32, heads=2, layers=2, vocab=50)
    step = make_training_step(model)
    fuse = FuseAttention(LLVM)
    fused = fuse(step.mod)
    assert fuse.fused == fuse.fused_backward == 2
    assert "relax.nn.softmax" not in _ops(fused)
    rng = np.random.default_rng(0)
    arrays = []
    for param in step.mod["main"].params:
        shape, dtype = [int(d) for d in param.ty.shape], str(param.ty.dtype)
        arrays.append(rng.integers(0, 50, shape).astype(dtype) if "int" in dtype
                      else (0.5 * rng.standard_normal(shape)).astype(dtype))
    _compare(_run(fused, arrays), _run(step.mod, arrays))


def _compare(got, want, rtol: float = 1e-5) -> None:
    """Every output within `rtol` of the largest of all (some gradients are 0 up to rounding:
    a key bias shifts each row's scores by one constant, which softmax ignores)."""
    scale = max(float(np.abs(w).max()) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


def _check_step(fused, step, model, arrays) -> None:
    inputs = _step_inputs(step, model, arrays)
    _compare(_run(fused, inputs), _run(step.mod, inputs))


def test_a_backward_that_reads_the_scores_makes_its_probabilities_again(exported):
    """T5's position bias is trained: its gradient reads the scores' adjoint, so those two
    attentions keep their backward (the probabilities are made again right before it, not
    held from the forward); the cross attention's backward is fused. Loss and gradients
    equal the unfused step's."""
    from tvm_ext.models.base import make_training_step

    model, arrays = exported["t5_eager"]
    step = make_training_step(model, loss="mse")
    fuse = FuseAttention(LLVM)
    fused = fuse(step.mod)
    assert fuse.fused == 3 and fuse.fused_backward == 1
    order = _ops(fused)
    kernels = [i for i, name in enumerate(order) if name == "relax.call_tir"]
    softmaxes = [i for i, name in enumerate(order) if name == "relax.nn.softmax"]
    # Both in the backward: after the last forward attention.
    assert len(softmaxes) == 2 and min(softmaxes) > kernels[2]
    _check_step(fused, step, model, arrays)


def _step_inputs(step, model, arrays) -> list[np.ndarray]:
    """A training step's arguments: the model's inputs, random labels, the weights."""
    params = step.mod["main"].params
    num_inputs = len(arrays) - len(model.weights)
    rng = np.random.default_rng(0)
    labels = [rng.standard_normal([int(d) for d in p.ty.shape]).astype(str(p.ty.dtype))
              for p in params[num_inputs:len(params) - len(model.weights)]]
    return [*arrays[:num_inputs], *labels, *model.weights]


def test_a_mixed_precision_step_fuses_with_its_operands_rounded(exported):
    """bfloat16 products (float32 casts of every operand): the kernels read the float32
    tensors and round them, forward and backward (dO, P and dS too); no softmax and no
    tensor of the scores' size is left. Loss and gradients equal the unfused step's within
    bfloat16's rounding."""
    from tvm_ext.models.base import make_training_step
    from tvm_ext.models.mixed_precision import low_precision_step

    model, arrays = exported["llama_sdpa"]
    step = low_precision_step(make_training_step(model, loss="mse"), "bfloat16")
    fuse = FuseAttention(LLVM)
    fused = fuse(step.mod)
    assert fuse.fused == fuse.fused_backward == 2
    for _, func in fused.functions_items():
        if isinstance(func, tirx.PrimFunc) and FUSED_ATTENTION_ATTR in func.attrs:
            assert "T.reinterpret" in func.script()  # operands rounded to bfloat16 on the bits
    assert "relax.nn.softmax" not in _ops(fused)
    assert not [s for s in _computed_shapes(fused) if s[-2:] == (16, 16) and s[1] == 4]
    inputs = _step_inputs(step, model, arrays)
    got, want = _run(fused, inputs), _run(step.mod, inputs)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)  # the loss
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(g, w, atol=1e-2 * np.abs(w).max())


def test_without_a_budget_a_training_step_keeps_its_probabilities(exported, cuda_target):
    """Making the probabilities twice costs a product per attention: where the backward cannot
    be fused (T5's trained position bias), a build without a device budget keeps that
    attention unfused and a budgeted build fuses it; a backward that fuses needs no
    probabilities, and the step fuses with or without a budget (one forward kernel and two
    backward kernels, for both layers)."""
    from tvm_ext.models.base import make_training_step

    model, _ = exported["llama_sdpa"]
    step = make_training_step(model, loss="mse")
    t5 = make_training_step(exported["t5_eager"][0], loss="mse")
    fuse = FuseAttention(LLVM, recompute_for_backward=False)
    fuse(t5.mod)
    assert fuse.fused == fuse.fused_backward == 1  # the cross attention
    fuse(model.mod)
    assert fuse.fused == 2  # inference: nothing else reads the intermediates
    fuse(step.mod)
    assert fuse.fused == fuse.fused_backward == 2
    counts = {}
    for budgeted in (False, True):
        counts[budgeted] = _fused_kernels(pipeline.fuse(t5.mod, cuda_target,
                                                        budgeted=budgeted))
        assert _fused_kernels(pipeline.fuse(step.mod, cuda_target, budgeted=budgeted)) == 3
    # the cross attention and its two backward kernels; with a budget the other two too
    assert counts[False] == 3 and counts[True] > 3
    # The pipeline's phases fuse as `fuse` does: a budgeted build, and a swapped build's
    # unswapped twin (what its outputs are compared with, bit for bit).
    staged = pipeline.run_phases(t5.mod, cuda_target, through="legalize", inclusive=True,
                                 device_memory="50%")
    assert _fused_kernels(staged) == counts[True]
    twin = pipeline.run_phases(t5.mod, cuda_target, through="legalize", inclusive=True,
                               budgeted=True)
    assert _fused_kernels(twin) == counts[True]


def test_the_pipeline_fuses_on_gpu_targets_without_a_partition(cuda_target):
    mod = _attention()
    staged = pipeline.run_phases(mod, cuda_target, through="legalize", inclusive=True)
    assert _fused_kernels(staged) == 1
    kernel = next(f for _, f in staged.functions_items() if isinstance(f, tirx.PrimFunc)
                  and FUSED_ATTENTION_ATTR in f.attrs)
    assert kernel.attrs["tirx.is_scheduled"]
    for options in ({"fused_attention": False}, {"num_devices": 2}):
        staged = pipeline.run_phases(mod, cuda_target, through="legalize", inclusive=True,
                                     **options)
        assert _fused_kernels(staged) == 0
    assert _fused_kernels(pipeline.fuse(mod, LLVM)) == 0  # CPUs keep their BLAS GEMMs


@pytest.mark.parametrize("name,qk_float32", [
    ("gpt2_eager", False),  # Q, K and V bfloat16 out of their GEMMs, the scale rounded to it
    ("llama_sdpa", True),  # the rotary embedding leaves Q and K float32, cast for the product
])
def test_autocast_inference_fuses_its_attention(exported, name, qk_float32):
    """Under autocast's policy (bf16 inference) every attention is one kernel: it reads the
    operands as the products do (the probabilities rounded to bfloat16), keeps the scores
    float32 where autocast rounds them, and casts its output as the product's is. Its error
    against the float32 model is no larger than the unfused bf16 module's."""
    from tvm_ext.ir.attention_pattern import find_attention
    from tvm_ext.models.autocast import autocast_inference

    model, arrays = exported[name]
    low = autocast_inference(model, "bf16")
    found = find_attention(low.mod["main"])
    assert [m.spec.qk_dtype for m in found] == [("float32" if qk_float32 else None)] * 2
    assert {(m.spec.dtype, m.spec.operand_dtype) for m in found} == {("bfloat16",) * 2}
    fuse = FuseAttention(LLVM)
    fused = fuse(low.mod)
    assert fuse.fused == 2 and "relax.nn.softmax" not in _ops(fused)
    want = _run(model.mod, arrays)[0]
    got, unfused = (_run(m, arrays)[0].astype("float32") for m in (fused, low.mod))
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1.5 * np.abs(unfused - want).max() + 1e-3 * scale
    np.testing.assert_allclose(got, unfused, atol=5e-2 * scale)


def test_the_zoo_gpts_autocast_attention_fuses_in_its_4d_form():
    """relax.frontend.nn's gpt: 4-D products whose float32 results autocast casts to
    bfloat16 (the output variable is the cast), a -1e9 mask (no causal line: not -inf)."""
    from tvm_ext.ir.attention_pattern import find_attention
    from tvm_ext.models import get_model
    from tvm_ext.models.autocast import autocast_inference

    model = get_model("gpt", "tiny")
    low = autocast_inference(model, "bf16")
    found = find_attention(low.mod["main"])
    assert [(m.spec.dtype, m.spec.causal_offset) for m in found] == [("bfloat16", None)] * 2
    fuse = FuseAttention(LLVM)
    fused = fuse(low.mod)
    assert fuse.fused == 2 and "relax.nn.softmax" not in _ops(fused)
    arrays = model.random_arguments(seed=0)
    want = _run(model.mod, arrays)[0]
    got, unfused = (_run(m, arrays)[0].astype("float32") for m in (fused, low.mod))
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1.5 * np.abs(unfused - want).max() + 1e-3 * scale
