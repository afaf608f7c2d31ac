"""Third-party models for differential testing: `transformers` architectures built from configs
at tiny sizes (random weights, no downloads) and small torch modules for single operators,
exported with `torch.export` exactly as a user would (`torch.export.save` to a `.pt2`).

Each entry is a `CorpusModel`: a name, a builder returning `(module, example_inputs)` in eval
mode, and the modes the sweep runs on it. Most models are wrapped to return one tensor; some
are exported as `transformers` returns them (`*_unwrapped`: an output dataclass). Sizes are
picked so that every dim a partition may cut (batch 2 or 4, sequence 16, hidden 32 or 64)
divides by 2, 4 and 8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

BATCH, SEQ, VOCAB = 4, 16, 128


@dataclasses.dataclass(frozen=True)
class CorpusModel:
    name: str
    build: Callable[[], tuple[object, tuple]]
    kind: str  # "language", "vision", "audio", "op"
    # Whether the training step (loss over the first output, gradients) is swept.
    training: bool = True
    # The CI modes the default tests run (None: all); the others go to the sweep.
    ci_modes: tuple[str, ...] | None = None


def _seed():
    import torch

    torch.manual_seed(0)
    return torch


def _ids(torch, vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _padding_mask(torch, batch: int = BATCH, seq: int = SEQ):
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[1, seq - 5:] = 0  # one padded row: masks must reach the attention
    return mask


class _Logits:
    """Wraps a `transformers` model so that export sees tensors in and one tensor out."""

    @staticmethod
    def wrap(model, field: str = "logits"):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = model

            def forward(self, *args):
                out = self.inner(*args)
                return getattr(out, field) if not isinstance(out, torch.Tensor) else out

        return Wrapped().eval()


def gpt2(attn: str, hidden: int = 32, layers: int = 2, seq: int = SEQ, vocab: int = VOCAB,
         batch: int = BATCH):
    """(Larger `hidden`, `layers`, `seq`: the same architecture at the sizes of a benchmark;
    4 heads, or one per 64 of `hidden` when that is more.)"""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                            n_head=max(4, hidden // 64), attn_implementation=attn)
        return (_Logits.wrap(tf.GPT2LMHeadModel(cfg).eval()),
                (_ids(torch, vocab, batch, seq),))
    return build


def llama(attn: str, hidden: int = 32, layers: int = 2, seq: int = SEQ, vocab: int = VOCAB,
          batch: int = BATCH, left_padded: bool = False):
    """RoPE, RMSNorm, SiLU gates, grouped-query attention (a third of the heads as KV heads,
    rounded up; 2 for 4 heads at the tiny size). `left_padded`: an `attention_mask` input that
    pads the second row on the left, so that under the causal mask its first query rows see no
    key (PyTorch zeroes them, forward and gradient)."""
    def build():
        torch = _seed()
        import transformers as tf

        heads = max(4, hidden // 64)
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=max(2, heads // 3),
                             max_position_embeddings=seq, attn_implementation=attn)
        inputs = (_ids(torch, vocab, batch, seq),)
        if left_padded:
            mask = torch.ones(batch, seq, dtype=torch.int64)
            mask[1, :3] = 0
            inputs = (*inputs, mask)
        return _Logits.wrap(tf.LlamaForCausalLM(cfg).eval()), inputs
    return build


def bert(attn: str, hidden: int = 32, layers: int = 2, seq: int = SEQ, vocab: int = VOCAB,
         batch: int = BATCH):
    """An encoder with a padding mask (larger sizes as for `gpt2`)."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=max(4, hidden // 64),
                            intermediate_size=2 * hidden, max_position_embeddings=seq,
                            attn_implementation=attn)
        model = _Logits.wrap(tf.BertModel(cfg, add_pooling_layer=False).eval(),
                             "last_hidden_state")
        return model, (_ids(torch, vocab, batch, seq), _padding_mask(torch, batch, seq))
    return build


