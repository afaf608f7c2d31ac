"""tvm_ext: compiler passes for Apache TVM Relax that run models larger than one GPU's memory
(swap planning, after SwapAdvisor) or across several GPUs (operator partitioning, after Tofu).

Importing the package loads its C++ runtime library (memory accounting, copy streams, Disco
collectives) and registers the gradients TVM lacks. Where TVM runs without its compiler (a
deployment: `TVM_USE_RUNTIME_LIB=1`, or no `libtvm_compiler.so`, as in the GPU bundle), only the
runtime side is there: `tvm_ext.runtime` runs exported modules; nothing compiles.
"""

from __future__ import annotations

import os

import tvm

from . import _layout

_layout.install(os.path.dirname(os.path.abspath(__file__)))

from . import runtime  # noqa: E402

__version__ = "0.1.0"
RUNTIME_ONLY = bool(tvm._RUNTIME_ONLY)

runtime.load_library()
runtime.thread_pool.release_main_thread()

if RUNTIME_ONLY:
    __all__ = ["RUNTIME_ONLY", "__version__", "runtime"]
else:
    from . import pipeline
    from .models import gradients

    gradients.register_all()
    __all__ = ["RUNTIME_ONLY", "__version__", "gradients", "pipeline", "runtime"]
