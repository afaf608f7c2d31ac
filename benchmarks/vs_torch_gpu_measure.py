"""The half of benchmarks/vs_torch_gpu.py that runs on the GPU machine: one row, i.e. one
prepared (model, mode, dtype), checked against PyTorch and timed beside it. It needs TVM's
runtime, tvm_ext's runtime (a GPU bundle's site/), numpy, PyTorch and `transformers`; no TVM
compiler, nothing of tvm_ext but `tvm_ext.runtime`.

The torch model is built there from the recorded config (seed 0, on the device), and both
sides run its weights: the module's parameters are the torch model's own tensors, handed to
TVM through DLPack (inference), or copies of them (training: the step updates its arguments
in place). Inputs and labels are drawn there from the recorded specs with numpy's
`default_rng(seed)`.

Columns (each a callable timed in interleaved rounds):

    tvm_ext        the prepared module (TVM's pooled allocator, arguments resident)
    eager          PyTorch eager, float32, TF32 off
    bf16_autocast  PyTorch eager under torch.autocast(bfloat16) (float32 master weights)
    compile        torch.compile of the model, float32     } with --compile: compiled once,
    compile_bf16   torch.compile under bf16 autocast       } reused across rounds

Inference: torch under `inference_mode`. Training: `zero_grad(set_to_none)`, forward, the
loss (`LOSSES`), backward and `torch.optim.AdamW(fused=True)` with the optimizer the step was
compiled with; the torch columns share one model and one optimizer.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import numpy as np

MODELS = ("gpt2", "bert", "llama", "vit", "resnet")
MODES = ("inference", "training")
DTYPES = ("fp32", "bf16")
MANIFEST = "manifest.json"
# What the corpus wrapper returns (tests/corpus `_Logits.wrap`), and extra constructor
# arguments of the `transformers` class, per model of benchmarks/vs_torch.py.
FIELDS = {"gpt2": "logits", "bert": "last_hidden_state", "llama": "logits",
          "vit": "last_hidden_state", "resnet": "logits"}
INIT_KWARGS = {"bert": {"add_pooling_layer": False}, "vit": {"add_pooling_layer": False}}
# The inputs of each builder of benchmarks/vs_torch.py, in order (see `draw_inputs`).
INPUT_KINDS = {"gpt2": ("ids",), "bert": ("ids", "mask"), "llama": ("ids",),
               "vit": ("images",), "resnet": ("images",)}
# The loss of a training step, as a user trains each head: cross entropy over logits (the
# language models' next-token logits, ResNet's class logits), mse over an encoder's states.
LOSSES = {"logits": "cross_entropy", "last_hidden_state": "mse"}
OPTIMIZER = {"kind": "adamw", "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
             "weight_decay": 0.01}
# Inference outputs against eager float32: cuBLAS and PyTorch pick different GEMM algorithms.
# A bf16 row passes at this tolerance against eager under bf16 autocast, or within
# BF16_ENVELOPE times what autocast itself loses against float32: two bf16 computations that
# each lie within E of the float32 result lie within 2 E of each other. At real size
# autocast's own loss is above any fixed tolerance (H200: 0.03 on GPT-2's logits, 3.2 on
# ResNet-50's), so a fixed one fails PyTorch's own bf16 path.
INFERENCE_TOLERANCE = {"fp32": (1e-3, 1e-4), "bf16": (5e-2, 1e-2)}
BF16_ENVELOPE = 2.0
# The first training step's loss against torch's in the same precision (relative).
LOSS_RTOL = {"fp32": 1e-3, "bf16": 2e-2}
# Parameters after the first step: an element matches at (rtol, atol) plus what Adam's first
# step makes of a gradient off by LOSS_RTOL x the tensor's scale, its largest |g| but at least
# NOISE_SCALE x the step's largest (see compare_parameters): in float32 1e-6 of the step's
# largest gradient, the bound of tvm_ext's --check on CPU. A gradient below that is rounding
# noise and may flip (up to 2 lr); one just above it, near eps, moves by a fraction of lr (the
# H200's Llama-1B step: 3 of 1.24e9 elements off by 1.23e-6 at 1.07x the noise level).
# In bf16 the two sides round differently (torch's autocast keeps activations in bfloat16,
# tvm_ext only the GEMM operands), and gradients far above that noise flip too: a bf16 row
# bounds every element by 2 lr + atol and counts the flips, as --check bounds a bf16 run by
# its loss alone.
PARAM_TOLERANCE = (1e-5, 1e-6)
NOISE_SCALE = 1e-3
# Callees kept in a row's `--profile` (by time).
PROFILE_TOP = 15
# Elements beyond tolerance with a signal gradient recorded per tensor (error, gradient, bound).
SIGNAL_WORST = 5
SIGNS_CHECKED = {"fp32": True, "bf16": False}


def entry_key(model: str, mode: str, dtype: str) -> str:
    return f"{model}/{mode}/{dtype}"


def module_file(model: str, mode: str, dtype: str) -> str:
    return f"{model}-{mode}-{dtype}.so"


def loss_of(model: str) -> str:
    return LOSSES[FIELDS[model]]


# ------------------------------------------------------------------------------------------
# The torch model and the arguments
# ------------------------------------------------------------------------------------------

def torch_model(entry: dict, torch, device, buffers: dict | None = None):
    """The model the entry was prepared from, rebuilt from its config on `device` (seed 0),
    in eval mode (no dropout; batch norms on their running statistics, as the module was
    exported), with the recorded `buffers` (folded into the module) loaded."""
    import transformers

    config = getattr(transformers, entry["config_class"]).from_dict(dict(entry["config"]))
    if entry.get("attn_implementation"):
        config._attn_implementation = entry["attn_implementation"]
    torch.manual_seed(0)
    with torch.device(device):
        inner = getattr(transformers, entry["class"])(config, **entry["init_kwargs"])
    field = entry["field"]

    class Wrapped(torch.nn.Module):  # as tests/corpus wraps it: the names start "inner."
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return getattr(self.inner(*args), field)

    model = Wrapped().eval()
    named = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in (buffers or {}).items():
            named[name].copy_(torch.from_numpy(value))
    return model


def load_buffers(directory: str, entry: dict) -> dict[str, np.ndarray]:
    if not entry["buffers"]:
        return {}
    path = os.path.join(directory, entry["file"].removesuffix(".so") + ".npz")
    with np.load(path) as arrays:
        return {n: arrays[f"buffer:{n}"] for n in entry["buffers"]}


def draw_inputs(entry: dict, seed: int) -> list[np.ndarray]:
    """The inputs (and, for a training step, the labels) from the recorded specs: token ids
    uniform in [0, vocabulary), the padding mask of tests/corpus (the second row's last 5
    positions padded), images standard normal; labels as `TensorSpec.sample` draws them."""
    from tvm_ext.runtime.random_arrays import sample

    rng = np.random.default_rng(seed)
    out = []
    for spec in entry["inputs"]:
        shape, dtype = spec["shape"], spec["dtype"]
        if spec["kind"] == "ids":
            out.append(sample(rng, shape, dtype, "randint", high=spec["high"]))
        elif spec["kind"] == "mask":
            mask = np.ones(shape, dtype)
            mask[1, shape[1] - 5:] = 0
            out.append(mask)
        else:
            out.append(sample(rng, shape, dtype, "normal"))
    if "labels" in entry:
        s = entry["labels"]
        out.append(sample(rng, s["shape"], s["dtype"], s["init"], s["scale"], s["high"]))
    return out


def tvm_view(tensor, tvm):
    """`tensor` (torch) as a TVM tensor sharing its memory (DLPack): a training step writes
    its new parameters and state into it, so a copy would be wrong, and is refused."""
    try:
        return tvm.runtime.from_dlpack(tensor.detach())
    except Exception as err:
        raise RuntimeError(f"a {tuple(tensor.shape)} {tensor.dtype} tensor cannot be shared "
                           f"with TVM: {err}") from None


# ------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------

def time_interleaved(calls: dict, rounds: int, round_s: float) -> dict[str, list[float]]:
    """Milliseconds per call of each `calls[name] = (call, sync)`, every call waited for, in
    `rounds` rounds that alternate between them; a warm-up call each (untimed) sizes its share
    of a round to about `round_s` seconds."""
    repeat = {}
    for name, (call, sync) in calls.items():
        call()
        sync()
        start = time.perf_counter()
        call()
        sync()
        repeat[name] = max(1, int(round_s / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (call, sync) in calls.items():
            for _ in range(repeat[name]):
                start = time.perf_counter()
                call()
                sync()
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def count_vm_calls(vm, call) -> dict:
    """How many functions the VM calls in one `call()`: compiled kernels (each launches one or
    more device kernels), CUDA graphs (each replays a run of kernels in one launch) and the
    VM's builtins (allocation, shape and tuple handling). The first call captures the graphs,
    running their kernels through the VM: count a later one."""
    import tvm

    counts = {"kernels": 0, "graphs": 0, "builtins": 0}

    def instrument(func, symbol, before_run, ret, *args):
        if before_run:
            name = str(symbol)
            kind = ("graphs" if name.startswith("tvm_ext.cuda_graph.run")
                    else "builtins" if name.startswith(("vm.builtin", "tvm_ext.cuda_graph"))
                    else "kernels")
            counts[kind] += 1
        return 0

    vm.set_instrument(tvm.runtime.convert(instrument))
    try:
        call()
    finally:
        vm.set_instrument(tvm.runtime.convert(lambda *a: 0))
    return counts


class DeviceMemory:
    """Device memory of each side: torch's columns by `torch.cuda.max_memory_allocated` (less
    what tvm_ext's arguments hold), tvm_ext's by the device's free memory around its first
    call (`torch.cuda.mem_get_info`: the pool TVM's allocator keeps after it) plus its
    arguments, and by tvm_ext's runtime counters (the VM's own allocations). On a CPU dry
    run only the counters exist."""

    def __init__(self, torch, device: str):
        self.torch, self.cuda = torch, device == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def free(self) -> int | None:
        return int(self.torch.cuda.mem_get_info()[0]) if self.cuda else None

    @contextlib.contextmanager
    def torch_peak(self, result: dict, key: str, not_torch: int):
        if self.cuda:
            self.sync()
            self.torch.cuda.reset_peak_memory_stats()
        yield
        if self.cuda:
            self.sync()
            result[key] = int(self.torch.cuda.max_memory_allocated()) - not_torch

    @contextlib.contextmanager
    def tvm_peak(self, result: dict, dev, argument_bytes: int):
        from tvm_ext.runtime import memory

        tracked = memory.is_tracked(dev, "pooled")
        if tracked:
            memory.reset_peak(dev)
            before_vm = memory.memory_stats(dev).reserved
        self.sync()
        before = self.free()
        yield
        dev.sync()
        if before is not None:
            pool = before - self.free()
            result["tvm_ext_peak_bytes"] = argument_bytes + pool
        if tracked:
            result["tvm_ext_vm_peak_bytes"] = memory.memory_stats(dev).peak_reserved - before_vm


def nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def medians(times: dict[str, list[float]], row: dict) -> None:
    """Each column's median ms, its ratio to tvm_ext, and the calls behind it."""
    for name, values in times.items():
        row[f"{name}_ms"] = statistics.median(values)
        row.setdefault("calls", {})[name] = len(values)
    for name in times:
        if name != "tvm_ext" and "tvm_ext_ms" in row:
            row[f"ratio_{name}"] = row["tvm_ext_ms"] / row[f"{name}_ms"]


