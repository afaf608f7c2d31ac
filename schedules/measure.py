"""Building and timing candidates: a builder whose worker processes live for the whole run, a
runner that times on the target's device, and a runner for build-only tuning that times nothing.

Why not MetaSchedule's LocalBuilder: it starts fresh worker processes for every batch, and each
one's first build imports `tvm.s_tir.tensor_intrin` (~10 s of TVMScript parsing here, more
than the 30 s build timeout on a busy 2-core machine). Our workers are started once and build
without that import: the candidates they receive are already scheduled.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import tempfile

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import _worker_func
from tvm.s_tir.meta_schedule.runner import PyRunner, RunnerFuture, RunnerInput
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from tvm_ext.runtime.candidate_batch import EVALUATOR
from tvm_ext.runtime.cuda import ensure_cuda_compiler, ensure_cuda_runtime
from tvm_ext.runtime.library import load_library

NOT_TIMED = "not timed: build-only tuning (no device here to run on)"


def init_worker(target_kind: str, compiles: bool = True) -> None:
    """Run in each worker process: load what building (`compiles`) or running for the target
    needs. A terminal's Ctrl-C reaches every process of the group: a worker leaves it to the
    tuning run, which stops it (one that took it printed a traceback, and its candidate came
    back as a build error, stored as a record)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    load_library()
    if target_kind == "cuda":
        ensure_cuda_runtime()
        if compiles:
            ensure_cuda_compiler()


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params) -> tvm.runtime.Module:
    """Compile one scheduled candidate (nvcc reads `Target.current()`, hence `with target`)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    with target:
        return tvm.tirx.build(mod, target=target)


def export_candidate(rt_mod: tvm.runtime.Module, root: str) -> str:
    """Write a built candidate where the runner loads it from (a tar, as MetaSchedule does)."""
    from tvm.support.tar import tar

    path = os.path.join(tempfile.mkdtemp(dir=root), "candidate." + tar.output_format)
    rt_mod.export_library(path, fcompile=tar)
    return path


@derived_object
class PooledBuilder(PyBuilder):
    """Builds candidates in worker processes that live as long as the builder."""

    def __init__(self, target_kind: str, max_workers: int, timeout_s: float = 60.0) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        # Candidates of one run live under one directory, removed at shutdown (MetaSchedule's
        # RemoveBuildArtifact removes each once timed; this catches those of an interrupted run).
        self.artifacts = tempfile.mkdtemp(prefix="tvm_ext_tune_")
        self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_s,
                                      initializer=init_worker, initargs=(target_kind,))

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        export = functools.partial(export_candidate, root=self.artifacts)
        jobs = [(build_candidate, export, b.mod, b.target, None) for b in build_inputs]
        results = []
        for res in self.pool.map_with_error_catching(lambda job: _worker_func(*job), jobs):
            if res.status == StatusKind.COMPLETE:
                results.append(BuilderResult(res.value, None))
            elif res.status == StatusKind.TIMEOUT:
                results.append(BuilderResult(None, f"build timed out after {self.timeout_s} s"))
            else:
                results.append(BuilderResult(None, f"build failed: {res.value}"))
        return results

    def shutdown(self) -> None:
        self.pool.shutdown()
        shutil.rmtree(self.artifacts, ignore_errors=True)


@derived_object
class UntimedRunner(PyRunner):
    """For build-only tuning: every built candidate comes back untimed.

    MetaSchedule stores such candidates with its 'no time' stub, which never counts as a valid
    record: nothing tuned this way is ever applied.
    """

    def run(self, runner_inputs: list[RunnerInput]) -> list[RunnerFuture]:
        return [LocalRunnerFuture(res=None, error_message=NOT_TIMED) for _ in runner_inputs]


def alloc_arguments(device, args_info, alloc_repeat: int) -> list[list]:
    """Kernel arguments for timing: random floats, and zeros for integer tensors, which are
    indices (take, embedding lookups) that random values would send out of bounds (a crash)."""
    import numpy as np
    import tvm_ffi

    random_fill = tvm_ffi.get_global_func("tvm.contrib.random.random_fill_for_measure")
    repeated = []
    for _ in range(alloc_repeat):
        args = []
        for kind, dtype, shape in args_info:
            if kind != "TENSOR":
                raise NotImplementedError(f"cannot allocate a {kind} kernel argument")
            arg = tvm.runtime.empty(shape=shape, dtype=dtype, device=device)
            if dtype.startswith(("int", "uint")):
                arg.copyfrom(np.zeros(shape, dtype=dtype))
            else:
                random_fill(arg)
            args.append(arg)
        repeated.append(args)
    return repeated


def timing_runner(target_kind: str, timeout_s: float = 30.0) -> ms.runner.LocalRunner:
    """MetaSchedule's local runner (one worker: timings must not overlap) on the target device."""
    return ms.runner.LocalRunner(
        timeout_sec=timeout_s,
        f_alloc_argument=alloc_arguments,
        evaluator_config=ms.runner.EvaluatorConfig(**EVALUATOR),
        initializer=functools.partial(init_worker, target_kind, False),
    )
