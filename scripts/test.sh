#!/usr/bin/env bash
# Install tvm_ext with its test extras into a fresh virtual environment (.venv-test) and run
# the lint and the test suite: one pytest worker per core, up to 4 (TVM_EXT_TEST_WORKERS
# sets the number), the 15 slowest tests listed at the end.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TVM_EXT_TEST_VENV:-.venv-test}
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# The build's requirements (pyproject.toml's [build-system], with CMake and Ninja) go into this
# environment and the package is built in it (--no-build-isolation): apache-tvm and NCCL's wheel
# are unpacked once, not a second time into an isolated build environment (25 s of the install).
if BUILD_REQUIRES=$("$VENV/bin/python" -c '
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["build-system"]["requires"]))' 2>/dev/null); then
    mapfile -t REQUIRES <<< "$BUILD_REQUIRES"
    "$VENV/bin/python" -m pip install --quiet "${REQUIRES[@]}" cmake ninja
    "$VENV/bin/python" -m pip install --quiet --no-build-isolation ".[test,frontends]"
else  # Python 3.10 has no tomllib: pip's isolated build
    "$VENV/bin/python" -m pip install --quiet ".[test,frontends]"
fi
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m pytest -q -n "${TVM_EXT_TEST_WORKERS:-auto}" --maxprocesses 4 \
    --durations=15 "$@"