def compiled(torch, model, row: dict, key: str, call):
    """`torch.compile(model)`, compiled by its first `call(compiled_model)`; the seconds that
    took go into row[key]."""
    fn = torch.compile(model)
    start = time.perf_counter()
    call(fn)
    row[key] = round(time.perf_counter() - start, 2)
    return fn


# ------------------------------------------------------------------------------------------
# One row
# ------------------------------------------------------------------------------------------

class Sides:
    """What both sides of a row share: torch and TVM on one device, the torch model, the
    drawn inputs (and labels) on the device, the module's VM (and whether to profile it)."""

    def __init__(self, directory: str, entry: dict, device: str, seed: int,
                 profile: bool = False):
        import torch
        import tvm
        from tvm.runtime.vm import VirtualMachine

        import tvm_ext  # noqa: F401  (tvm_ext's runtime library: the cuBLAS kernels)

        if device == "cuda":
            from tvm_ext.runtime.cuda import ensure_cuda_runtime

            ensure_cuda_runtime()  # TVM's CUDA module loader (loaded on demand)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.torch, self.tvm, self.device, self.profile = torch, tvm, device, profile
        self.dev, self.tdev = tvm.device(device, 0), torch.device(device)
        self.memory = DeviceMemory(torch, device)
        self.model = torch_model(entry, torch, self.tdev, load_buffers(directory, entry))
        # Copies into torch's allocator (aligned as TVM requires; numpy's memory is not).
        self.inputs = [torch.tensor(a, device=self.tdev) for a in draw_inputs(entry, seed)]
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        missing = [n for n in entry["parameters"] if n not in named]
        if missing:
            raise RuntimeError(f"the torch model built here lacks {missing[:3]}")
        self.params = [named[n] for n in entry["parameters"]]
        self.vm = VirtualMachine(tvm.runtime.load_module(
            os.path.join(directory, entry["file"])), self.dev)
        self.main = self.vm["main"]

    def sync(self):
        self.memory.sync()

    def view(self, tensors) -> list:
        return [tvm_view(t, self.tvm) for t in tensors]

    def autocast(self, bf16: bool):
        if not bf16:
            return contextlib.nullcontext()
        return self.torch.autocast(self.device, dtype=self.torch.bfloat16)


