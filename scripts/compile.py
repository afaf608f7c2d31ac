#!/usr/bin/env python3
"""Compile a model with the tvm_ext pipeline: `python scripts/compile.py MODEL --target T ...`.

See `python scripts/compile.py --help`; the implementation is tvm_ext.cli.
"""

import sys

from tvm_ext.cli import main

if __name__ == "__main__":
    sys.exit(main())
