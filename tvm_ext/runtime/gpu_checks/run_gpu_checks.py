#!/usr/bin/env python3
"""Run the checks of this tvm_ext GPU bundle on this machine and write one JSON.

    python3 run_gpu_checks.py [--out gpu_results.json] [--suite all|cuda|llvm]
                              [--time-budget 540] [--only zoo,swap]

Needs Python 3, numpy and, for the GPU checks, a CUDA 13 driver and runtime (PyTorch, where
installed, gives the reference timings). Everything else is in this folder: TVM's runtime
(no compiler), tvm-ffi and tvm_ext's runtime under site/, the compiled artefacts under
artifacts/. Without a GPU it runs the CPU self-check and marks the GPU checks skipped.

(The template of the bundle's entry script: tvm_ext.driver.gpu_bundle copies it into the
bundle's root, beside site/.)
"""

import os
import sys

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "site"))  # this bundle's TVM first, whatever else
    from tvm_ext.runtime.gpu_checks import main

    sys.exit(main(sys.argv[1:], bundle_dir=here))