def t5(attn: str, hidden: int = 32, seq: int = SEQ, vocab: int = VOCAB, batch: int = BATCH):
    """Encoder-decoder with relative position bias, one layer each."""
    def build():
        torch = _seed()
        import transformers as tf

        heads = max(4, hidden // 64)
        cfg = tf.T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads,
                          d_ff=2 * hidden, num_layers=1, num_decoder_layers=1, num_heads=heads,
                          relative_attention_num_buckets=8 if hidden < 64 else 32,
                          decoder_start_token_id=0, attn_implementation=attn)
        ids = _ids(torch, vocab, batch, seq)
        return (_Logits.wrap(tf.T5ForConditionalGeneration(cfg).eval()),
                (ids, _padding_mask(torch, batch, seq), ids))
    return build


def vit(hidden: int = 32, layers: int = 2, image: int = 16, patch: int = 4,
        batch: int = BATCH):
    """(Larger `hidden`, `layers`, `image`: the same architecture at the sizes of a
    benchmark.)"""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.ViTConfig(image_size=image, patch_size=patch, num_channels=3,
                           hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=max(4, hidden // 64),
                           intermediate_size=2 * hidden, attn_implementation="eager")
        model = _Logits.wrap(tf.ViTModel(cfg, add_pooling_layer=False).eval(),
                             "last_hidden_state")
        return model, (torch.randn(batch, 3, image, image),)
    return build


def _bn_statistics(model):
    """Non-trivial BatchNorm running statistics, so eval-mode semantics show."""
    import torch

    g = torch.Generator().manual_seed(2)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


def resnet(widths: tuple[int, ...] = (8, 16), depth: int = 1, image: int = 32,
           batch: int = BATCH, layer_type: str = "basic"):
    """(Wider and deeper stages, a larger `image`, bottleneck blocks: the same architecture at
    the sizes of a benchmark.)"""
    def build():
        torch = _seed()
        import transformers as tf

        embedding = widths[0] // 4 if layer_type == "bottleneck" else widths[0]
        cfg = tf.ResNetConfig(num_channels=3, embedding_size=embedding,
                              hidden_sizes=list(widths), depths=[depth] * len(widths),
                              layer_type=layer_type, num_labels=8)
        model = _bn_statistics(tf.ResNetForImageClassification(cfg)).eval()
        return _Logits.wrap(model), (torch.randn(batch, 3, image, image),)
    return build


def convnext(widths: tuple[int, ...] = (8, 16), image: int = 16, patch: int = 2,
             batch: int = BATCH):
    """Depthwise 7x7 convolutions, LayerNorm over channels."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.ConvNextConfig(num_channels=3, hidden_sizes=list(widths),
                                depths=[1] * len(widths), patch_size=patch,
                                num_stages=len(widths), num_labels=8)
        return (_Logits.wrap(tf.ConvNextForImageClassification(cfg).eval()),
                (torch.randn(batch, 3, image, image),))
    return build


def wav2vec2(hidden: int = 32, conv: int = 16, samples: int = 520, batch: int = BATCH,
             strides: tuple[int, ...] = (4, 2), kernels: tuple[int, ...] = (8, 4),
             positions: int = 4):
    """An audio front end: strided conv1d feature extractor, then an encoder."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.Wav2Vec2Config(hidden_size=hidden, num_hidden_layers=1,
                                num_attention_heads=max(4, hidden // 64),
                                intermediate_size=2 * hidden, conv_dim=(conv,) * len(strides),
                                conv_stride=strides, conv_kernel=kernels,
                                num_feat_extract_layers=len(strides),
                                num_conv_pos_embeddings=positions,
                                num_conv_pos_embedding_groups=2 if hidden < 64 else 16,
                                feat_extract_norm="layer", do_stable_layer_norm=True,
                                attn_implementation="eager")
        model = _Logits.wrap(tf.Wav2Vec2Model(cfg).eval(), "last_hidden_state")
        return model, (torch.randn(batch, samples),)
    return build


def segformer(widths: tuple[int, ...] = (8, 16), image: int = 32, batch: int = 1):
    """Segmentation: overlapping patch embeddings, efficient attention, bilinear upsampling."""
    def build():
        torch = _seed()
        import transformers as tf

        n = len(widths)
        cfg = tf.SegformerConfig(num_channels=3, num_encoder_blocks=n, depths=[1] * n,
                                 sr_ratios=[2 ** (n - 1 - i) for i in range(n)],
                                 hidden_sizes=list(widths), patch_sizes=[3] * n,
                                 strides=[2] * n, num_attention_heads=[2 ** i for i in range(n)],
                                 mlp_ratios=[2] * n, decoder_hidden_size=2 * widths[-1] // 2,
                                 num_labels=4)
        return (_Logits.wrap(tf.SegformerForSemanticSegmentation(cfg).eval()),
                (torch.randn(batch, 3, image, image),))
    return build


def falcon():
    """Multi-query attention, attention and MLP in parallel, rotary embeddings; the attention
    picks its key and value heads by negative indices (`qkv[:, :, [-2]]`)."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, multi_query=True, parallel_attn=True,
                              new_decoder_architecture=False, alibi=False, bias=False,
                              max_position_embeddings=SEQ)
        return _Logits.wrap(tf.FalconForCausalLM(cfg).eval()), (_ids(torch),)
    return build


def deberta_v2():
    """Disentangled attention (content-to-position and position-to-content) over log-bucketed
    relative positions: integer positions divided and logged, as floats in PyTorch."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64,
                                 max_position_embeddings=SEQ, relative_attention=True,
                                 pos_att_type=["p2c", "c2p"], position_buckets=8)
        model = _Logits.wrap(tf.DebertaV2Model(cfg).eval(), "last_hidden_state")
        return model, (_ids(torch), _padding_mask(torch))
    return build