def output_errors(torch, ours, theirs, rtol: float, atol: float) -> dict:
    """Largest absolute and relative error of `ours` against `theirs` (torch tensors, compared
    where they are), whether they agree at (rtol, atol), and NaN counts where any."""
    ours, theirs = ours.float(), theirs.float()
    err = (ours - theirs).abs()
    out = {"max_abs_error": float(err.max()),
           "max_rel_error": float((err / (theirs.abs() + 1e-12)).max()),
           "ok": bool(torch.allclose(ours, theirs, rtol=rtol, atol=atol))}
    nans = {"tvm_ext": int(torch.isnan(ours).sum()), "torch": int(torch.isnan(theirs).sum())}
    if any(nans.values()):
        out["nan"] = nans
    return out


def inference_ok(row: dict) -> bool:
    """An inference row's check (see INFERENCE_TOLERANCE): a float32 row at its tolerance; a
    bf16 row at its tolerance against autocast or, NaN-free, within BF16_ENVELOPE x autocast's
    own error against float32, both against autocast and (where measured) against float32."""
    if row["dtype"] == "fp32" or row["within_tolerance"]:
        return row["within_tolerance"]
    if row.get("nan"):
        return False
    bound = BF16_ENVELOPE * row["bf16_autocast_max_abs_error"]
    return (row["max_abs_error"] <= bound
            and row.get("fp32_max_abs_error", 0.0) <= bound)


