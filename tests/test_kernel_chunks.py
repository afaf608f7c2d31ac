"""Every split the partitioner may choose, kernel by kernel: for each distinct fused kernel of
the corpus models and every dim (and pair of dims) the lowering accepts, each chunk's local
kernel equals the matching slice of the global kernel (see tests/kernel_chunks.py)."""

from __future__ import annotations

import pytest
import tvm
from kernel_chunks import check_split, global_run, lowerable_splits

torch = pytest.importorskip("torch")
corpus = pytest.importorskip("corpus")

from tvm_ext import pipeline  # noqa: E402
from tvm_ext.ir.graph_builder import build_graph  # noqa: E402
from tvm_ext.ir.kernel_dims import kernel_dims  # noqa: E402
from tvm_ext.models.loaders import load_file  # noqa: E402

# Models whose kernels cover the operators the corpus uses (others repeat these kernels).
MODELS = ["gpt2_eager", "llama_sdpa", "bert_eager", "t5_eager", "vit", "resnet", "wav2vec2",
          "segformer", *corpus.OPS]


def _kernels(name: str, tmp_path_factory):
    directory = tmp_path_factory.getbasetemp() / "corpus"
    directory.mkdir(exist_ok=True)
    path, _ = corpus.export(corpus.BY_NAME[name], str(directory))
    target = tvm.target.Target("llvm")
    fused = pipeline.fuse(load_file(path).mod, target)
    graph = build_graph(fused)
    seen = {}
    for op in graph.ops:
        if op.kind == "kernel" and op.kernel not in seen:
            seen[op.kernel] = (fused[op.kernel], len(op.outputs))
    return seen


def _check(name: str, tmp_path_factory, pairs: bool, halo: bool = False) -> None:
    failures, checked = [], 0
    for kernel, (func, num_outputs) in _kernels(name, tmp_path_factory).items():
        kd = kernel_dims(func, num_outputs, kernel)
        splits = lowerable_splits(kd, pairs=pairs, halo=halo)
        run = global_run(kd) if splits else None
        for factors in splits:
            result = check_split(kd, factors, run, kernel)
            checked += 1
            if result.error:
                failures.append(f"{kernel} split {result.factors}: {result.error}")
    assert not failures, "\n".join(failures)
    if not checked:
        pytest.skip(f"{name}: no kernel has a split the lowering accepts")


# In CI: the operator models (their kernels hold every kind of split the models' have:
# reductions, windows, gathers, attention); the sweep runs every model's kernels.
CI_MODELS = tuple(corpus.OPS)


@pytest.mark.parametrize("name", [
    name if name in CI_MODELS else pytest.param(name, marks=pytest.mark.sweep)
    for name in MODELS])
def test_every_lowerable_split_equals_the_global_kernel(name, tmp_path_factory):
    _check(name, tmp_path_factory, pairs=False)


@pytest.mark.parametrize("name", ["resnet", "convnext", "wav2vec2",
                                  pytest.param("segformer", marks=pytest.mark.sweep)])
def test_every_split_read_through_windows_equals_the_global_kernel(name, tmp_path_factory):
    """Dims read through windows (a convolution's or a pooling's rows, the taps of its
    window): each chunk from its input range, halo rows included (rows outside the input hold
    NaN), as a split in time runs it."""
    _check(name, tmp_path_factory, pairs=False, halo=True)


@pytest.mark.sweep
@pytest.mark.parametrize("name", MODELS)
def test_every_pair_of_splits_equals_the_global_kernel(name, tmp_path_factory):
    """Two dims cut at once (a 2x2 mesh): data and reduction splits combined."""
    _check(name, tmp_path_factory, pairs=True)