def mobilenet_v2(image: int = 32):
    """Inverted residual blocks: depthwise 3x3 convolutions, ReLU6, TensorFlow-style padding."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.MobileNetV2Config(num_channels=3, image_size=image, depth_multiplier=0.5,
                                   num_labels=8)
        model = _bn_statistics(tf.MobileNetV2ForImageClassification(cfg)).eval()
        return _Logits.wrap(model), (torch.randn(2, 3, image, image),)
    return build


def opt_unwrapped():
    """OPT exported as `transformers` returns it, unwrapped: a `CausalLMOutputWithPast`, which
    the file names in its output spec."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                           num_attention_heads=4, max_position_embeddings=SEQ,
                           word_embed_proj_dim=32, use_cache=False)
        return tf.OPTForCausalLM(cfg).eval(), (_ids(torch),)
    return build


def albert():
    """Every layer shares one set of weights (and a factorized embedding): each weight is read
    by every layer, which joins all the layers in the partition search's tables."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32,
                              num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=SEQ)
        return _Logits.wrap(tf.AlbertModel(cfg).eval(), "last_hidden_state"), (_ids(torch),)
    return build


def clip_vision(image: int = 32):
    """A class token, learned positions and a pooler reading the class token (`h[:, 0]`, a
    `take` of a scalar index), quick GELU."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=image, patch_size=8)
        model = _Logits.wrap(tf.CLIPVisionModel(cfg).eval(), "pooler_output")
        return model, (torch.randn(2, 3, image, image),)
    return build


def efficientnet(image: int = 32):
    """Squeeze-and-excitation, SiLU, depthwise convolutions, and a final average pool whose
    window (320 x 320, ceil mode) is larger than its 1 x 1 input."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.EfficientNetConfig(image_size=image, width_coefficient=0.25,
                                    depth_coefficient=0.25, hidden_dim=320, num_labels=8)
        model = _bn_statistics(tf.EfficientNetForImageClassification(cfg)).eval()
        return _Logits.wrap(model), (torch.randn(2, 3, image, image),)
    return build


def regnet(image: int = 32):
    """Grouped convolutions and squeeze-and-excitation. BatchNorm keeps a fresh model's
    statistics: an all-zero map stays exactly zero through its first 1x1 convolution and
    normalization, so a ReLU reads exact zeros, whose gradient PyTorch drops."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                              groups_width=4, num_labels=8)
        model = _Logits.wrap(tf.RegNetForImageClassification(cfg).eval())
        return model, (torch.randn(2, 3, image, image),)
    return build


def mixtral():
    """A mixture of experts as transformers 5.x exports it: tokens sorted by expert, counted
    with `histc`, multiplied by transformers' own custom op `grouped_mm_fallback`; top-2
    routing of 4 experts."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=64, max_position_embeddings=SEQ,
                               num_local_experts=4, num_experts_per_tok=2)
        return _Logits.wrap(tf.MixtralForCausalLM(cfg).eval()), (_ids(torch),)
    return build


def deit():
    """A distilled ViT: class and distillation tokens. Its position embeddings' gradient
    spans 4700 to near zero, where float32 rounding in PyTorch itself passes the fixed
    tolerance by."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.DeiTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, image_size=32, patch_size=8, num_labels=8)
        model = _Logits.wrap(tf.DeiTForImageClassification(cfg).eval())
        return model, (torch.randn(2, 3, 32, 32),)
    return build


