"""Benchmark: tvm_ext against PyTorch eager on this CPU, on third-party models (issue 17).

Each model is a `transformers` architecture built from a config (as tests/corpus does) at a
size realistic for CPU inference of a small model: GPT-2, BERT and Llama-style decoders with
hidden 256, 4 layers, 4 heads, vocabulary 8192, batch 2 x sequence 64 (GPT-2 is ~5.3M
parameters); ViT, ResNet (and ConvNeXt, SegFormer) on 2 x 3 x 64 x 64 images; T5 and wav2vec2
on request. Each is exported with `torch.export`, saved as `.pt2` and loaded by
`tvm_ext.models.loaders.load_file`, as `scripts/compile.py` does, so both sides run the same
weights on the same inputs.

Modes: `inference` (torch: the module under `torch.inference_mode`) and `training` (tvm_ext's
`--training` step: the mse loss of the first output and every gradient; torch: forward, the
same loss and `torch.autograd.grad` of the module's parameters). Builds, each checked against
torch at `reference.tolerance` before it is timed (a mismatch is reported and not timed):

    torch       PyTorch eager, torch.set_num_threads(the threads TVM's runtime uses)
    untuned     the tvm_ext pipeline as `compile.py` builds it (library kernels on)
    no_library  the same with `library=False` (TVM's own code for GEMMs and convolutions)
    tuned       `--trials` MetaSchedule trials per model and mode into a temporary work dir,
                then built with those records (library kernels on); `--trials 0` skips it

Threads: every side runs on the threads TVM's runtime uses (`runtime.NumThreads`: TVM_NUM_THREADS,
else TVM's default, half the cores): torch by `torch.set_num_threads`, the OpenBLAS that
tvm_ext's library kernels call and numpy's OpenBLAS by their `openblas_set_num_threads` (the
library's own default, all cores unless TVM_NUM_THREADS is set, is recorded in the JSON).

All builds of a row are timed in one process in interleaved rounds (round-robin over the
builds, each round lasting about `--round-seconds` per build, warm-up excluded), as
benchmarks/tuning.py does; figures are medians over all timed calls. Tuned against untuned is
also compared round by round (each round's median ratio: the two ran back to back, under the
same load), with a 95% bootstrap interval of the median ratio over rounds.

Two more rows: `zoo_gpt`, the quick start's default model (`get_model("gpt")`, tiny) against a
PyTorch module written here that computes the same thing with the same weights; and the GEMM
rows: the largest GEMMs of the models' kernels (as DispatchLibraryKernels sees them), each as
a Relax `R.matmul` module built with the tvm_ext pipeline against `numpy.matmul` (OpenBLAS) on
the same shapes, with numpy's OpenBLAS held to the same thread count.

Targets (issue 17), each printed PASS, MISS or NOT MEASURED (never assumed):

    untuned / torch <= 1.5 on every model and mode (GPT-2, BERT, Llama, ViT, ResNet required)
    untuned / torch <= 1.0 on the GEMM-heavy language models (GPT-2, BERT, Llama; T5 if run)
    zoo gpt (tiny) untuned / torch <= 2.0
    dispatched GEMM >= 90% of numpy.matmul (numpy ms / tvm_ext ms) on every GEMM row
    tuned <= untuned on every row: none measurably slower, i.e. the 95% interval of the paired
        tuned / untuned ratio is not wholly above 1 (needs --trials > 0)

    python benchmarks/vs_torch.py [--models gpt2,bert,llama,vit,resnet,zoo_gpt | all]
        [--modes inference,training] [--trials 200] [--tune-dir DIR] [--rounds 15] [--gemms 3]
        [--skip-no-library] [--quick] [--json PATH]

Prints markdown tables and writes benchmarks/results/vs_torch.json. Exits 1 when a build
failed or disagreed with PyTorch (the targets are reported, not the exit status).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import glob
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

import tvm_ext  # noqa: F401  (runtime library, pipeline)
from tvm_ext import driver, pipeline, runtime
from tvm_ext.errors import CheckError
from tvm_ext.ir.library_kernels import BATCH, K, M, N, find_library_calls
from tvm_ext.ir.pass_records import LIBRARY_ATTR
from tvm_ext.models import Model, get_model, make_training_step
from tvm_ext.models.loaders import load_file
from tvm_ext.models.reference import tolerance
from tvm_ext.runtime.timing import time_calls

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import corpus  # noqa: E402  (tests/corpus: the builders' helpers)
import torch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "vs_torch.json"
RATIO_EVERY_MODEL = 1.5
RATIO_LANGUAGE = 1.0
RATIO_ZOO_GPT = 2.0
GEMM_FRACTION = 0.9
REQUIRED = ("gpt2", "bert", "llama", "vit", "resnet")
LANGUAGE = ("gpt2", "bert", "llama", "t5")
MODES = ("inference", "training")
BUILDS = ("untuned", "no_library", "tuned")

# Benchmark sizes, and the tiny ones of `--quick` (the corpus test's scale). A size may also
# give, per model, what the builders otherwise derive: `positions` (GPT-2, BERT: the position
# table, default `seq`), `ffn` (BERT, ViT: 4 x hidden; Llama: 8/3 x hidden rounded up to 32),
# `kv_heads` (Llama: heads / 2), `tie` (Llama: tied embedding and head, default no), `depths`,
# `layer_type`, `embedding` and `labels` (ResNet: one basic block per stage, the first
# stage's width, 10 classes); and `train_batch` (the batch of a training step, default
# `batch`). `model_size` applies a size's per-model entries (`MODEL_SIZES`).
SIZES = {
    "bench": dict(batch=2, seq=64, hidden=256, layers=4, heads=4, vocab=8192, image=64,
                  patch=8, channels=(32, 64, 128, 256), samples=4000),
    "quick": dict(batch=2, seq=16, hidden=32, layers=2, heads=4, vocab=128, image=16,
                  patch=4, channels=(8, 16), samples=520),
    # The sizes people run (benchmarks/vs_torch_gpu.py --size real): GPT-2 124M, BERT-base,
    # ViT-B/16, and per model below a decoder of Llama-3.2-1B's shape and ResNet-50.
    "real": dict(batch=8, train_batch=4, seq=512, hidden=768, layers=12, heads=12,
                 vocab=50257, positions=1024, image=224, patch=16),
}
MODEL_SIZES = {
    "real": {
        "bert": dict(vocab=30522, positions=512),
        "llama": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                      tie=True),
        "vit": dict(train_batch=8),
        "resnet": dict(train_batch=8, channels=(256, 512, 1024, 2048), embedding=64,
                       depths=(3, 4, 6, 3), layer_type="bottleneck", labels=1000),
    },
}


def model_size(name: str, size: str, training: bool = False) -> dict:
    """The size dict `name` is built with at `size` (its per-model entries applied); for a
    training step, `batch` is the size's `train_batch`."""
    s = dict(SIZES[size], **MODEL_SIZES.get(size, {}).get(name, {}))
    if training:
        s["batch"] = s.get("train_batch", s["batch"])
    return s


