#!/usr/bin/env bash
# Builds flagcx_mesh with a sanitizer into its own venv and runs tests under it.
#   bash scripts/sanitize.sh address [pytest args...]   # ASan + UBSan
#   bash scripts/sanitize.sh thread  [pytest args...]   # TSan
# Without pytest args it runs the engine, threads-as-ranks, C ABI and adaptor tests.
# The interpreter is not instrumented: the sanitizer runtime is preloaded (LD_PRELOAD), and
# rank processes started by the tests inherit it. A report fails the test that caused it
# (halt_on_error), so a clean run is a run with no report.
set -uo pipefail
cd "$(dirname "$0")/.."
kind=${1:-}
case "$kind" in
    address) runtime=libasan.so ;;
    thread) runtime=libtsan.so ;;
    *) echo "usage: bash scripts/sanitize.sh address|thread [pytest args...]" >&2; exit 2 ;;
esac
shift
venv=.venv-san-$kind
PYTHON=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv" || exit 1
"$venv/bin/pip" install -q --disable-pip-version-check pytest pytest-timeout numpy scikit-build-core pybind11 \
    || exit 1
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall \
    -C cmake.define.FXM_SANITIZE="$kind" -C cmake.define.CMAKE_UNITY_BUILD=OFF -C build-dir="build/san-$kind" \
    -C cmake.define.FXM_TEST_DOUBLES=ON -C cmake.define.FXM_TEST_DOUBLES_DIR="$PWD/build/san-$kind/test-doubles" -C install.strip=false -C cmake.build-type=RelWithDebInfo . || exit 1
export FXM_TEST_DOUBLES_DIR=$PWD/build/san-$kind/test-doubles  # the instrumented ones
lib=$(${CC:-cc} -print-file-name="$runtime")
[ -f "$lib" ] || { echo "scripts/sanitize.sh: no $runtime for ${CC:-cc} (install the compiler's sanitizer runtime)" >&2; exit 1; }
[ $# -gt 0 ] || set -- tests/test_onesided.py tests/test_onesided_races.py tests/test_onesided_review.py \
    tests/test_mesh_threads.py tests/test_capi.py \
    tests/test_net_capi.py tests/test_net_builders.py tests/test_net_modes.py tests/test_engine_limits.py \
    tests/test_root_exit.py
# libstdc++ right after the runtime: its C++ exception interceptors bind to the libstdc++
# loaded at start-up (the interpreter itself links none).
export LD_PRELOAD="$lib $(${CXX:-c++} -print-file-name=libstdc++.so.6)"
# The interpreter's own allocator hides frees from the sanitizer (reused memory then looks
# like a race between threads the GIL orders): use malloc.
export PYTHONMALLOC=malloc
symbolizer=$(command -v llvm-symbolizer || command -v addr2line || true)
sym=${symbolizer:+:external_symbolizer_path=$symbolizer}
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1$sym
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1$sym
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/tsan.supp$sym"
timeout -k 10 3600 "$venv/bin/pytest" -q --timeout-method=thread -p no:cacheprovider "$@"