def olmo2():
    """RMSNorm on the queries and keys, each norm casting its input to float32 (`x.to(torch.
    float32)`, which the export checks with an assertion of its dtype)."""
    def build():
        torch = _seed()
        import transformers as tf

        cfg = tf.Olmo2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=64,
                             max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2)
        return _Logits.wrap(tf.Olmo2ForCausalLM(cfg).eval()), (_ids(torch),)
    return build


def _op(forward: Callable, *shapes, dtype: str = "float32", init=None):
    """A one-operator torch module with a submodule built by `init(torch)`, or else a learned
    scale of its first input (so that the training step has a parameter to differentiate)."""
    def build():
        torch = _seed()

        class Op(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.sub = init(torch) if init else None
                if init is None:
                    self.scale = torch.nn.Parameter(torch.full(shapes[0][-1:], 1.5))

            def forward(self, *xs):
                if self.sub is None:
                    xs = (xs[0] * self.scale, *xs[1:])
                return forward(torch, self.sub, *xs)

        inputs = tuple(torch.randn(*s).to(getattr(torch, dtype)) for s in shapes)
        return Op().to(getattr(torch, dtype)).eval(), inputs
    return build


def _gather(torch, _, x):
    idx = torch.tensor([3, 0, 2, 1, 3, 3, 0, 1])
    return torch.index_select(x, 1, idx) + torch.gather(x, 1, idx.repeat(x.shape[0], 1))


def _masked(torch, _, x):
    return torch.where(x > 0, x, x * 0.1).masked_fill(x < -1, 0.0)


OPS = {
    "interpolate_nearest": _op(lambda t, _, x: t.nn.functional.interpolate(
        x, scale_factor=2, mode="nearest"), (1, 1, 16, 16)),
    "interpolate_bilinear": _op(lambda t, _, x: t.nn.functional.interpolate(
        x, scale_factor=2, mode="bilinear"), (1, 1, 16, 16)),
    "conv_transpose2d": _op(lambda t, m, x: m(x), (2, 4, 8, 8),
                            init=lambda t: t.nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1)),
    "group_norm": _op(lambda t, m, x: m(x), (2, 8, 8, 8), init=lambda t: t.nn.GroupNorm(4, 8)),
    "pixel_shuffle": _op(lambda t, _, x: t.nn.functional.pixel_shuffle(x, 2), (2, 8, 4, 4)),
    "pooling": _op(lambda t, _, x: t.nn.functional.max_pool2d(x, 2)
                   + t.nn.functional.avg_pool2d(x, 2), (2, 4, 8, 8)),
    "cumsum": _op(lambda t, _, x: t.cumsum(x, dim=1), (4, 16)),
    "gather": _op(_gather, (4, 8)),
    "where_masked_fill": _op(_masked, (4, 16)),
    "linear_fp16": _op(lambda t, m, x: m(x), (4, 16), dtype="float16",
                       init=lambda t: t.nn.Linear(16, 8)),
    "linear_bf16": _op(lambda t, m, x: m(x), (4, 16), dtype="bfloat16",
                       init=lambda t: t.nn.Linear(16, 8)),
    "sdpa_causal": _op(lambda t, _, q, k, v: t.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True), (2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8)),
}