# ------------------------------------------------------------------------------------------
# Models: (eval-mode module, example inputs) from a size
# ------------------------------------------------------------------------------------------

def _gpt2(s: dict):
    import transformers as tf

    corpus._seed()
    cfg = tf.GPT2Config(vocab_size=s["vocab"], n_positions=s.get("positions", s["seq"]),
                        n_embd=s["hidden"],
                        n_layer=s["layers"], n_head=s["heads"], bos_token_id=0,
                        eos_token_id=0, attn_implementation="sdpa")
    return corpus._Logits.wrap(tf.GPT2LMHeadModel(cfg).eval()), (_ids(s),)


def _bert(s: dict):
    import transformers as tf

    corpus._seed()
    cfg = tf.BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                        intermediate_size=s.get("ffn", 4 * s["hidden"]),
                        max_position_embeddings=s.get("positions", s["seq"]),
                        attn_implementation="sdpa")
    module = corpus._Logits.wrap(tf.BertModel(cfg, add_pooling_layer=False).eval(),
                                 "last_hidden_state")
    return module, (_ids(s), corpus._padding_mask(torch, s["batch"], s["seq"]))


def _llama(s: dict):
    import transformers as tf

    corpus._seed()
    # 8/3 of hidden, rounded up to 32 (SwiGLU), unless given
    ffn = s.get("ffn", -(-8 * s["hidden"] // 3 // 32) * 32)
    cfg = tf.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=ffn,
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s.get("kv_heads", s["heads"] // 2),
                         max_position_embeddings=s.get("positions", s["seq"]),
                         tie_word_embeddings=s.get("tie", False),
                         bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return corpus._Logits.wrap(tf.LlamaForCausalLM(cfg).eval()), (_ids(s),)


def _t5(s: dict):
    import transformers as tf

    corpus._seed()
    cfg = tf.T5Config(vocab_size=s["vocab"], d_model=s["hidden"], d_kv=s["hidden"] // s["heads"],
                      d_ff=4 * s["hidden"], num_layers=s["layers"] // 2,
                      num_decoder_layers=s["layers"] // 2, num_heads=s["heads"],
                      decoder_start_token_id=0, attn_implementation="sdpa")
    return (corpus._Logits.wrap(tf.T5ForConditionalGeneration(cfg).eval()),
            (_ids(s), corpus._padding_mask(torch, s["batch"], s["seq"]), _ids(s)))


def _vit(s: dict):
    import transformers as tf

    corpus._seed()
    cfg = tf.ViTConfig(image_size=s["image"], patch_size=s["patch"], num_channels=3,
                       hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                       num_attention_heads=s["heads"],
                       intermediate_size=s.get("ffn", 4 * s["hidden"]),
                       attn_implementation="sdpa")
    module = corpus._Logits.wrap(tf.ViTModel(cfg, add_pooling_layer=False).eval(),
                                 "last_hidden_state")
    return module, (_images(s),)


def _resnet(s: dict):
    import transformers as tf

    corpus._seed()
    channels = list(s["channels"])
    cfg = tf.ResNetConfig(num_channels=3, embedding_size=s.get("embedding", channels[0]),
                          hidden_sizes=channels,
                          depths=list(s.get("depths", [1] * len(channels))),
                          layer_type=s.get("layer_type", "basic"),
                          num_labels=s.get("labels", 10))
    module = corpus._bn_statistics(tf.ResNetForImageClassification(cfg)).eval()
    return corpus._Logits.wrap(module), (_images(s),)


def _convnext(s: dict):
    import transformers as tf

    corpus._seed()
    channels = list(s["channels"])
    cfg = tf.ConvNextConfig(num_channels=3, hidden_sizes=channels, depths=[1] * len(channels),
                            patch_size=s["patch"] // 2, num_stages=len(channels), num_labels=10)
    return (corpus._Logits.wrap(tf.ConvNextForImageClassification(cfg).eval()),
            (_images(s),))


def _segformer(s: dict):
    import transformers as tf

    corpus._seed()
    channels = list(s["channels"])
    n = len(channels)
    cfg = tf.SegformerConfig(num_channels=3, num_encoder_blocks=n, depths=[1] * n,
                             sr_ratios=[2 ** (n - 1 - i) for i in range(n)],
                             hidden_sizes=channels, patch_sizes=[3] * n, strides=[2] * n,
                             num_attention_heads=[2 ** i for i in range(n)],
                             mlp_ratios=[4] * n, decoder_hidden_size=2 * channels[-1] // 4,
                             num_labels=4)
    return (corpus._Logits.wrap(tf.SegformerForSemanticSegmentation(cfg).eval()),
            (_images(s),))


def _wav2vec2(s: dict):
    import transformers as tf

    corpus._seed()
    conv = s["hidden"] // 2
    cfg = tf.Wav2Vec2Config(hidden_size=s["hidden"], num_hidden_layers=s["layers"] // 2,
                            num_attention_heads=s["heads"], intermediate_size=4 * s["hidden"],
                            conv_dim=(conv, conv), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_feat_extract_layers=2, num_conv_pos_embeddings=8,
                            num_conv_pos_embedding_groups=4, feat_extract_norm="layer",
                            do_stable_layer_norm=True, attn_implementation="eager")
    module = corpus._Logits.wrap(tf.Wav2Vec2Model(cfg).eval(), "last_hidden_state")
    samples = torch.randn(s["batch"], s["samples"], generator=torch.Generator().manual_seed(1))
    return module, (samples,)


def _ids(s: dict):
    return corpus._ids(torch, s["vocab"], s["batch"], s["seq"])


def _images(s: dict):
    shape = (s["batch"], 3, s["image"], s["image"])
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


BUILDERS: dict[str, Callable[[dict], tuple]] = {
    "gpt2": _gpt2, "bert": _bert, "llama": _llama, "vit": _vit, "resnet": _resnet,
    "t5": _t5, "convnext": _convnext, "segformer": _segformer, "wav2vec2": _wav2vec2,
}
DEFAULT_MODELS = (*REQUIRED, "zoo_gpt")
ALL_MODELS = (*BUILDERS, "zoo_gpt")


# ------------------------------------------------------------------------------------------
# Workloads: one model in one mode, as tvm_ext and torch run it
# ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Workload:
    """What both sides run: tvm_ext's `model` on `arguments`; torch's `torch_step()` (its
    outputs, tensors); `to_torch` maps tvm_ext's outputs onto torch's (tied weights)."""

    model: str
    mode: str
    tvm_model: Model
    arguments: list[np.ndarray]
    torch_step: Callable[[], list]
    to_torch: Callable[[list[np.ndarray]], list[np.ndarray]]
    info: dict
    names: tuple[str, ...] = ()  # of torch's outputs, for the check's messages


@dataclasses.dataclass
class Exported:
    name: str
    module: torch.nn.Module
    inputs: tuple
    program: object  # torch.export.ExportedProgram
    model: Model  # tvm_ext's, loaded from the .pt2


def export_model(name: str, size: dict, directory: str) -> Exported:
    """Build the model, export it to a .pt2 and load that with tvm_ext's loader."""
    module, inputs = BUILDERS[name](size)
    path = os.path.join(directory, f"{name}.pt2")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, inputs)
        torch.export.save(program, path)
        model = load_file(path)
    return Exported(name, module, inputs, program, model)


def _leaves(out) -> list:
    from torch.utils import _pytree

    return [t for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _numpy(tensors: list) -> list[np.ndarray]:
    return [t.detach().numpy() for t in tensors]


def _info(exp: Exported) -> dict:
    params = {id(p): p.numel() for p in exp.module.parameters()}
    return {"parameters": sum(params.values()),
            "inputs": [[list(t.shape), str(t.dtype).removeprefix("torch.")]
                       for t in exp.inputs]}


def inference_workload(exp: Exported) -> Workload:
    def step():
        with torch.inference_mode():
            return _leaves(exp.module(*exp.inputs))

    arguments = [*_numpy(list(exp.inputs)), *exp.model.weights]
    return Workload(exp.name, "inference", exp.model, arguments, step, lambda outs: outs,
                    _info(exp))


def training_workload(exp: Exported) -> Workload:
    """tvm_ext's `--training` step (mse loss of the first output, gradients of every float
    parameter) against torch's forward, the same loss and autograd. A weight the export lists
    twice (GPT-2's tied embedding and head) is one torch parameter: its gradients are summed."""
    from torch.export.graph_signature import InputKind

    step_model = make_training_step(exp.model, loss="mse")
    names = step_model.config["gradients"]
    targets = {s.arg.name: s.target for s in exp.program.graph_signature.input_specs
               if s.kind == InputKind.PARAMETER}
    params: list = []
    keys, groups = [], []
    for name in names:
        p = exp.module.get_parameter(targets[name])
        if not any(p is q for q in params):
            params.append(p)
            keys.append(f"gradient of {targets[name]}")
        groups.append(next(i for i, q in enumerate(params) if q is p))
    labels = step_model.inputs[-1].sample(np.random.default_rng(0))
    target = torch.from_numpy(labels)

    def step():
        value = ((_leaves(exp.module(*exp.inputs))[0] - target) ** 2).mean()
        grads = torch.autograd.grad(value, params, allow_unused=True)
        return [value, *(torch.zeros_like(p) if g is None else g
                         for p, g in zip(params, grads, strict=True))]

    def to_torch(outs: list[np.ndarray]) -> list[np.ndarray]:
        summed: list = [None] * len(params)
        for grad, j in zip(outs[1:], groups, strict=True):
            summed[j] = grad if summed[j] is None else summed[j] + grad
        return [outs[0], *summed]

    arguments = [*_numpy(list(exp.inputs)), labels, *exp.model.weights]
    info = dict(_info(exp), gradients=len(names), torch_parameters=len(params))
    return Workload(exp.name, "training", step_model, arguments, step, to_torch, info,
                    ("the loss", *keys))


class _TorchBlock(torch.nn.Module):
    """tvm_ext.models.gpt.Block in PyTorch: pre-norm causal attention and a GELU (erf) MLP."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.q, self.k = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, hidden)
        self.v, self.proj = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x, mask):
        b, t, d = x.shape
        head_dim = d // self.heads
        h = self.ln1(x)

        def split(z):
            return z.reshape(b, t, self.heads, head_dim).permute(0, 2, 1, 3)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))
        attn = torch.softmax(scores + mask, dim=-1)
        y = torch.matmul(attn, v).permute(0, 2, 1, 3).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class _TorchGPT(torch.nn.Module):
    """tvm_ext.models.gpt.GPT in PyTorch, with the same parameter names."""

    def __init__(self, seq: int, hidden: int, heads: int, layers: int, vocab: int):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, hidden)
        self.wpe = torch.nn.Embedding(seq, hidden)
        self.blocks = torch.nn.ModuleList([_TorchBlock(hidden, heads) for _ in range(layers)])
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        mask = torch.triu(torch.full((seq, seq), -1e9), 1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(t))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln_f(x))


def zoo_gpt_workload() -> Workload:
    """The quick start's default model (zoo gpt, tiny) and `_TorchGPT` with its weights."""
    model = get_model("gpt")
    config = {k: model.config[k] for k in ("seq", "hidden", "heads", "layers", "vocab")}
    module = _TorchGPT(**config).eval()
    weights = model.random_params(0)
    module.load_state_dict({p.name: torch.from_numpy(w)
                            for p, w in zip(model.params, weights, strict=True)})
    inputs = model.random_inputs(0)
    ids = torch.from_numpy(inputs[0]).long()

    def step():
        with torch.inference_mode():
            return [module(ids)]

    info = {"parameters": sum(p.numel() for p in module.parameters()),
            "inputs": [[list(ids.shape), "int32"]], "zoo_size": "tiny"}
    return Workload("zoo_gpt", "inference", model, [*inputs, *weights], step,
                    lambda outs: outs, info)


# ------------------------------------------------------------------------------------------
# Builds, checks and interleaved timing
# ------------------------------------------------------------------------------------------

def _error(err: BaseException) -> str:
    """The error's type and its last informative line (TVM's messages carry a traceback)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {(lines[-1] if lines else '')[:300]}"


def build_column(work: Workload, build: str, target, trials: int, work_dir: str) -> dict:
    """Compile one build of `work`: {"executable"} or {"error"}, with the seconds spent."""
    column: dict = {}
    start = time.perf_counter()
    try:
        if build == "tuned":
            db = os.path.join(work_dir, f"{work.model}_{work.mode}")
            report = driver.tune(work.tvm_model.mod, target, db, trials,
                                 log=lambda line: None, library=True)
            column["tune_s"] = time.perf_counter() - start
            column["tuning_tasks"] = len(report.tasks)
            column["trials"] = report.trials_before + report.trials_run
            column["executable"] = driver.build(work.tvm_model, target, tune_db=db)
        else:
            column["executable"] = driver.build(work.tvm_model, target,
                                                library=build != "no_library")
    except Exception as err:  # reported in the row, not hidden
        column["error"] = f"build failed: {_error(err)}"
    column["build_s"] = time.perf_counter() - start - column.get("tune_s", 0.0)
    return column


def check_outputs(outputs: list[np.ndarray], expected: list[np.ndarray],
                  names: tuple[str, ...] = ()) -> dict:
    """Each output against torch's at the tolerance of its dtype (reference.tolerance)."""
    result: dict = {"ok": False, "outputs": len(outputs), "max_abs_error": 0.0,
                    "max_rel_error": 0.0}
    try:
        if len(outputs) != len(expected):
            raise CheckError(f"{len(outputs)} outputs, torch has {len(expected)}")
        for i, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
            rtol, atol = tolerance(out.dtype)
            try:
                one = driver.compare([out], [exp], rtol, atol)
            except CheckError as err:
                name = f"output {i}" + (f" ({names[i]})" if i < len(names) else "")
                raise CheckError(f"{name}{str(err).removeprefix('output 0')}") from None
            result["max_abs_error"] = max(result["max_abs_error"], one.max_abs_error)
            result["max_rel_error"] = max(result["max_rel_error"], one.max_rel_error)
    except CheckError as err:
        result["error"] = str(err)
        return result
    result["ok"] = True
    return result


def _vm_call(executable, arguments: list[np.ndarray]) -> tuple[Callable, Callable]:
    """(call, sync) of `main` on this CPU with the arguments placed once."""
    device = tvm.cpu()
    vm = relax.VirtualMachine(executable, device)
    args = [runtime.to_device(a, device) for a in arguments]
    main = vm["main"]
    return (lambda: main(*args)), device.sync


def time_interleaved(calls: dict[str, tuple[Callable, Callable]], rounds: int,
                     round_s: float) -> dict[str, list[list[float]]]:
    """Per-call latencies (ms) of each (call, sync), one list per round, in `rounds`
    round-robin rounds; one warm-up call each (untimed) sizes its share of a round to about
    `round_s` seconds."""
    repeat = {}
    for name, (call, sync) in calls.items():
        call()  # warm-up
        sync()
        once = time_calls(call, sync, 1)[0] / 1e3
        repeat[name] = max(1, int(round_s / max(once, 1e-6)))
    latencies: dict[str, list[list[float]]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (call, sync) in calls.items():
            latencies[name].append(time_calls(call, sync, repeat[name]))
    return latencies


def paired_ratio(rounds_a: list[list[float]], rounds_b: list[list[float]],
                 resamples: int = 4000, seed: int = 0) -> dict:
    """a / b from interleaved rounds: the median over rounds of each round's median ratio
    (rounds are paired: both ran back to back, under the same load), and a 95% bootstrap
    interval of that median (rounds resampled with replacement)."""
    ratios = np.array([np.median(a) / np.median(b) for a, b in zip(rounds_a, rounds_b,
                                                                   strict=True)])
    boots = np.median(np.random.default_rng(seed).choice(ratios, (resamples, len(ratios))),
                      axis=1)
    return {"ratio": float(np.median(ratios)),
            "ci95": [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))],
            "rounds": len(ratios)}


def bench_workload(work: Workload, builds: list[str], target, trials: int, work_dir: str,
                   rounds: int, round_s: float) -> dict:
    """One row: torch and every build checked, then the agreeing ones timed side by side."""
    expected = _numpy(work.torch_step())
    row: dict = {"model": work.model, "mode": work.mode, **work.info, "builds": {}}
    calls = {"torch": (work.torch_step, lambda: None)}
    for build in builds:
        column = build_column(work, build, target, trials, work_dir)
        executable = column.pop("executable", None)
        if executable is not None:
            try:
                call, sync = _vm_call(executable, work.arguments)
                outputs = work.to_torch(driver.flatten_outputs(call()))
                column["check"] = check_outputs(outputs, expected, work.names)
                if column["check"]["ok"]:
                    calls[build] = (call, sync)
                else:
                    column["error"] = f"outputs differ: {column['check']['error']}"
            except Exception as err:  # e.g. a library function missing at run time
                column["error"] = f"run failed: {_error(err)}"
        row["builds"][build] = column
    load_before = os.getloadavg()[0]
    per_round = time_interleaved(calls, rounds, round_s)
    row["loadavg"] = [load_before, os.getloadavg()[0]]
    latencies = {name: [x for r in lists for x in r] for name, lists in per_round.items()}
    row["torch_ms"] = float(np.median(latencies["torch"]))
    row["torch_calls"] = len(latencies["torch"])
    for build, column in row["builds"].items():
        if build in latencies:
            column["ms"] = float(np.median(latencies[build]))
            column["calls"] = len(latencies[build])
            column["ratio"] = column["ms"] / row["torch_ms"]
    if "tuned" in per_round and "untuned" in per_round:
        row["tuned_vs_untuned"] = paired_ratio(per_round["tuned"], per_round["untuned"])
    return row


# ------------------------------------------------------------------------------------------
# GEMM rows: the models' largest GEMMs, dispatched, against numpy.matmul
# ------------------------------------------------------------------------------------------

def gemm_shapes(model: Model, target) -> list[dict]:
    """The float32 GEMMs of `model`'s kernels as DispatchLibraryKernels sees them:
    {"a": A's shape, "b": B's shape, "flops"} with A (batch.., M, K) and B ([batch..,] K, N)."""
    staged = pipeline.module_at_schedule_phase(model.mod, target, library=False)
    found = []
    for gv, func in staged.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        for call in find_library_calls(func):
            if call.kind != "gemm" or set(call.dtypes) != {"float32"}:
                continue
            dims: dict[int, int] = {}
            batched = []
            for roles, view, buf in zip(call.roles, call.views or (None,) * 3,
                                        call.operands, strict=True):
                shape = [int(d) for d in buf.ty.shape]
                view = view or tuple((i,) for i in range(len(shape)))
                for role, axes in zip(roles, view, strict=True):
                    dims[role] = int(np.prod([shape[a] for a in axes]))
                batched.append(any(r >= BATCH for r in roles))
            batch = [dims[r] for r in sorted(r for r in dims if r >= BATCH)]
            a = [*batch, dims[M], dims[K]] if batched[0] else [dims[M], dims[K]]
            b = [*batch, dims[K], dims[N]] if batched[1] else [dims[K], dims[N]]
            flops = 2 * int(np.prod(batch or [1])) * dims[M] * dims[N] * dims[K]
            found.append({"a": a, "b": b, "flops": flops, "kernel": gv.name_hint})
    return found


def largest_gemms(shapes: list[dict], count: int) -> list[dict]:
    """The `count` largest distinct shapes, each naming the models it came from."""
    distinct: dict = {}
    for s in shapes:
        key = (tuple(s["a"]), tuple(s["b"]))
        entry = distinct.setdefault(key, dict(s, models=[]))
        if s["model"] not in entry["models"]:
            entry["models"].append(s["model"])
    ranked = sorted(distinct.values(), key=lambda s: -s["flops"])[:count]
    return [{k: v for k, v in s.items() if k != "model"} for s in ranked]


def bench_gemm(shape: dict, target, rounds: int, round_s: float) -> dict:
    """`R.matmul` on the shape through the tvm_ext pipeline against `numpy.matmul`."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(shape["a"], "float32"))
    b = relax.Var("b", relax.TensorType(shape["b"], "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(a, b))
        bb.emit_func_output(out)
    mod = bb.get()
    row = dict(shape)
    staged = pipeline.module_at_schedule_phase(mod, target)
    row["dispatched"] = any(isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
                            and LIBRARY_ATTR in f.attrs for _, f in staged.functions_items())
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape["a"], dtype=np.float32)
    y = rng.standard_normal(shape["b"], dtype=np.float32)
    out = np.matmul(x, y)
    calls = {"numpy": (lambda: np.matmul(x, y, out=out), lambda: None)}
    try:
        with target:
            executable = tvm.compile(mod, target,
                                     relax_pipeline=relax.get_pipeline("tvm_ext", target=target))
        call, sync = _vm_call(executable, [x, y])
        row["check"] = check_outputs([call().numpy()], [np.matmul(x, y)])
        if row["check"]["ok"]:
            calls["tvm_ext"] = (call, sync)
        else:
            row["error"] = f"outputs differ: {row['check']['error']}"
    except Exception as err:  # e.g. the library function missing at run time
        row["error"] = f"failed: {_error(err)}"
    latencies = {name: [x for r in lists for x in r]
                 for name, lists in time_interleaved(calls, rounds, round_s).items()}
    row["numpy_ms"] = float(np.median(latencies["numpy"]))
    if "tvm_ext" in latencies:
        row["tvm_ext_ms"] = float(np.median(latencies["tvm_ext"]))
        row["fraction"] = row["numpy_ms"] / row["tvm_ext_ms"]
    return row


# ------------------------------------------------------------------------------------------
# Machine and threads
# ------------------------------------------------------------------------------------------

def _numpy_openblas() -> str | None:
    """The path of numpy's bundled OpenBLAS, or None where it cannot be found."""
    folder = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    found = sorted(glob.glob(os.path.join(folder, "libscipy_openblas*.so")))
    return found[0] if found else None


def _pin_openblas(path: str | None, threads: int) -> dict:
    """Set the OpenBLAS at `path` (the same instance the process already loaded: dlopen of a
    loaded file returns it) to `threads` threads: {"path", "default", "threads"}."""
    # Where it lies in the Python environment, not on this machine.
    entry: dict = {"path": path and os.path.relpath(path, sys.prefix), "default": None,
                   "threads": None}
    if not path:
        return entry
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        entry["error"] = str(err)
        return entry
    # scipy-openblas prefixes its symbols (and the 64-bit-integer build suffixes them).
    for prefix, suffix in (("scipy_", "64_"), ("scipy_", ""), ("", "")):
        getter = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
        setter = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
        if getter is not None and setter is not None:
            entry["default"] = int(getter())
            setter(ctypes.c_int(threads))
            entry["threads"] = int(getter())
            break
    return entry


def set_threads(threads: int) -> dict:
    """Hold every side to `threads` threads (TVM's own count): torch, numpy's OpenBLAS (the
    GEMM rows' reference) and the BLAS tvm_ext's library kernels call, whose own default (all
    cores unless TVM_NUM_THREADS is set) is recorded."""
    from tvm_ext.runtime import blas

    torch.set_num_threads(threads)
    return {"tvm_runtime_threads": threads, "torch_threads": torch.get_num_threads(),
            "numpy_openblas": _pin_openblas(_numpy_openblas(), threads),
            "tvm_ext_blas": _pin_openblas(blas.cpu_blas_path(), threads)}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "host": platform.node(),
            "TVM_NUM_THREADS": os.environ.get("TVM_NUM_THREADS", "unset"),
            "torch": torch.__version__, "tvm": tvm.__version__, "numpy": np.__version__}


def tvm_threads() -> int:
    """The threads TVM's runtime thread pool runs parallel kernels on."""
    return int(tvm.get_global_func("runtime.NumThreads")())


# ------------------------------------------------------------------------------------------
# Targets and tables
# ------------------------------------------------------------------------------------------

def _ratio_target(name: str, text: str, rows: list[dict], required: list[tuple[str, str]],
                  value, limit: float, exceeds=None) -> dict:
    """PASS when every required cell was measured and no row exceeds the limit
    (`exceeds(row, value)`, default `value(row) > limit`); MISS when a row exceeds it or its
    build failed or disagreed; else NOT MEASURED."""
    exceeds = exceeds or (lambda row, v: v > limit)
    cells = {(r["model"], r["mode"]): r for r in rows}
    missing = [f"{m} {mode}" for m, mode in required if (m, mode) not in cells]
    details, failed = [], []
    for r in rows:
        v, why = value(r)
        details.append({"model": r["model"], "mode": r["mode"], "value": v, "note": why})
        if v is None or exceeds(r, v):
            failed.append(f"{r['model']} {r['mode']}: " + (why or f"{v:.2f}"))
    if failed:
        status = "MISS"
    elif missing or not rows:
        status = "NOT MEASURED"
    else:
        status = "PASS"
    return {"name": name, "target": text, "status": status, "limit": limit,
            "cells": details, "failed": failed, "not_measured": missing}


def _ratio_of(build: str):
    def value(row: dict) -> tuple[float | None, str | None]:
        column = row["builds"].get(build, {})
        return column.get("ratio"), _reason(column.get("error"))
    return value


def _tuned_vs_untuned(row: dict) -> tuple[float | None, str | None]:
    tuned, untuned = row["builds"].get("tuned", {}), row["builds"].get("untuned", {})
    if "tuned_vs_untuned" in row:
        paired = row["tuned_vs_untuned"]
        lo, hi = paired["ci95"]
        return paired["ratio"], f"{paired['ratio']:.3f} (95% interval {lo:.3f}-{hi:.3f})"
    return None, _reason(tuned.get("error") or untuned.get("error")) or "not timed"


def _measurably_slower(row: dict, ratio: float) -> bool:
    """Tuned is slower than untuned when its whole 95% interval lies above 1 (a ratio whose
    interval reaches 1 is within this machine's noise)."""
    return row["tuned_vs_untuned"]["ci95"][0] > 1.0


def _reason(error: str | None) -> str | None:
    """"outputs differ", "run failed", "build failed": the kind of a column's error (the
    table's notes give the whole message)."""
    return error.split(":")[0] if error else None


def evaluate_targets(rows: list[dict], gemms: list[dict], trials: int) -> list[dict]:
    """The issue's targets, each PASS, MISS or NOT MEASURED, with the cells that decided."""
    models = [r for r in rows if r["model"] != "zoo_gpt"]
    language = [r for r in models if r["model"] in LANGUAGE]
    zoo = [r for r in rows if r["model"] == "zoo_gpt"]
    every = [(m, mode) for m in REQUIRED for mode in MODES]
    targets = [
        _ratio_target("every_model",
                      f"untuned / torch <= {RATIO_EVERY_MODEL} on every model and mode",
                      models, every, _ratio_of("untuned"), RATIO_EVERY_MODEL),
        _ratio_target("language_models", f"untuned / torch <= {RATIO_LANGUAGE} on the "
                      "GEMM-heavy language models", language,
                      [c for c in every if c[0] in LANGUAGE], _ratio_of("untuned"),
                      RATIO_LANGUAGE),
        _ratio_target("zoo_gpt", f"zoo gpt (tiny) untuned / torch <= {RATIO_ZOO_GPT}", zoo,
                      [("zoo_gpt", "inference")], _ratio_of("untuned"), RATIO_ZOO_GPT),
    ]
    gemm = {"name": "gemm", "target": f"dispatched GEMM >= {GEMM_FRACTION:.0%} of numpy.matmul",
            "limit": GEMM_FRACTION, "cells": [], "failed": [], "not_measured": []}
    for g in gemms:
        name = f"{g['a']} @ {g['b']}"
        frac = g.get("fraction")
        gemm["cells"].append({"gemm": name, "value": frac, "dispatched": g["dispatched"],
                              "note": g.get("error")})
        if not g["dispatched"]:
            gemm["failed"].append(f"{name}: not dispatched to the library")
        elif frac is None or frac < GEMM_FRACTION:
            gemm["failed"].append(f"{name}: " + (_reason(g.get("error")) or f"{frac:.0%}"))
    gemm["status"] = "MISS" if gemm["failed"] else ("PASS" if gemms else "NOT MEASURED")
    if not gemms:
        gemm["not_measured"] = ["no GEMM row (--gemms 0, or no model run)"]
    targets.append(gemm)
    text = ("tuned <= untuned (library kernels on) on every row: no row measurably slower "
            "(paired rounds, 95% interval of tuned / untuned not above 1)")
    if trials > 0:
        tuned = _ratio_target("tuned", text, rows, [], _tuned_vs_untuned, 1.0,
                              _measurably_slower)
    else:
        tuned = {"name": "tuned", "target": text, "status": "NOT MEASURED", "limit": 1.0,
                 "cells": [], "failed": [], "not_measured": ["--trials 0: no tuned build"]}
    targets.append(tuned)
    return targets


def _ms(column: dict | None) -> tuple[str, str]:
    if column is None:
        return "", ""
    if "ms" in column:
        return f"{column['ms']:.2f}", f"{column['ratio']:.2f}x"
    return "error" if "check" not in column or column["check"]["ok"] else "mismatch", ""


def table(rows: list[dict], builds: list[str]) -> str:
    names = {"untuned": "untuned", "no_library": "no-library", "tuned": "tuned"}
    head = "| model | mode | params | torch ms |"
    for b in builds:
        head += f" {names[b]} ms | {names[b]} / torch |"
    lines = [head, "|" + " --- |" * (4 + 2 * len(builds))]
    paired = "tuned" in builds
    if paired:
        head += " tuned / untuned (95% interval) |"
        lines = [head, "|" + " --- |" * (5 + 2 * len(builds))]
    for r in rows:
        cells = [r["model"], r["mode"], f"{r['parameters'] / 1e6:.2f}M", f"{r['torch_ms']:.2f}"]
        for b in builds:
            cells += list(_ms(r["builds"].get(b)))
        if paired:
            p = r.get("tuned_vs_untuned")
            cells.append(f"{p['ratio']:.3f} ({p['ci95'][0]:.3f}-{p['ci95'][1]:.3f})" if p
                         else "")
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r['model']} {r['mode']} {b}: {c['error']}" for r in rows
             for b, c in r["builds"].items() if "error" in c]
    return "\n".join(lines + (["", *notes] if notes else []))