def _first_output(torch, out):
    value = out if hasattr(out, "shape") else out[0]
    return torch.from_dlpack(value)


def _time_columns(s: Sides, row: dict, args: list, run, rounds: int, round_s: float,
                  with_compile: bool, progress) -> None:
    """The VM's calls of one tvm_ext call, then every column timed in interleaved rounds:
    tvm_ext, `run` (torch: `run(bf16, fn)`, fn the model or its compiled form) eager and
    under bf16 autocast, and with `with_compile` both compiled once (compile time recorded)."""
    row["vm_calls"] = count_vm_calls(s.vm, lambda: s.main(*args))
    progress(row)
    calls = {"tvm_ext": (lambda: s.main(*args), s.dev.sync), "eager": (run, s.sync),
             "bf16_autocast": (lambda: run(True), s.sync)}
    if with_compile:
        fn = compiled(s.torch, s.model, row, "compile_s", lambda f: run(fn=f))
        start = time.perf_counter()
        run(True, fn)
        row["compile_bf16_s"] = round(time.perf_counter() - start, 2)
        calls["compile"] = (lambda: run(fn=fn), s.sync)
        calls["compile_bf16"] = (lambda: run(True, fn), s.sync)
        progress(row)
    medians(time_interleaved(calls, rounds, round_s), row)
    if s.profile:
        progress(row)
        from tvm_ext.runtime.call_profile import profile_calls

        row["profile"] = profile_calls(s.vm, args, s.dev).summary(top=PROFILE_TOP)


