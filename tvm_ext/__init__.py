"""tvm_ext: compiler passes for Apache TVM Relax that run models larger than one GPU's memory
(swap planning, after SwapAdvisor) or across several GPUs (operator partitioning, after Tofu).

Importing the package loads its C++ runtime library (memory accounting, copy streams, Disco
collectives) and registers the gradients TVM lacks.
"""

from __future__ import annotations

import os

from . import _layout

_layout.install(os.path.dirname(os.path.abspath(__file__)))

from . import pipeline, runtime  # noqa: E402
from .models import gradients  # noqa: E402

__version__ = "0.1.0"

runtime.load_library()
gradients.register_all()

__all__ = ["__version__", "gradients", "pipeline", "runtime"]
