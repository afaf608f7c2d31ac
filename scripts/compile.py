#!/usr/bin/env python3
"""Compile a model with the tvm_ext pipeline: `python scripts/compile.py MODEL --target T ...`.

See `python scripts/compile.py --help`; the implementation is tvm_ext.cli.
"""

import os
import signal
import sys


def _interrupted_while_starting(signum, _frame):
    """Ctrl-C while TVM loads (seconds), before tvm_ext.interrupts takes over: its one line."""
    os.write(2, f"interrupted by {signal.Signals(signum).name} during starting: stopped, no "
                "file left half written\n".encode())
    os._exit(128 + signum)


if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
    signal.signal(signal.SIGINT, _interrupted_while_starting)

from tvm_ext.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
