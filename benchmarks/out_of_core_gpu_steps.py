"""One row of benchmarks/out_of_core_gpu.py, run in a child process of its own: a few AdamW
steps of the prepared model, either tvm_ext's module (unswapped, or swapped under a budget) on
TVM's runtime, or PyTorch training the same model from the same weights on the same batches
the way a user would under that budget.

Every row runs `steps` iterations on batches drawn with seeds seed, seed + 1, ...: the first
warms up (pools, cuBLAS handles, autotuned kernels), the others are timed one by one (the
device synchronised around each). Device memory is read the same way on both sides: the
device's used memory (`torch.cuda.mem_get_info`: the CUDA context, cuBLAS workspaces and every
allocator's pool) after the steps, less what was used before the row placed anything.

PyTorch's ways, under `torch.cuda.set_per_process_memory_fraction(budget / device memory)`:
  eager      plain (the unbudgeted reference; bf16: autocast)
  ckpt       full activation checkpointing (every decoder layer, non-reentrant)
  ckpt_cpu   checkpointing, what it saves kept in pinned host memory (`save_on_cpu`)
  fsdp       FSDP2 `fully_shard` per layer and at the root with `CPUOffloadPolicy` on one rank:
             parameters, gradients and AdamW on the host (CPU Adam)
  fsdp_ckpt  the same with checkpointing
A way that runs out of memory is a row that does not fit.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import numpy as np
from vs_torch_gpu_measure import _loss_fn, draw_inputs, torch_model

TORCH_WAYS = ("eager", "ckpt", "ckpt_cpu", "fsdp", "fsdp_ckpt")


class Memory:
    """The device's used memory, before the row and after its steps."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda
        self.before = self.used()

    def used(self) -> int | None:
        if not self.cuda:
            return None
        free, total = self.torch.cuda.mem_get_info()
        return int(total - free)

    def record(self, row: dict) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            row["device_used_bytes"] = self.used()
            row["device_row_bytes"] = row["device_used_bytes"] - self.before


def _timed_steps(row: dict, step, batches: list, sync, progress) -> None:
    row["losses"], times = [], []
    for i, batch in enumerate(batches):
        sync()
        start = time.perf_counter()
        row["losses"].append(float(step(batch)))
        sync()
        if i:
            times.append(time.perf_counter() - start)
        row["step_times_s"] = times
        progress(row)
    row["step_s"] = statistics.median(times) if times else None
    tokens = row.get("tokens")
    if row["step_s"]:
        row["steps_per_s"] = 1.0 / row["step_s"]
        if tokens:
            row["tokens_per_s"] = tokens / row["step_s"]


def _loaded(directory: str, entry: dict, module: dict, device: str, batches: list):
    """(tvm_ext's module loaded, its arguments placed for the first batch): the weights of
    the torch model built from the config (seed 0), the AdamW state zero, every argument
    placed once where the module reads it (a swapped module's parameters and state on pinned
    host memory, per its sidecar)."""
    import torch

    import tvm_ext  # noqa: F401  (its runtime library: cuBLAS, copy streams)
    from tvm_ext.runtime import exported

    if device == "cuda":
        from tvm_ext.runtime.cuda import ensure_cuda_runtime

        ensure_cuda_runtime()
        torch.cuda.init()
    model = torch_model(entry, torch, "cpu")
    named = dict(model.named_parameters(remove_duplicate=False))
    params = [np.ascontiguousarray(named[n].detach().numpy()) for n in entry["parameters"]]
    del model, named
    state = [np.zeros(x["shape"], dtype=x["dtype"]) for x in entry["state"]]
    mod = exported.load(os.path.join(directory, module["file"]))
    return mod, mod.place([*batches[0], *params, *state])


def tvm_row(directory: str, entry: dict, module: dict, device: str, steps: int, seed: int,
            row: dict, progress) -> None:
    """tvm_ext's module (`_loaded`), each later batch's inputs (token ids, a few KiB) placed
    at its step."""
    import torch

    from tvm_ext.runtime.vm_run import place_argument

    memory = Memory(torch, device == "cuda")
    batches = [draw_inputs(entry, seed + i) for i in range(steps)]
    mod, placed = _loaded(directory, entry, module, device, batches)
    where = mod.argument_devices or [0] * len(placed)

    def step(batch):
        if batch is not batches[0]:
            for i, a in enumerate(batch):
                placed[i] = place_argument(np.asarray(a), mod.devices[where[i]], mod.device)
        return mod.run(placed)[0]

    _timed_steps(row, step, batches, mod.device.sync, progress)
    memory.record(row)


