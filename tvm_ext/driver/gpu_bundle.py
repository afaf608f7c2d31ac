"""The GPU bundle: everything the GPU checks need, compiled on this machine (no GPU needed), in
one folder that runs with `python3 BUNDLE/run_gpu_checks.py` on a machine that has only CUDA,
numpy and Python: TVM's runtime, tvm-ffi, tvm_ext's runtime, the exported modules with their
sidecars, inputs and expected outputs, and one entry script (`tvm_ext.runtime.gpu_checks`).

    report = build_bundle("out/")                        # scripts/gpu_bundle.py out/
    # there: python3 out/run_gpu_checks.py --out gpu_results.json
    finish_results("out/", "gpu_results.json")           # the simulation, if numba was missing
    import_tuning("out/", "gpu_results.json", "tvm_ext_tune_db")   # the measured candidates

Two suites: "cuda" (the GPU checks, `--target cuda --arch ARCH`) and "llvm" (the CPU
self-check: the same checks on small modules for any x86-64, run where there is no GPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable

import tvm

from tvm_ext.schedules import DEFAULT_WORK_DIR, import_measurements

from ..errors import InputError
from ..runtime.cuda import DEFAULT_ARCH
from ..runtime.gpu_checks import plan_suite
from ..runtime.gpu_checks.bundle import ENTRY, FORMAT, MANIFEST, SITE, Bundle
from ..runtime.gpu_checks.report import write_json
from ..runtime.gpu_checks.suite import SuiteRun
from ..runtime.gpu_checks.swapped import simulate_measured
from . import bundle_runtime
from .build import resolve_target
from .bundle_artifacts import (
    SuiteConfig,
    SuiteWriter,
    conv_entries,
    gemm_entries,
    partition_entry,
    swap_entry,
    swap_link,
    tuning_entry,
    zoo_entries,
)

SIZE_LIMIT = 60 * 2**20  # a larger bundle is refused: it must travel as one copy of <= 64 MiB
GPU_PYTHON = "3.12"  # the Python of the GPU machines this bundle is for
Log = Callable[[str], None]

# The CPU self-check: every check on small modules, for any x86-64 (no vendor library, which
# the machine deployed to may lack).
SELF_CHECK = SuiteConfig(zoo=("mlp",), zoo_size="tiny", swap_model="mlp", swap_size="tiny",
                         swap_budgets=("75%", "min"), swap_time_budget=1.0, swap_repeat=3,
                         partition_model="mlp", partition_size="tiny", gemm_models=("mlp",),
                         gemm_size="tiny", gemm_count=1, conv_size="tiny", conv_count=2,
                         copy_sizes_mib=(4,), strided_rows=256,
                         tune_trials=0,
                         library=False)
GPU_SUITE = SuiteConfig()
# The GPU suite at the self-check's sizes: for tests, and a first look at a new machine.
QUICK = dataclasses.replace(SELF_CHECK, library=True)


@dataclasses.dataclass(frozen=True)
class BundleConfig:
    cuda: SuiteConfig = GPU_SUITE
    llvm: SuiteConfig = SELF_CHECK
    arch: str = DEFAULT_ARCH
    hardware: str = "h100"  # the preset the GPU suite's swap plans assume
    python_versions: tuple[str, ...] = ()  # of tvm-ffi's extension; default: here and GPU_PYTHON
    nccl: bool = True
    tune_db: str = DEFAULT_WORK_DIR  # where offline tuning keeps its build-only records
    seed: int = 0


@dataclasses.dataclass
class BundleReport:
    directory: str
    size_bytes: int
    files: int
    nccl: dict
    python_versions: list[str]


def check_output_dir(out_dir: str) -> None:
    """Refuse, before compiling, a folder that is not empty and not a bundle, or that cannot
    be written."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise InputError(f"{out_dir} exists and is not a folder")
        if os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, MANIFEST)):
            raise InputError(f"{out_dir} is not empty and holds no bundle: choose another "
                             "folder (a bundle is replaced whole, anything else is kept)")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise InputError(f"cannot write in {parent}")


def build_bundle(out_dir: str, config: BundleConfig | None = None,
                 log: Log | None = None) -> BundleReport:
    """Compile every artefact and pack the runtime tree into `out_dir` (built beside it and
    moved there at the end: a failure leaves no half bundle, and a bundle there is replaced)."""
    config = config or BundleConfig()
    log = log or (lambda line: print(line, flush=True))
    out_dir = os.path.abspath(out_dir)
    check_output_dir(out_dir)
    versions = sorted(set(config.python_versions) or {_local_python(), GPU_PYTHON})
    staging = out_dir + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        manifest = _manifest(config, versions)
        cache = bundle_runtime.cache_dir()
        nccl_lib, how = (bundle_runtime.build_nccl_backend(cache, log) if config.nccl
                         else (None, "left out (--no-nccl)"))
        manifest["suites"]["cuda"] = _suite(staging, "cuda", config.cuda, config, log)
        manifest["suites"]["cuda"]["nccl"] = {"built": nccl_lib is not None, "reason": how}
        manifest["suites"]["llvm"] = _suite(staging, "llvm", config.llvm, config, log)
        manifest["files"] = {**manifest["suites"]["cuda"].pop("files"),
                             **manifest["suites"]["llvm"].pop("files")}
        log("packing the runtime (no compiler)")
        site = os.path.join(staging, SITE)
        bundle_runtime.copy_tvm(site)
        bundle_runtime.copy_tvm_ffi(site, versions, cache, log)
        bundle_runtime.copy_typing_extensions(site)
        manifest["runtime_modules"] = bundle_runtime.copy_tvm_ext(site, nccl_lib)
        shutil.copy2(_entry_template(), os.path.join(staging, ENTRY))
        write_json(os.path.join(staging, MANIFEST), manifest)
        size, files = tree_size(staging)
        if size > SIZE_LIMIT:
            raise InputError(f"the bundle takes {size / 2**20:.1f} MiB, over the "
                             f"{SIZE_LIMIT / 2**20:.0f} MiB a GPU machine call carries: "
                             "fewer or smaller models")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return BundleReport(out_dir, size, files, manifest["suites"]["cuda"]["nccl"], versions)


