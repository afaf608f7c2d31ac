"""Training across steps: parameters and optimizer state placed once, a compiled optimizer
step (`tvm_ext.models.optimizer`) run on batch after batch, the state staying where it is.

    step = make_optimizer_step(get_model("mlp", training=True), Optimizer("adamw"))
    executable = build(step, target)
    session = TrainingSession(executable, step, tvm.cpu())
    results = session.run([step.random_inputs(0)] * 5)     # loss, time and peak of each step
    weights = session.parameters()                         # numpy arrays

The compiled step updates its parameter and state arguments in place and returns the loss, so a
session only ever moves batches and losses. `session.save(path)` writes the parameters and the
optimizer state (the step count included) to one file, whole or not at all, and
`TrainingSession(..., checkpoint=path)` starts from it, so a long run survives a restart. A
swapped step (SwapOffload) runs on `[device, host]`: the arguments the plan keeps on the host
are placed there once and stay there, the others stay on the device; each step's device peak,
and the host memory in use after it, are measured. `PartitionedTrainingSession` does the same
for a partitioned build on the k workers of a `tvm_ext.runtime.distributed.Session`, each worker
holding its pieces.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax

from .. import runtime
from ..errors import CheckError, InputError
from ..models import Model, reference
from ..models.optimizer import Optimizer
from ..runtime import distributed
from .build import build_reference, device_of
from .run import compare, place_argument


@dataclasses.dataclass
class StepResult:
    """One step: its loss, wall time, the device peak during it (everything the tracked
    allocators held: parameters, state, batch and the step's own tensors; per worker when
    partitioned) and the host memory in use after it (swapped or partitioned + swapped)."""

    loss: float
    seconds: float
    peak_bytes: int | list[int]
    host_bytes: int | list[int] = 0


def state_layout(model: Model) -> tuple[int, int]:
    """(number of parameters, number of optimizer-state tensors) of an optimizer step."""
    if "optimizer" not in model.config:
        raise InputError(f"{model.name} is not an optimizer step (make_optimizer_step)")
    return int(model.config["num_params"]), len(model.config["state"])


_CHECKPOINT_FORMAT = "tvm_ext.training_checkpoint.v1"


def save_checkpoint(path: str, model: Model, params: Sequence[np.ndarray],
                    state: Sequence[np.ndarray]) -> str:
    """Write the parameters and optimizer state of the optimizer step `model` to `path` (an
    .npz, by argument name), whole: a temporary file renamed over it."""
    num_params, num_state = state_layout(model)
    if len(params) != num_params or len(state) != num_state:
        raise InputError(f"{len(params)} parameters and {len(state)} state tensors for a step "
                         f"with {num_params} and {num_state}")
    names = [p.name for p in model.params]
    meta = {"format": _CHECKPOINT_FORMAT, "model": model.name, "names": names,
            "optimizer": model.config["optimizer"]}
    arrays = {f"a{i}": np.asarray(v) for i, v in enumerate([*params, *state])}
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".npz", dir=directory)
    os.close(fd)
    try:
        np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def load_checkpoint(path: str, model: Model) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(parameters, state) saved by `save_checkpoint` for the optimizer step `model`; an
    `InputError` naming the difference when the file is not such a checkpoint of this step."""
    num_params, _ = state_layout(model)
    try:
        with np.load(path) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            values = [data[f"a{i}"] for i in range(len(meta["names"]))]
    except (OSError, KeyError, ValueError) as err:
        raise InputError(f"{path} is not a tvm_ext training checkpoint: {err}") from err
    if meta.get("format") != _CHECKPOINT_FORMAT:
        raise InputError(f"{path} is not a tvm_ext training checkpoint")
    names = [p.name for p in model.params]
    if meta["names"] != names:
        missing = sorted(set(names) - set(meta["names"]))[:3]
        raise InputError(f"{path} holds the arguments of another step ({meta['model']}): "
                         f"{len(meta['names'])} saved, {len(names)} here"
                         + (f"; missing {missing}" if missing else ""))
    if meta["optimizer"] != model.config["optimizer"]:
        raise InputError(f"{path} was saved for the optimizer {meta['optimizer']}, this step "
                         f"runs {model.config['optimizer']}")
    return values[:num_params], values[num_params:]