def gemm_table(gemms: list[dict]) -> str:
    lines = ["| A @ B | from | numpy ms | tvm_ext ms | fraction | dispatched |",
             "| --- | --- | --- | --- | --- | --- |"]
    for g in gemms:
        tvm_ms = f"{g['tvm_ext_ms']:.3f}" if "tvm_ext_ms" in g else "error"
        frac = f"{g['fraction']:.0%}" if "fraction" in g else ""
        lines.append(f"| {g['a']} @ {g['b']} | {', '.join(g['models'])} | "
                     f"{g['numpy_ms']:.3f} | {tvm_ms} | {frac} | {g['dispatched']} |")
    notes = [f"- {g['a']} @ {g['b']}: {g['error']}" for g in gemms if "error" in g]
    return "\n".join(lines + (["", *notes] if notes else []))


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------

def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated, or 'all' ({', '.join(ALL_MODELS)})")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--trials", type=int, default=200,
                   help="MetaSchedule trials per model and mode for the tuned column (0: none)")
    p.add_argument("--tune-dir", help="keep the tuning databases there (one per model and "
                   "mode; a later run with the same budget reuses them and tunes nothing); "
                   "default: a temporary directory")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds (default 15; quick 2)")
    p.add_argument("--round-seconds", type=float,
                   help="seconds per build per round (default 0.25; quick 0.02)")
    p.add_argument("--gemms", type=int, help="largest GEMM shapes to time (default 3; quick 1)")
    p.add_argument("--skip-no-library", action="store_true", help="no `library=False` column")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (smoke test)")
    p.add_argument("--json", default=str(RESULTS), help="where the results go")
    args = p.parse_args(argv)
    args.models = list(ALL_MODELS) if args.models == "all" else args.models.split(",")
    args.modes = args.modes.split(",")
    unknown = set(args.models) - set(ALL_MODELS) or set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown model or mode: {', '.join(sorted(unknown))}")
    if args.rounds is None:
        args.rounds = 2 if args.quick else 15
    if args.round_seconds is None:
        args.round_seconds = 0.02 if args.quick else 0.25
    if args.gemms is None:
        args.gemms = 1 if args.quick else 3
    args.builds = [b for b in BUILDS if not (b == "no_library" and args.skip_no_library)
                   and not (b == "tuned" and args.trials <= 0)]
    return args