def _local_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _entry_template() -> str:
    return os.path.join(bundle_runtime.PACKAGE_DIR, "runtime", "gpu_checks", ENTRY)


def _manifest(config: BundleConfig, versions: list[str]) -> dict:
    return {"format": FORMAT, "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "built_on": platform.node(), "tvm_ext_version": importlib.metadata.version("tvm_ext"),
            "tvm_version": tvm.__version__, "arch": config.arch, "python": versions,
            "config": dataclasses.asdict(config), "suites": {}}


def _suite(root: str, name: str, cfg: SuiteConfig, config: BundleConfig, log: Log) -> dict:
    """Compile one suite's artefacts; its manifest entry (with "files": their sha256)."""
    if name == "cuda":
        target, hardware = resolve_target("cuda", config.arch), config.hardware
    else:  # any x86-64: the self-check may run on another CPU than this one
        target, hardware = tvm.target.Target({"kind": "llvm"}), "cpu"
    log(f"suite {name}: compiling for {target.kind.name}")
    writer = SuiteWriter(root, name)
    link = swap_link(hardware)
    spec = {"target": json.loads(str(target)), "hardware": hardware,
            "copies": {"sizes_mib": list(cfg.copy_sizes_mib), "link": link,
                       "strided_rows": cfg.strided_rows,
                       "strided_row_bytes": list(cfg.strided_row_bytes)},
            "zoo": zoo_entries(writer, cfg, target, log, config.seed),
            "swap": swap_entry(writer, cfg, target, hardware, log, config.seed),
            "partition": [partition_entry(writer, cfg, target, hardware, log, config.seed)],
            "gemm": gemm_entries(writer, cfg, target, log),
            "conv": conv_entries(writer, cfg, target, log),
            "tuning": tuning_entry(writer, cfg, target, config.tune_db, log)}
    spec["files"] = writer.finish()
    return spec


def tree_size(root: str) -> tuple[int, int]:
    """(bytes, files) of a folder."""
    size = count = 0
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                size += os.path.getsize(path)
                count += 1
    return size, count


def planned_checks(bundle_dir: str) -> list[str]:
    """The names of the checks a bundle runs, per suite."""
    bundle = Bundle(bundle_dir)
    names = []
    for suite in ("cuda", "llvm"):
        if bundle.suite(suite) is not None:
            names += [n for n, _, _ in plan_suite(SuiteRun.create(bundle, suite), {})]
    return names


def finish_results(bundle_dir: str, results_path: str) -> int:
    """Add the simulated iteration times to a results JSON from a machine where the swap
    simulator did not import (no numba there), or simulate again with today's simulator,
    from the measurements the JSON holds; returns how many rows it simulated."""
    bundle = Bundle(bundle_dir)
    with open(results_path) as f:
        results = json.load(f)
    checks = {c["name"]: c for c in results.get("checks", [])}
    added = 0
    for suite in ("cuda", "llvm"):
        spec = (bundle.suite(suite) or {}).get("swap")
        kernels = checks.get(f"{suite}/swap/kernels", {}).get("data", {}).get("seconds")
        if not spec or kernels is None:
            continue
        with open(bundle.path(spec["problem"])) as f:
            problem = json.load(f)
        rows = checks.get(f"{suite}/copies", {}).get("data", {}).get("rows")
        bandwidth = ({"h2d": rows[-1]["h2d_bytes_per_s"], "d2h": rows[-1]["d2h_bytes_per_s"]}
                     if rows else {})
        for entry in spec["budgets"]:
            check = checks.get(f"{suite}/swap/{entry['label']}")
            if check is None or "swapped_ms" not in check["data"]:
                continue
            with open(bundle.path(entry["sidecar"])) as f:
                plan = json.load(f)["plan"]
            iteration_ms = check["data"].get("unswapped_ms")
            check["data"].update(simulate_measured(problem, plan, kernels, bandwidth,
                                                   iteration_ms / 1e3 if iteration_ms else None))
            check["data"].pop("simulated", None)
            check["data"]["measured_vs_simulated"] = (check["data"]["swapped_ms"]
                                                      / check["data"]["simulated_ms"])
            added += 1
    write_json(results_path, results)
    return added


def import_tuning(bundle_dir: str, results_path: str, work_dir: str = DEFAULT_WORK_DIR):
    """Bring the GPU's timings of the bundle's tuning batch into `work_dir` (see
    `tvm_ext.schedules.offline`)."""
    bundle = Bundle(bundle_dir)
    spec = (bundle.suite("cuda") or {}).get("tuning")
    if not spec:
        raise InputError(f"the bundle in {bundle_dir} has no tuning batch (built with "
                         "--tune-trials 0)")
    return import_measurements(bundle.path(spec["batch"]), results_path, work_dir)
