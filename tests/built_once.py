"""A test fixture's folder built once per test session and shared by pytest-xdist's workers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder that `build(folder)` fills once per test session, shared by pytest-xdist's
    workers: a module-scoped fixture is otherwise built again by every worker that runs one
    of its module's tests. The first worker builds it under a file lock while the others
    wait, then reuse it; a build that fails is tried again by the next worker that asks (and
    fails there too). Tests must only read it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above each worker's own
    folder, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