def _initial_values(model: Model, params, state, seed: int,
                    checkpoint: str | None = None) -> list[np.ndarray]:
    """Parameters (given, or the model's own / random ones) then the state (given, or zeros);
    or both from a checkpoint file."""
    if checkpoint is not None:
        if params is not None or state is not None:
            raise InputError("give a checkpoint or initial parameters and state, not both")
        params, state = load_checkpoint(checkpoint, model)
    num_params, num_state = state_layout(model)
    values = model.random_params(seed)
    if params is not None:
        if len(params) != num_params:
            raise InputError(f"{len(params)} parameters given; {model.name} has {num_params}")
        values[:num_params] = [np.asarray(p) for p in params]
    if state is not None:
        if len(state) != num_state:
            raise InputError(f"{len(state)} state tensors given; the optimizer keeps "
                             f"{num_state}")
        values[num_params:] = [np.asarray(s) for s in state]
    for spec, v in zip(model.params, values, strict=True):
        if tuple(v.shape) != spec.shape or str(v.dtype) != spec.dtype:
            raise InputError(f"{spec.name}: {v.shape} {v.dtype} given, the step takes "
                             f"{spec.shape} {spec.dtype}")
    return values


class TrainingSession:
    """An optimizer step on one device (and its host, when swapped): see the module docstring.

    Args:
        executable: the compiled optimizer step.
        model: its `Model` (`make_optimizer_step`).
        device: where it runs.
        params, state: initial values (default: the model's parameters, zero state).
        host: the host device of a swapped step (`tvm_ext.ir.targets.vm_devices`).
        arg_devices: per argument 0 (device) or 1 (host), for a swapped step.
        seed: of the random parameters when none are given.
        checkpoint: a file `save` wrote: the parameters and state to start from.
    """

    def __init__(self, executable: relax.VMExecutable, model: Model,
                 device: tvm.runtime.Device, *, params: Sequence[np.ndarray] | None = None,
                 state: Sequence[np.ndarray] | None = None,
                 host: tvm.runtime.Device | None = None,
                 arg_devices: Sequence[int] | None = None, seed: int = 0,
                 checkpoint: str | None = None):
        values = _initial_values(model, params, state, seed, checkpoint)
        self.model = model
        self.device, self.host = device, host
        self.devices = [device] if host is None else [device, host]
        n = len(model.inputs) + len(model.params)
        self.arg_devices = list(arg_devices) if arg_devices is not None else [0] * n
        if len(self.arg_devices) != n or max(self.arg_devices) >= len(self.devices):
            raise InputError("arg_devices must give a device index (into [device, host]) per "
                             "argument")
        self.vm = relax.VirtualMachine(executable, self.devices, memory_cfg="naive")
        for dev in self.devices:
            if not runtime.is_tracked(dev, "naive"):
                raise RuntimeError(f"the VM allocator on {dev} predates tvm_ext's import: "
                                   "memory cannot be measured in this process")
        self.baseline = [runtime.memory_stats(d).in_use for d in self.devices]
        k = model.num_input
        self.args = [place_argument(v, self.devices[d], device)
                     for v, d in zip(values, self.arg_devices[k:], strict=True)]
        self.placed_bytes = [runtime.memory_stats(d).in_use - b
                             for d, b in zip(self.devices, self.baseline, strict=True)]
        self.main = self.vm["main"]
        self.results: list[StepResult] = []

    def step(self, batch: Sequence[np.ndarray]) -> StepResult:
        """One step on `batch` (the inputs, then the labels)."""
        k = self.model.num_input
        if len(batch) != k:
            raise InputError(f"a batch of {len(batch)} arrays; the step takes {k} (the inputs, "
                             "then the labels)")
        inputs = [place_argument(a, self.devices[d], self.device)
                  for a, d in zip(batch, self.arg_devices[:k], strict=True)]
        for dev in self.devices:
            runtime.reset_peak(dev)
        start = time.perf_counter()
        loss = self.main(*inputs, *self.args)
        self.device.sync()
        seconds = time.perf_counter() - start
        peak = runtime.memory_stats(self.device).peak_in_use - self.baseline[0]
        value = float(loss.numpy())
        del loss, inputs
        host = runtime.memory_stats(self.host).in_use - self.baseline[1] \
            if self.host is not None else 0
        result = StepResult(value, seconds, int(peak), int(host))
        self.results.append(result)
        return result

    def run(self, batches: Sequence[Sequence[np.ndarray]]) -> list[StepResult]:
        """One step per batch."""
        return [self.step(b) for b in batches]

    def parameters(self) -> list[np.ndarray]:
        """The parameters now, as numpy arrays."""
        return [a.numpy() for a in self.args[:state_layout(self.model)[0]]]

    def state(self) -> list[np.ndarray]:
        """The optimizer state now (in the step's argument order), as numpy arrays."""
        return [a.numpy() for a in self.args[state_layout(self.model)[0]:]]

    def save(self, path: str) -> str:
        """Write the parameters and state now to `path` (see `save_checkpoint`)."""
        return save_checkpoint(path, self.model, self.parameters(), self.state())