def inference_row(s: Sides, row: dict, rounds: int, round_s: float, with_compile: bool,
                  progress) -> None:
    """tvm_ext's outputs against torch in the row's precision (eager float32; a bf16 row,
    compiled with autocast's policy, eager under bf16 autocast), what bf16 autocast loses
    against float32, the VM's calls, then every column timed."""
    torch = s.torch
    args = s.view([*s.inputs, *s.params])
    with s.memory.tvm_peak(row, s.dev, nbytes([*s.inputs, *s.params])):
        ours = _first_output(torch, s.main(*args))

    def eager(bf16: bool = False, fn=None):
        with torch.inference_mode(), s.autocast(bf16):
            return (s.model if fn is None else fn)(*s.inputs)

    with s.memory.torch_peak(row, "eager_peak_bytes", 0):
        theirs = eager()
    with s.memory.torch_peak(row, "bf16_autocast_peak_bytes", 0):
        low = eager(True)
    dtype = row["dtype"]
    row["reference"] = "eager" if dtype == "fp32" else "bf16_autocast"
    row.update(output_errors(torch, ours, theirs if dtype == "fp32" else low,
                             *INFERENCE_TOLERANCE[dtype]))
    row["within_tolerance"] = row.pop("ok")
    if row.get("nan", {}).get("tvm_ext"):
        progress(row)  # the search copies every argument of every call: it may run long
        row["first_nan"] = first_nan_kernel(s.vm, args)
    row["bf16_autocast_max_abs_error"] = output_errors(torch, low, theirs, 1, 1)["max_abs_error"]
    if dtype != "fp32":
        row["fp32_max_abs_error"] = output_errors(torch, ours, theirs, 1, 1)["max_abs_error"]
    row["ok"] = inference_ok(row)
    first = ours.clone()
    del ours, theirs, low
    progress(row)
    _time_columns(s, row, args, eager, rounds, round_s, with_compile, progress)
    # The timed calls replay the CUDA graphs the first call captured: they compute the same.
    replay = output_errors(torch, _first_output(torch, s.main(*args)), first,
                           *INFERENCE_TOLERANCE[dtype])
    row["replay_max_abs_diff"] = replay["max_abs_error"]
    row["ok"] = row["ok"] and replay["ok"]


def _loss_fn(torch, loss: str):
    functional = torch.nn.functional
    if loss == "cross_entropy":
        return lambda out, labels: functional.cross_entropy(
            out.reshape(-1, out.shape[-1]), labels.reshape(-1))
    return functional.mse_loss


def adam_first_step(g, lr: float, eps: float):
    """How far Adam's first step moves an element whose gradient is `g`: its moments are g
    and g**2 after bias correction, so the update is lr x g / (|g| + eps)."""
    return lr * g / (g.abs() + eps)