def _workloads(name: str, modes: list[str], size: dict,
               directory: str) -> tuple[list[Workload], Model | None]:
    """The workloads of one model in `modes`, and its forward model (for its GEMM shapes)."""
    if name == "zoo_gpt":
        if "inference" not in modes:
            print("== zoo_gpt: inference only (the quick start's default command)")
            return [], None
        work = zoo_gpt_workload()
        return [work], work.tvm_model
    exp = export_model(name, size, directory)
    return ([(inference_workload if m == "inference" else training_workload)(exp)
             for m in modes], exp.model)


def _summary(row: dict) -> str:
    parts = [f"torch {row['torch_ms']:.2f} ms"]
    for build, column in row["builds"].items():
        parts.append(f"{build} {column['ms']:.2f} ms ({column['ratio']:.2f}x)" if "ms" in column
                     else f"{build} {column['error']}")
    return f"   {row['model']} {row['mode']}: " + ", ".join(parts)


def run(args: argparse.Namespace) -> dict:
    target = driver.resolve_target("llvm")
    size = SIZES["quick" if args.quick else "bench"]
    rows, shapes = [], []
    work_dir = tempfile.mkdtemp(prefix="tvm_ext_vs_torch_")
    tune_dir = args.tune_dir or work_dir
    try:
        for name in args.models:
            works, forward = _workloads(name, args.modes, size, work_dir)
            if forward is not None and args.gemms > 0:
                shapes += [dict(s, model=name) for s in gemm_shapes(forward, target)]
            for work in works:
                print(f"== {work.model} {work.mode}", flush=True)
                row = bench_workload(work, args.builds, target, args.trials, tune_dir,
                                     args.rounds, args.round_seconds)
                print(_summary(row), flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    gemms = [bench_gemm(s, target, args.rounds, args.round_seconds)
             for s in largest_gemms(shapes, args.gemms)]
    return {"rows": rows, "gemms": gemms, "size": size}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    wall = time.perf_counter()
    threads = set_threads(tvm_threads())
    result = run(args)
    rows, gemms = result["rows"], result["gemms"]
    targets = evaluate_targets(rows, gemms, args.trials)
    host = machine()
    print()
    print(f"machine: {host['cpu']}, {host['cores']} cores; TVM_NUM_THREADS="
          f"{host['TVM_NUM_THREADS']}, TVM runtime threads {threads['tvm_runtime_threads']}, "
          f"torch threads {threads['torch_threads']} (torch.set_num_threads), numpy OpenBLAS "
          f"threads {threads['numpy_openblas']['threads']}, tvm_ext BLAS threads "
          f"{threads['tvm_ext_blas']['threads']} (its default "
          f"{threads['tvm_ext_blas']['default']}; {threads['tvm_ext_blas']['path']})")
    print(f"medians of {args.rounds} interleaved rounds; tuned: {args.trials} trials per model "
          f"and mode{' (skipped)' if args.trials <= 0 else ''}\n")
    print(table(rows, args.builds))
    if gemms:
        print()
        print(gemm_table(gemms))
    print()
    for t in targets:
        why = "; ".join(t["failed"] or [f"not measured: {', '.join(t['not_measured'])}"]
                        if t["status"] != "PASS" else [])
        print(f"target {t['target']}: {t['status']}{f' ({why})' if why else ''}")
    wall = time.perf_counter() - wall
    out = {"benchmark": "vs_torch", "machine": host, "threads": threads,
           "target": "llvm", "quick": args.quick, "size": result["size"],
           "models": args.models, "modes": args.modes, "builds": ["torch", *args.builds],
           "trials": args.trials, "rounds": args.rounds, "round_seconds": args.round_seconds,
           "wall_seconds": wall, "rows": rows, "gemms": gemms, "targets": targets,
           "argv": [_repo_relative(a) for a in (sys.argv[1:] if argv is None else argv)]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{args.json}.tmp"
    Path(tmp).write_text(json.dumps(out, indent=1, default=str) + "\n")
    os.replace(tmp, args.json)
    print(f"wrote {_repo_relative(str(args.json))} ({wall:.0f} s)")
    broken = [c for r in rows for c in r["builds"].values() if "error" in c]
    broken += [g for g in gemms if "error" in g]
    return 1 if broken else 0


def _repo_relative(arg: str) -> str:
    """An absolute path as a path relative to the repository (what the results may hold of the
    machine they ran on); any other argument as it is."""
    return os.path.relpath(arg, ROOT) if os.path.isabs(arg) else arg


if __name__ == "__main__":
    sys.exit(main())
