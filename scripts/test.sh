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
"$VENV/bin/python" -m pip install --quiet ".[test,frontends]"
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m pytest -q -n "${TVM_EXT_TEST_WORKERS:-auto}" --maxprocesses 4 \
    --durations=15 "$@"