class PartitionedTrainingSession:
    """An optimizer step partitioned over the k workers of `session` (`build_partitioned`):
    each worker holds its pieces of the parameters and state, as the plan lays them out, for
    every step. `host`: a build swapped per device keeps some arguments in host memory."""

    def __init__(self, session: distributed.Session, build, model: Model, *,
                 params: Sequence[np.ndarray] | None = None,
                 state: Sequence[np.ndarray] | None = None, seed: int = 0,
                 checkpoint: str | None = None):
        values = _initial_values(model, params, state, seed, checkpoint)
        layout = build.layout
        if session.num_workers != int(layout["num_devices"]):
            raise InputError(f"the step is partitioned for {layout['num_devices']} devices; "
                             f"the session has {session.num_workers} workers")
        self.session, self.model, self.layout = session, model, layout
        self.mesh = layout["mesh"]
        n = len(model.inputs) + len(model.params)
        self.arg_devices = list(build.arg_devices or [0] * n)
        swapped = build.swap_plan is not None
        self.hosts = session.host_devices() if swapped else []
        module = session.load_module(build.executable, separate_host=swapped)
        self.function = module["main"]
        session.sync()
        self.baseline = [s.in_use for s in session.memory_stats()]
        self.host_baseline = [runtime.memory_stats(h).in_use for h in self.hosts]
        k = model.num_input
        self.args = [self._place(v, i) for i, v in enumerate(values, start=k)]
        self.results: list[StepResult] = []

    def _place(self, array: np.ndarray, index: int) -> distributed.DArray:
        spec = self.layout["arguments"][index]
        return distributed.place_sharded(self.session, np.asarray(array), self.mesh,
                                         spec["layout"], on_host=bool(self.arg_devices[index]))

    def step(self, batch: Sequence[np.ndarray]) -> StepResult:
        """One step on `batch` (the inputs, then the labels), every worker at once."""
        sess = self.session
        k = self.model.num_input
        if len(batch) != k:
            raise InputError(f"a batch of {len(batch)} arrays; the step takes {k}")
        inputs = [self._place(a, i) for i, a in enumerate(batch)]
        sess.sync()
        sess.reset_peak()
        start = time.perf_counter()
        outs = self.function(*inputs, *self.args)
        sess.sync()
        seconds = time.perf_counter() - start
        peaks = [s.peak_in_use - b for s, b in zip(sess.memory_stats(), self.baseline,
                                                   strict=True)]
        spec = self.layout["outputs"][0]
        loss = distributed.gather_sharded(sess, outs[0], self.mesh, spec["layout"],
                                          spec["shape"])
        del outs, inputs
        sess.sync()
        hosts = [runtime.memory_stats(h).in_use - b
                 for h, b in zip(self.hosts, self.host_baseline, strict=True)]
        result = StepResult(float(loss), seconds, [int(p) for p in peaks],
                            [int(h) for h in hosts])
        self.results.append(result)
        return result

    def run(self, batches: Sequence[Sequence[np.ndarray]]) -> list[StepResult]:
        return [self.step(b) for b in batches]

    def _gather(self, first: int, count: int) -> list[np.ndarray]:
        k = self.model.num_input
        specs = self.layout["arguments"]
        return [distributed.gather_sharded(self.session, self.args[i], self.mesh,
                                           specs[k + i]["layout"], specs[k + i]["shape"])
                for i in range(first, first + count)]

    def parameters(self) -> list[np.ndarray]:
        """The parameters now, gathered whole from the workers' pieces."""
        num_params, _ = state_layout(self.model)
        return self._gather(0, num_params)

    def state(self) -> list[np.ndarray]:
        """The optimizer state now, gathered whole."""
        num_params, num_state = state_layout(self.model)
        return self._gather(num_params, num_state)

    def save(self, path: str) -> str:
        """Write the parameters and state now, gathered whole, to `path` (`save_checkpoint`):
        a partitioned step resumes from it on any number of workers, or on one device."""
        return save_checkpoint(path, self.model, self.parameters(), self.state())


# --------------------------------------------------------------------------------------------
# References: N steps of torch.optim on the same model, batches and initial values
# --------------------------------------------------------------------------------------------

def tvm_gradient(gradient_model: Model, target: tvm.target.Target):
    """The gradient of a training step (`make_training_step`) by a plain `tvm.compile`: the
    reference gradient of a zoo model. Returns `gradient(params, batch) -> (loss, grads)`."""
    device = device_of(target)
    vm = relax.VirtualMachine(build_reference(gradient_model, target), device)

    def gradient(params, batch):
        out = vm["main"](*[tvm.runtime.tensor(np.asarray(a), device)
                           for a in [*batch, *params]])
        values = [o.numpy() for o in out]
        return values[0], values[1:]
    return gradient


