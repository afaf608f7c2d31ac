"""PartitionOperators on meshes of several levels (4 devices = 2x2, 8 = 2x2x2), against the
single-device build and PyTorch eager.

What these pin down: a kernel whose split dim indexes an axis it does not cut (a reshape that
merges batch and sequence, read whole along the merged axis) must see the dim's global index,
also when the dim is split below a mesh level that does not split it, where a device holds
strided blocks of it (the index convention of `tvm_ext.partition.layout`).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te

from tvm_ext import driver, pipeline
from tvm_ext.driver.partitioned import build_partitioned, run_partitioned_build
from tvm_ext.ir.kernel_dims import kernel_dims, problem_from_module
from tvm_ext.ir.local_kernels import chunk_params, local_kernel
from tvm_ext.models import load_model
from tvm_ext.partition.sharding import coordinates, shard
from tvm_ext.passes import PartitionOperators
from tvm_ext.runtime import distributed

torch = pytest.importorskip("torch")

LLVM = tvm.target.Target("llvm")
MESHES = {4: [2, 2], 8: [2, 2, 2]}


class _LinearSlices(torch.nn.Module):
    """A projection to three slices of its last axis, combined (attention's q, k, v split)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.proj = torch.nn.Linear(hidden, 3 * hidden)

    def forward(self, x):
        h = self.hidden
        y = self.proj(x)
        return y[..., :h] * y[..., h:2 * h] + y[..., 2 * h:]


def _export(module, inputs, tmp_path, name: str):
    path = tmp_path / f"{name}.pt2"
    with torch.no_grad():
        torch.export.save(torch.export.export(module.eval(), inputs), str(path))
        eager = module(*inputs)
    return load_model(str(path)), eager.numpy()


def _arguments(model, inputs) -> list[np.ndarray]:
    return [*(t.numpy() for t in inputs), *model.random_params()]


def _single_device(model, arguments) -> np.ndarray:
    ex = driver.build_reference(model, LLVM)
    return driver.run(ex, arguments, tvm.cpu(0), repeat=0).outputs[0]


def _partitioned(model, arguments, k: int, plan=None):
    """The output of the build partitioned over k devices, and the kernels its workers run."""
    build = build_partitioned(model, LLVM, k, plan=plan, memory_planning=False)
    assert build.plan.mesh == MESHES[k]
    with distributed.Session(k) as sess:
        out = run_partitioned_build(sess, build, arguments).outputs[0]
    return out, {op.kernel for op in build.worker_graph.ops}


@pytest.fixture(scope="module")
def linear_slices(tmp_path_factory):
    torch.manual_seed(0)
    inputs = (torch.randn(2, 16, 64),)
    model, eager = _export(_LinearSlices(64), inputs, tmp_path_factory.mktemp("pt2"),
                           "linear_slices")
    arguments = _arguments(model, inputs)
    return model, arguments, eager, _single_device(model, arguments)


@pytest.mark.parametrize("k", [4, 8])
def test_linear_then_slices_of_the_last_axis(linear_slices, k):
    model, arguments, eager, single = linear_slices
    got, _ = _partitioned(model, arguments, k)
    np.testing.assert_allclose(got, single, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, eager, rtol=1e-4, atol=1e-4)


class _PixelShuffle(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.pixel_shuffle(x, 2)


@pytest.mark.parametrize("k", [4, 8])
def test_pixel_shuffle(tmp_path, k):
    """The partitioner splits a dim of the fused reshape-transpose-reshape kernel at a level
    below one that does not split it; the kernel reads an intermediate at positions computed
    from that dim, so each device needs the global positions of its strided blocks."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8, 4, 4),)
    model, eager = _export(_PixelShuffle(), inputs, tmp_path, "pixel_shuffle")
    got, _ = _partitioned(model, _arguments(model, inputs), k)
    np.testing.assert_allclose(got, eager, rtol=1e-6, atol=1e-6)


def _slices_kernel_op(model):
    """The op of the fused reshape + slices kernel, and its dims by name."""
    fused = pipeline.fuse(model.mod, LLVM)
    problem = problem_from_module(relax.transform.RewriteDataflowReshape()(fused))
    (op,) = [op for op in problem.graph.ops
             if op.kind == "kernel" and "strided_slice" in op.kernel]
    dims = {d.name: i for i, d in enumerate(problem.spec(op.id).dims)}
    return fused, op, dims


@pytest.mark.parametrize("k,levels", [
    (4, ("batch", "seq")),  # the sequence split below a level that splits the batch
    (8, ("batch", "seq", "seq")),
    (8, ("seq", "rep", "seq")),  # interleaved: device c holds blocks c1 * 4 + j * 2 + c3
])
def test_strided_chunks_of_a_dim_read_at_global_indices(linear_slices, k, levels):
    """The slices kernel reads its (batch * seq, 3 * hidden) input whole along the merged
    axis: split on the sequence at levels that leave a level above unsplit, each device holds
    strided blocks of the sequence and must read the input at their global positions."""
    model, arguments, eager, _ = linear_slices
    fused, op, dims = _slices_kernel_op(model)
    names = {"batch": "T_reshape.v_ax0", "seq": "T_reshape.v_ax1"}
    plan = PartitionOperators(k, compare_unrestricted=False).plan_module(fused)[0]
    entry = plan.ops[op.id]
    entry.strategy = [dims[names[lv]] if lv in names else -1 for lv in levels]
    entry.dims = [names.get(lv, "replicate") for lv in levels]
    got, kernels = _partitioned(model, arguments, k, plan=plan)
    assert any(name.startswith(op.kernel) and name.endswith("_strided") for name in kernels)
    np.testing.assert_allclose(got, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh,levels", [
    ([2, 2], ((2, False), (2, True))),
    ([2, 2, 2], ((2, True), (2, False), (2, True))),
    ([2, 2, 2], ((2, False), (2, False), (2, True))),
])
def test_local_kernel_global_index_of_strided_blocks(mesh, levels):
    """out[i, j] = x[i, j] + j on the blocks of j a device holds when j is split at the levels
    marked True: each device's output is its piece of the whole output."""
    x = te.placeholder((2, 16), "float32", name="x")
    out = te.compute((2, 16), lambda i, j: x[i, j] + j.astype("float32"), name="out")
    kd = kernel_dims(te.create_prim_func([x, out]), 1, "add_index")
    d = [dim.name for dim in kd.spec.dims].index("out.v_j")
    factor = int(np.prod([p for p, split in levels if split]))
    local = local_kernel(kd, {d: factor}, levels={d: levels})
    assert chunk_params(local) == [d]
    f = tvm.compile(tvm.IRModule({"main": local.with_attr("global_symbol", "main")}), LLVM)
    layout = [1 if lvl < len(levels) and levels[lvl][1] else -1 for lvl in range(len(mesh))]
    whole = np.random.default_rng(0).standard_normal((2, 16)).astype("float32")
    want = whole + np.arange(16, dtype="float32")
    for w in range(int(np.prod(mesh))):
        coords = coordinates(w, mesh)
        chunk = 0
        for lvl, (p, split) in enumerate(levels):
            if split:
                chunk = chunk * p + coords[lvl]
        res = tvm.runtime.empty((2, 16 // factor), "float32")
        f["main"](tvm.runtime.tensor(shard(whole, mesh, layout, w)), chunk, res)
        np.testing.assert_allclose(res.numpy(), shard(want, mesh, layout, w), rtol=1e-6)


@pytest.mark.sweep  # test_corpus's gpt2_eager cells and test_cli_partitioned at four devices
def test_gpt2_at_four_devices_matches_torch(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2,
                                  n_head=2, use_cache=False, attn_implementation="eager")
    lm = transformers.GPT2LMHeadModel(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids, attention_mask=torch.ones_like(ids)).logits

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model, eager = _export(Logits(), (ids,), tmp_path, "gpt2")
    arguments = _arguments(model, (ids,))
    got, _ = _partitioned(model, arguments, 4)
    np.testing.assert_allclose(got, _single_device(model, arguments), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, eager, rtol=1e-4, atol=1e-4)
