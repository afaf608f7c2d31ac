#!/usr/bin/env bash
# Install tvm_ext with its test extras into a fresh virtual environment (.venv-test) and run
# the lint and the test suite. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TVM_EXT_TEST_VENV:-.venv-test}
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet ".[test,frontends]"
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m pytest -q "$@"