def torch_gradient(path: str, gradient_model: Model, float64: bool = False):
    """The gradient of the exported program in `path` by `torch.autograd`, for the training
    step `gradient_model` of it: the reference gradient of a .pt2 model (`float64`: computed
    in float64, see `reference.torch_reference`)."""
    names = [p.name for p in gradient_model.params]
    wrt = gradient_model.config["gradients"]
    loss = gradient_model.config.get("loss", "mse")

    def gradient(params, batch):
        out = reference.torch_training_step(path, batch[:-1], batch[-1], params, names, wrt,
                                            loss, float64=float64)
        return out[0], out[1:]
    return gradient


def reference_steps(model: Model, gradient, batches: Sequence[Sequence[np.ndarray]],
                    params: Sequence[np.ndarray],
                    state: Sequence[np.ndarray] | None = None) -> reference.OptimizerSteps:
    """`len(batches)` steps of `torch.optim` (the optimizer of the step `model`) from `params`
    and zero state (or `state`, in the step's argument order), with gradients from `gradient`
    (`tvm_gradient`, `torch_gradient`)."""
    optimizer = Optimizer.from_dict(model.config["optimizer"])
    num_params, _ = state_layout(model)
    by_name = {p.name: i for i, p in enumerate(model.params[:num_params])}
    trainable = [by_name[n] for n in model.config["gradients"]]
    return reference.optimizer_steps(gradient, params, trainable, optimizer, batches, state)


@dataclasses.dataclass
class TrainingCheck:
    """How far N compiled steps are from the reference: the largest absolute error of the
    losses, the parameters (elements with rounding-noise gradients aside) and the state, and
    how many parameter elements met only the bound for rounding-noise gradients (see
    `compare_training`); `step_by_step`: each step was compared from the build's own values
    before it, not the N steps from the start."""

    steps: int
    max_loss_error: float
    max_param_error: float
    max_state_error: float
    noise_elements: int
    rtol: float
    atol: float
    step_by_step: bool = False


def compare_training(losses: Sequence[float], params: Sequence[np.ndarray],
                     state: Sequence[np.ndarray], ref: reference.OptimizerSteps,
                     optimizer: Optimizer, rtol: float = 1e-4,
                     atol: float = 1e-5) -> TrainingCheck:
    """Raise `CheckError` unless the losses, parameters and state of N steps match the
    reference within rtol/atol. An Adam or AdamW step turns a gradient that is rounding noise
    (`reference.NOISE_FLOOR`) into a step of up to lr whatever its size, so such elements
    are held to |error| <= 2 N lr + atol instead (their number is reported)."""
    n = len(ref.losses)
    bad = [k + 1 for k, v in enumerate(losses) if not np.isfinite(v)]
    if bad:  # the reference is likely non-finite too: equal, but no evidence the step is right
        raise CheckError(f"the loss is not finite from step {bad[0]} on ({losses[bad[0] - 1]}): "
                         "a check of non-finite steps proves nothing")
    for i, p in enumerate(params):
        if not np.all(np.isfinite(p)):
            raise CheckError(f"parameter {i} is not finite after {n} steps: a check of "
                             "non-finite steps proves nothing")
    loss = compare([np.asarray(losses, np.float64)], [np.asarray(ref.losses, np.float64)],
                   rtol, atol, names=["the losses"])
    adam = optimizer.kind in ("adam", "adamw")
    noise_count, param_err = 0, 0.0
    for i, (p, r) in enumerate(zip(params, ref.params, strict=True)):
        mask = ref.noise[i] if adam and ref.noise[i] is not None else None
        if mask is not None and mask.any():
            bound = 2 * n * optimizer.lr + atol
            diff = np.abs(p.astype(np.float64) - r.astype(np.float64))
            noise_count += int((mask & ~np.isclose(p, r, rtol=rtol, atol=atol)).sum())
            if (diff[mask] > bound).any():
                raise CheckError(f"parameter {i}: an element whose gradient is rounding noise "
                                 f"moved {float(diff[mask].max()):.3g} from the reference, "
                                 f"beyond 2 N lr = {bound:.3g}")
            p, r = np.where(mask, r, p), r
        param_err = max(param_err, compare([p], [r], rtol, atol,
                                           names=[f"parameter {i}"]).max_abs_error)
    state_err = compare(list(state), list(ref.state), rtol, atol,
                        names=[f"state {i}" for i in range(len(state))]).max_abs_error \
        if state else 0.0
    return TrainingCheck(n, loss.max_abs_error, param_err, state_err, noise_count, rtol, atol)