def compare_parameters(torch, ours, theirs, grads, lr: float, noise_rtol: float,
                       eps: float) -> dict:
    """The parameters after one step, tvm_ext's (`ours`) against torch's. Each gradient is
    known to within noise_rtol x its tensor's scale (its largest |g|, but at least
    NOISE_SCALE x the step's largest: a tensor whose exact gradient is zero, a key bias
    through softmax, is all noise), so an element may differ by PARAM_TOLERANCE plus what
    Adam's first step makes of a gradient that far off: a noise gradient (|g| below that)
    can flip and move the element up to 2 lr the other way; a gradient just above it, near
    eps, moves it by a fraction of lr. An element beyond that bound is wrong, and so is any
    beyond 2 lr + atol (`grads[i]` None: not trained, the tolerance alone). Elements beyond
    the tolerance are counted, split by whether their gradient was noise."""
    rtol, atol = PARAM_TOLERANCE
    out = {"elements": 0, "beyond_tolerance": 0, "beyond_with_noise_gradient": 0,
           "beyond_with_signal_gradient": 0, "beyond_bound": 0, "beyond_2lr": 0,
           "max_abs_error": 0.0, "max_abs_error_signal": 0.0, "largest_gradient_beyond": 0.0}
    step_max = max((float(g.abs().max()) for g in grads if g is not None and g.numel()),
                   default=0.0)
    for i, (o, t, g) in enumerate(zip(ours, theirs, grads, strict=True)):
        diff = (o.float() - t.float()).abs()
        bound = atol + rtol * t.float().abs()
        bad = diff > bound
        noise = torch.zeros_like(bad)
        if g is not None:
            g = g.float()
            scale = max(float(g.abs().max()), NOISE_SCALE * step_max)
            if scale > 0:
                relative = g.abs() / scale
                noise = relative <= noise_rtol
                if bad.any():  # in units of the noise scale: <= noise_rtol is noise
                    out["largest_gradient_beyond"] = max(out["largest_gradient_beyond"],
                                                         float(relative[bad].max()))
                off = noise_rtol * scale
                step = adam_first_step(g, lr, eps)
                bound = bound + torch.maximum(
                    (adam_first_step(g + off, lr, eps) - step).abs(),
                    (adam_first_step(g - off, lr, eps) - step).abs())
        wrong = diff > bound
        signal_bad = bad & ~noise
        out["elements"] += diff.numel()
        out["beyond_tolerance"] += int(bad.sum())
        out["beyond_with_noise_gradient"] += int((bad & noise).sum())
        out["beyond_with_signal_gradient"] += int(signal_bad.sum())
        out["beyond_bound"] += int(wrong.sum())
        if signal_bad.any():  # the worst few: an error, the gradient it had, its bound
            worst = diff.masked_fill(~signal_bad, -1).flatten().topk(
                min(SIGNAL_WORST, int(signal_bad.sum())))
            out.setdefault("signal_worst", []).extend(
                {"tensor": i, "error": float(e), "bound": float(bound.flatten()[j]),
                 "gradient": None if g is None else float(g.flatten()[j])}
                for e, j in zip(worst.values.tolist(), worst.indices.tolist(), strict=True))
        out["beyond_2lr"] += int((diff > 2 * lr + atol).sum())
        out["max_abs_error"] = max(out["max_abs_error"], float(diff.max()))
        if (~noise).any():
            out["max_abs_error_signal"] = max(out["max_abs_error_signal"],
                                              float(diff[~noise].max()))
    out["ok"] = out["beyond_bound"] == 0 and out["beyond_2lr"] == 0
    return out