def twin_row(directory: str, entry: dict, module: dict, device: str, seed: int, row: dict,
             progress) -> None:
    """The budgeted builds' unswapped twin (their fused kernels) timed call by call: each
    kernel's seconds per call in its place in the step, which `out_of_core_gpu.py simulate`
    feeds the simulator in place of the roofline's."""
    mod, placed = _loaded(directory, entry, module, device, [draw_inputs(entry, seed)])
    profile = mod.profile(placed, warmup=1, repeat=3)
    by_callee = profile.by_callee()
    net = profile.overhead_s  # the instrument's own cost, in every timed call
    row["kernel_s"] = {name: max(0.0, total / count - net)
                       for name, (count, total) in by_callee.items()
                       if not name.startswith("vm.builtin.")}
    row["profile"] = profile.summary()
    row["step_s"] = profile.wall_s
    progress(row)


def _distributed(torch) -> None:
    """A one-rank process group (FSDP2 needs one), on a free local port."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)


def _trained(torch, entry: dict, way: str, device: str):
    """(the model, its AdamW) set up `way`: checkpointed, sharded with CPU offload."""
    spec = entry["optimizer"]
    model = torch_model(entry, torch, "cpu" if way.startswith("fsdp") else device).train()
    if way in ("ckpt", "ckpt_cpu", "fsdp_ckpt"):
        model.inner.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    fused = True
    if way.startswith("fsdp"):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        _distributed(torch)
        policy = CPUOffloadPolicy(pin_memory=True)
        for layer in model.inner.model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        fused = False  # the parameters and AdamW live on the host: CPU Adam
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"],
                            weight_decay=spec["weight_decay"], fused=fused)
    return model, opt


def _torch_steps(torch, entry: dict, way: str, device: str, steps: int, seed: int, row: dict,
                 sync, progress) -> None:
    bf16 = entry["dtype"] != "fp32"
    model, opt = _trained(torch, entry, way, device)
    loss_fn = _loss_fn(torch, entry["loss"])
    tdev = torch.device(device)
    batches = [[torch.tensor(a, device=tdev) for a in draw_inputs(entry, seed + i)]
               for i in range(steps)]
    saving = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=device == "cuda")) \
        if way == "ckpt_cpu" else contextlib.nullcontext
    precision = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else \
        contextlib.nullcontext

    def step(batch):
        *inputs, labels = batch
        opt.zero_grad(set_to_none=True)
        with saving(), precision():
            loss = loss_fn(model(*inputs), labels)
        loss.backward()
        opt.step()
        return loss.detach().float().cpu()

    _timed_steps(row, step, batches, sync, progress)


def torch_row(entry: dict, way: str, budget: int | None, device: str, steps: int, seed: int,
              row: dict, progress) -> None:
    """PyTorch training the same model `way` (see the module docstring) under `budget`
    device bytes (None: unbudgeted)."""
    import torch

    if way not in TORCH_WAYS:
        raise SystemExit(f"unknown way {way!r}: {', '.join(TORCH_WAYS)}")
    cuda = device == "cuda"
    if way.startswith("fsdp") and not cuda:
        raise SystemExit("FSDP2 with CPUOffloadPolicy needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if cuda:
        torch.cuda.init()
    memory = Memory(torch, cuda)
    # On the CPU stand-in nothing bounds torch's memory: such a row compares with no budget.
    row["budget_enforced"] = cuda and budget is not None
    if row["budget_enforced"]:
        total = torch.cuda.mem_get_info()[1]
        row["memory_fraction"] = budget / total
        torch.cuda.set_per_process_memory_fraction(min(budget / total, 1.0))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:  # the model itself may not fit the budget
        _torch_steps(torch, entry, way, device, steps, seed, row, sync, progress)
        row["fits"] = True
    except torch.OutOfMemoryError as err:
        row["fits"] = False
        row["error"] = f"does not fit: {str(err).splitlines()[0][:300]}"
    if cuda:
        row["max_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    memory.record(row)


def link_row(device: str, row: dict, progress, gib: int = 1, repeats: int = 5) -> None:
    """The host link as the swapped module uses it: `gib` GiB copied between pinned host
    memory and the device, each way `repeats` times; the median bandwidths (bytes/s)."""
    import torch

    if device != "cuda":
        raise SystemExit("the link is measured on a CUDA device")
    host = torch.empty(gib << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        row[f"{name}_bytes_per_s"] = host.numel() / statistics.median(times)
        progress(row)
