"""TVM's C++ log kept out of the CLI's output: what TVM's compiler writes to the process's
stderr (its `LOG(WARNING)` lines, with no level to filter them by) goes to a file for the
length of the job, while Python's own stderr (the CLI's errors, Python warnings) still reaches
the terminal. `--verbose` leaves stderr alone, so TVM's log shows as it comes."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile


@contextlib.contextmanager
def tvm_log_captured(verbose: bool = False):
    """Within the block, file descriptor 2 goes to a temporary file (yields it, or None when
    `verbose`); `sys.stderr`, where it wrote to that descriptor, writes to the terminal's."""
    if verbose:
        yield None
        return
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    replaced = _writes_to_fd2(python_stderr)
    with tempfile.TemporaryFile(mode="w+b", prefix="tvm_ext_tvm_log") as log:
        if replaced:
            sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(saved), "wb", buffering=0),
                                          encoding=python_stderr.encoding or "utf-8",
                                          errors="backslashreplace", line_buffering=True)
        os.dup2(log.fileno(), 2)
        try:
            yield log
        finally:
            if replaced:
                sys.stderr.flush()
                sys.stderr.close()
                sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)


def _writes_to_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # a test's capture, a StringIO
        return False


def logged_lines(log) -> list[str]:
    """The lines TVM wrote to a captured log."""
    if log is None:
        return []
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace").splitlines()