# long: one row's sequence (check, counts, compile, timing) reads best in one place
def training_row(s: Sides, entry: dict, row: dict, rounds: int, round_s: float,
                 with_compile: bool, progress) -> None:
    """The first step of tvm_ext's AdamW iteration against torch's in the same precision
    (eager float32, or bf16 autocast) from the same weights on the same batch: the loss and
    every parameter after it; then every column timed, each training on from there."""
    torch, dtype = s.torch, entry["dtype"]
    opt_spec = entry["optimizer"]
    ours = [p.detach().clone(memory_format=torch.contiguous_format) for p in s.params]
    state = [torch.zeros(x["shape"], dtype=getattr(torch, x["dtype"]), device=s.tdev)
             for x in entry["state"]]
    owned = nbytes([*ours, *state])
    args = s.view([*s.inputs, *ours, *state])
    with s.memory.tvm_peak(row, s.dev, owned + nbytes(s.inputs)):
        row["tvm_ext_loss"] = float(s.main(*args).numpy())
    trainable = [s.params[i] for i in entry["trainable"]]
    opt = torch.optim.AdamW(trainable, lr=opt_spec["lr"], betas=tuple(opt_spec["betas"]),
                            eps=opt_spec["eps"], weight_decay=opt_spec["weight_decay"],
                            fused=True)
    loss_fn = _loss_fn(torch, entry["loss"])
    *inputs, labels = s.inputs

    def step(bf16: bool = False, fn=None):
        opt.zero_grad(set_to_none=True)
        with s.autocast(bf16):
            loss = loss_fn((s.model if fn is None else fn)(*inputs), labels)
        loss.backward()
        opt.step()
        return loss

    reference = "eager" if dtype == "fp32" else "bf16_autocast"
    with s.memory.torch_peak(row, f"{reference}_peak_bytes", owned):
        row["torch_loss"] = float(step(dtype != "fp32"))
    row["loss_error"] = abs(row["tvm_ext_loss"] - row["torch_loss"])
    row["loss_ok"] = row["loss_error"] <= LOSS_RTOL[dtype] * abs(row["torch_loss"])
    trained = set(entry["trainable"])
    grads = [p.grad if i in trained else None for i, p in enumerate(s.params)]
    row["parameters_check"] = compare_parameters(torch, ours, s.params, grads,
                                                 opt_spec["lr"], LOSS_RTOL[dtype],
                                                 opt_spec["eps"])
    check = row["parameters_check"]
    row["ok"] = row["loss_ok"] and (check["ok"] if SIGNS_CHECKED[dtype]
                                    else check["beyond_2lr"] == 0)
    other = "bf16_autocast" if dtype == "fp32" else "eager"
    with s.memory.torch_peak(row, f"{other}_peak_bytes", owned):
        step(other == "bf16_autocast")
    progress(row)
    _time_columns(s, row, args, step, rounds, round_s, with_compile, progress)


def measure_row(directory: str, entry: dict, device: str, rounds: int, round_s: float,
                with_compile: bool, seed: int, progress, profile: bool = False) -> dict:
    """One row (see the module docstring); `progress(row)` is called with the row so far
    after each phase, so that a row cut short by its time limit keeps what it measured.
    `profile`: after the timing, tvm_ext's call timed call by call (runtime.call_profile:
    the PROFILE_TOP slowest callees, the kernels' sum and the gap between calls)."""
    row = {"model": entry["model"], "mode": entry["mode"], "dtype": entry["dtype"],
           "parameters": entry["parameter_count"], "size": entry["size"], "seed": seed}
    start = time.perf_counter()
    s = Sides(directory, entry, device, seed, profile)
    row["setup_s"] = round(time.perf_counter() - start, 2)
    progress(row)
    if entry["mode"] == "inference":
        inference_row(s, row, rounds, round_s, with_compile, progress)
    else:
        training_row(s, entry, row, rounds, round_s, with_compile, progress)
    row["wall_s"] = round(time.perf_counter() - start, 2)
    return row


def first_nan_kernel(vm, args) -> dict | None:
    """Run `main` once with every VM call instrumented: the first call after which one of its
    arguments holds a NaN while none of its other arguments did before (the kernel that made
    it from clean inputs, or whose output, its last argument, held NaN before and after: left
    partly unwritten), or None."""
    import tvm

    found: dict = {}
    before: list = []

    def nan_args(values) -> list[int]:
        out = []
        for i, v in enumerate(values):
            try:
                a = v.numpy()
            except Exception:  # not a tensor
                continue
            if a.dtype.kind == "f" and np.isnan(a).any():
                out.append(i)
        return out

    def instrument(func, symbol, before_run, ret, *call_args):
        if found:
            return 0
        nans = nan_args(call_args)
        if before_run:
            before[:] = nans
            return 0
        new = [i for i in nans if i not in before]
        last = len(call_args) - 1
        if (new and not before) or (before == [last] and last in nans):
            found.update(kernel=str(symbol), argument=(new or [last])[0],
                         nan_before=list(before),
                         shapes=[list(a.shape) if hasattr(a, "shape") else None
                                 for a in call_args])
        return 0

    vm.set_instrument(tvm.runtime.convert(instrument))
    try:
        vm["main"](*args)
    finally:
        vm.set_instrument(tvm.runtime.convert(lambda *a: 0))
    return found or None
