#!/usr/bin/env bash
# Installs everything the tests need into a virtual environment (.venv-test by
# default) and runs the whole suite. Extra arguments go to pytest.
#   bash scripts/test.sh            # the full suite
#   bash scripts/test.sh -k wire    # a subset
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${FXM_TEST_VENV:-.venv-test}

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

step "virtual environment $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
step "install flagcx_mesh with its test extras"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check ".[test]"
step "pytest"
"$VENV/bin/pytest" -q --timeout-method=thread -p no:cacheprovider "$@"
