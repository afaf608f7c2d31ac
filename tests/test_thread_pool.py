"""TVM's CPU thread pool binds the thread that creates it to one core; importing tvm_ext gives
the main thread its cores back, so that the threads and processes it starts later (PyTorch's,
MetaSchedule's workers, subprocesses) are not all confined to that core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os
cores = os.sched_getaffinity(0)
import tvm
from tvm_ext import driver
from tvm_ext.models import get_model
model = get_model("mlp", "tiny")
driver.run(driver.build(model, tvm.target.Target("llvm")), model.random_arguments(0), tvm.cpu())
print(sorted(cores), sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a process allowed on two cores or more")
def test_the_main_thread_keeps_its_cores_after_building_and_running():
    env = {k: v for k, v in os.environ.items() if k != "TVM_BIND_THREADS"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = proc.stdout.strip().splitlines()[-1].split("] [")
    assert before + "]" == "[" + after, proc.stdout
