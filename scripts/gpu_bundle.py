#!/usr/bin/env python3
"""Build a GPU bundle: `python scripts/gpu_bundle.py OUT_DIR`, then on the GPU machine
`python3 OUT_DIR/run_gpu_checks.py`.

See `python scripts/gpu_bundle.py --help` and the README ("Deploying to a GPU machine"); the
implementation is tvm_ext.cli.gpu_bundle and tvm_ext.driver.gpu_bundle.
"""

import sys

from tvm_ext.cli.gpu_bundle import main

if __name__ == "__main__":
    sys.exit(main())
