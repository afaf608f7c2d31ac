"""Differential testing on third-party models (tests/corpus): each model is exported with
`torch.export`, compiled by `scripts/compile.py` in every mode, run, and checked against the
unmodified TVM build AND against PyTorch eager (gradients against torch.autograd for the
training step), at the tolerances of `tvm_ext.models.reference`.

The CI sweep runs every model plain, swapped at 50%, partitioned over 2 and 4 devices and
trained; `pytest -m sweep` adds k = 3 and 8, the smallest swap budget and partition + swap.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
corpus = pytest.importorskip("corpus")

from tvm_ext import cli  # noqa: E402

MODES = {
    "plain": [],
    "swap50": ["--device-memory", "50%"],
    "k2": ["--devices", "2"],
    "k4": ["--devices", "4"],
    "training": ["--training"],
}
SWEEP_MODES = {
    "k3": ["--devices", "3"],
    "k8": ["--devices", "8"],
    "swapmin": ["--device-memory", "min"],
    "k2_swap50": ["--devices", "2", "--device-memory", "50%"],
}

# Operator modules run the modes that exercise their kernels; swapping one kernel is moot.
OP_MODES = ("plain", "k2", "k4", "training", "k3", "k8")

# What a user gets where a mode does not apply: a clear refusal (exit 2, this message), never a
# wrong number. Swap budgets below the largest operator's working set need operator splitting.
FLOOR = "smallest feasible budget is"
EXPECTED_REFUSALS = {
    (name, "swap50"): FLOOR for name in ("resnet", "convnext", "wav2vec2", "segformer")
}


def _cases(modes: dict, mark=None):
    for model in corpus.MODELS:
        for mode in modes:
            if (mode == "training" and not model.training) or (
                    model.kind == "op" and mode not in OP_MODES):
                continue
            marks = [mark] if mark else []
            yield pytest.param(model.name, mode, id=f"{model.name}-{mode}", marks=marks)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")


def _run(name: str, mode: str, args: list[str], corpus_dir, tmp_path, capsys) -> None:
    path, _ = corpus.export(corpus.BY_NAME[name], str(corpus_dir))
    report = tmp_path / "report.json"
    status = cli.main([path, "--target", "llvm", *args, "--run", "--check",
                       "--report", str(report)])
    refusal = EXPECTED_REFUSALS.get((name, mode))
    if refusal is not None:
        err = capsys.readouterr().err
        assert status == 2 and refusal in err, f"{name} {mode}: exit {status}, {err}"
        return
    data = json.loads(report.read_text()) if report.exists() else {}
    check = data.get("check", {})
    assert status == 0, f"{name} {mode}: exit {status}, check {check}"
    assert check.get("ok") is True, check
    torch_check = check.get("torch", {})
    assert torch_check.get("ok") is True, f"{name} {mode}: not compared with PyTorch: " \
                                          f"{torch_check}"


@pytest.mark.parametrize(("name", "mode"), list(_cases(MODES)))
def test_corpus(name, mode, corpus_dir, tmp_path, capsys):
    _run(name, mode, MODES[mode], corpus_dir, tmp_path, capsys)


@pytest.mark.parametrize(("name", "mode"), list(_cases(SWEEP_MODES, pytest.mark.sweep)))
def test_corpus_sweep(name, mode, corpus_dir, tmp_path, capsys):
    _run(name, mode, SWEEP_MODES[mode], corpus_dir, tmp_path, capsys)
