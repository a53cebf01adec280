#!/usr/bin/env bash
# python -m flagcx_mesh.bench agent beside Mooncake TE and NIXL, in a venv of its own (.venv-bench;
# the test venvs never get either): docs/benchmarks.md, "Agents". Arguments go to the bench.
# Mooncake's engine.so needs libibverbs.so.1 even without RDMA devices (Debian: libibverbs1).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-bench}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q numpy scikit-build-core pybind11 mooncake-transfer-engine-non-cuda nixl-cu13
"$VENV/bin/pip" install -q --no-deps nixl   # the meta package; its CUDA-variant probing is all it adds
"$VENV/bin/pip" install -q --no-build-isolation --no-deps -C build-dir=build/bench .
cd /tmp  # the installed package, not the source tree
exec "$OLDPWD/$VENV/bin/python" -m flagcx_mesh.bench agent "$@"