MODELS: list[CorpusModel] = [
    *(CorpusModel(f"gpt2_{a}", gpt2(a), "language") for a in ("eager", "sdpa")),
    *(CorpusModel(f"llama_{a}", llama(a), "language") for a in ("eager", "sdpa")),
    *(CorpusModel(f"bert_{a}", bert(a), "language") for a in ("eager", "sdpa")),
    *(CorpusModel(f"t5_{a}", t5(a), "language") for a in ("eager", "sdpa")),
    CorpusModel("vit", vit(), "vision"),
    CorpusModel("resnet", resnet(), "vision"),
    CorpusModel("convnext", convnext(), "vision"),
    CorpusModel("wav2vec2", wav2vec2(), "audio"),
    CorpusModel("segformer", segformer(), "vision"),
    *(CorpusModel(name, build, "op", training=not name.startswith("linear_b"))
      for name, build in OPS.items()),
    CorpusModel("falcon", falcon(), "language", ci_modes=("plain", "training")),
    CorpusModel("deberta_v2", deberta_v2(), "language", ci_modes=("plain", "training")),
    CorpusModel("mobilenet_v2", mobilenet_v2(), "vision", ci_modes=("plain", "training")),
    CorpusModel("opt_unwrapped", opt_unwrapped(), "language", ci_modes=("plain", "training")),
    CorpusModel("llama_left_padded", llama("sdpa", left_padded=True), "language",
                ci_modes=("plain", "training")),
    # Found by a trial of sixteen more `transformers` models in every mode (2026-11-30); CI
    # runs the cell that failed, the sweep every other.
    CorpusModel("albert", albert(), "language", ci_modes=("k2",)),
    CorpusModel("clip_vision", clip_vision(), "vision", ci_modes=("training",)),
    CorpusModel("efficientnet", efficientnet(), "vision", ci_modes=("training",)),
    CorpusModel("regnet", regnet(), "vision", ci_modes=("training",)),
    CorpusModel("olmo2", olmo2(), "language", ci_modes=()),
    # Found by a third trial, of eighteen more (tests/test_moe_import.py runs Mixtral in CI).
    CorpusModel("mixtral", mixtral(), "language", ci_modes=()),
    CorpusModel("deit", deit(), "vision", ci_modes=()),
]

BY_NAME = {m.name: m for m in MODELS}

# Every corpus model at the size people run it, for checks that read the compiled kernels:
# hidden 768 and a 50k vocabulary for the language models, 224 x 224 images, one second of
# 16 kHz audio, batch 4. One layer each: every layer compiles to the same kernels.
REAL_BATCH, REAL_SEQ, REAL_VOCAB, REAL_IMAGE = 4, 512, 50257, 224
_LM = dict(hidden=768, seq=REAL_SEQ, vocab=REAL_VOCAB, batch=REAL_BATCH)
REAL_OPS = {
    "interpolate_nearest": _op(lambda t, _, x: t.nn.functional.interpolate(
        x, scale_factor=2, mode="nearest"), (REAL_BATCH, 64, 112, 112)),
    "interpolate_bilinear": _op(lambda t, _, x: t.nn.functional.interpolate(
        x, scale_factor=2, mode="bilinear"), (REAL_BATCH, 64, 112, 112)),
    "conv_transpose2d": _op(lambda t, m, x: m(x), (REAL_BATCH, 64, 56, 56),
                            init=lambda t: t.nn.ConvTranspose2d(64, 32, 3, stride=2,
                                                                padding=1)),
    "group_norm": _op(lambda t, m, x: m(x), (REAL_BATCH, 64, 56, 56),
                      init=lambda t: t.nn.GroupNorm(32, 64)),
    "pixel_shuffle": _op(lambda t, _, x: t.nn.functional.pixel_shuffle(x, 2),
                         (REAL_BATCH, 256, 56, 56)),
    "pooling": _op(lambda t, _, x: t.nn.functional.max_pool2d(x, 2)
                   + t.nn.functional.avg_pool2d(x, 2), (REAL_BATCH, 64, 112, 112)),
    "cumsum": _op(lambda t, _, x: t.cumsum(x, dim=1), (REAL_BATCH, 4096)),
    "gather": _op(_gather, (4096, 768)),
    "where_masked_fill": _op(_masked, (REAL_BATCH, REAL_SEQ, 768)),
    "linear_fp16": _op(lambda t, m, x: m(x), (REAL_BATCH * REAL_SEQ, 768), dtype="float16",
                       init=lambda t: t.nn.Linear(768, 3072)),
    "linear_bf16": _op(lambda t, m, x: m(x), (REAL_BATCH * REAL_SEQ, 768), dtype="bfloat16",
                       init=lambda t: t.nn.Linear(768, 3072)),
    "sdpa_causal": _op(lambda t, _, q, k, v: t.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True), *[(REAL_BATCH, 12, REAL_SEQ, 64)] * 3),
}
REAL: dict[str, Callable[[], tuple[object, tuple]]] = {
    **{f"gpt2_{a}": gpt2(a, layers=1, **_LM) for a in ("eager", "sdpa")},
    **{f"llama_{a}": llama(a, layers=1, **_LM) for a in ("eager", "sdpa")},
    **{f"bert_{a}": bert(a, layers=1, **_LM) for a in ("eager", "sdpa")},
    **{f"t5_{a}": t5(a, **_LM) for a in ("eager", "sdpa")},
    "vit": vit(768, 1, REAL_IMAGE, 16, REAL_BATCH),
    "resnet": resnet((256, 512, 1024, 2048), 1, REAL_IMAGE, REAL_BATCH, "bottleneck"),
    "convnext": convnext((96, 192, 384, 768), REAL_IMAGE, 4, REAL_BATCH),
    "wav2vec2": wav2vec2(768, 512, 16000, REAL_BATCH, (5, 2, 2, 2, 2, 2, 2),
                         (10, 3, 3, 3, 3, 2, 2), 128),
    "segformer": segformer((32, 64, 160, 256), REAL_IMAGE, REAL_BATCH),
    **REAL_OPS,
}


def export(model: CorpusModel, directory: str) -> tuple[str, list[np.ndarray]]:
    """Build, run in PyTorch and export `model`; returns the `.pt2` path and the inputs."""
    import torch

    module, inputs = model.build()
    path = os.path.join(directory, f"{model.name}.pt2")
    if not os.path.exists(path):
        with torch.no_grad():
            program = torch.export.export(module, inputs)
        torch.export.save(program, path)
    return path, [x.numpy() if x.dtype != torch.bfloat16 else x.float().numpy() for x in inputs]


# The sweep's modes (compile.py options); operator modules skip the swap modes.
_ADAMW = ["--training", "--optimizer", "adamw", "--lr", "1e-3", "--steps", "5"]
MODES = {
    "plain": [],
    "swap50": ["--device-memory", "50%"],
    "swapmin": ["--device-memory", "min"],
    "k2": ["--devices", "2"],
    "k3": ["--devices", "3"],
    "k4": ["--devices", "4"],
    "k8": ["--devices", "8"],
    "k2+swap50": ["--devices", "2", "--device-memory", "50%"],
    "training": ["--training"],
    # Five steps of AdamW (the optimizer update in the graph) against five of torch.optim.
    "adamw": [*_ADAMW],
    "adamw+swap25": [*_ADAMW, "--device-memory", "25%"],
    "adamw+swapmin": [*_ADAMW, "--device-memory", "min"],
    "adamw+k2": [*_ADAMW, "--devices", "2"],
    "adamw+k4": [*_ADAMW, "--devices", "4"],
    "adamw+k2+swap50": [*_ADAMW, "--devices", "2", "--device-memory", "50%"],
}
OP_MODES = ("plain", "k2", "k3", "k4", "k8", "training", "adamw", "adamw+k2", "adamw+k4")
TRAINING_MODES = tuple(m for m in MODES if m == "training" or m.startswith("adamw"))


def run_cell(path: str, args: list[str]) -> dict:
    """`compile.py PATH --target llvm ARGS --run --check`: "ok" when it matched both the plain
    TVM build and PyTorch eager, "refused" (exit 2, with the message) or "FAIL"."""
    from tvm_ext import cli

    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        out, err = io.StringIO(), io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli.main([path, "--target", "llvm", *args, "--run", "--check",
                                   "--report", report])
            except SystemExit as exc:
                status = int(exc.code or 0)
        seconds = time.perf_counter() - start
        data = json.loads(Path(report).read_text()) if os.path.exists(report) else {}
    check = data.get("check", {})
    torch_check = check.get("torch", {})
    cell = {"status": status, "seconds": round(seconds, 1)}
    if status == 0 and check.get("ok") and torch_check.get("ok"):
        cell.update(result="ok", max_abs_error=torch_check.get("max_abs_error"),
                    max_rel_error=torch_check.get("max_rel_error"))
    elif status == 2:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        cell.update(result="refused", message=lines[-1] if lines else "")
    else:
        cell.update(result="FAIL", check=check, stderr=err.getvalue()[-2000:])
    return cell
