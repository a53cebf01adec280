#!/usr/bin/env bash
# The real build, on a GPU machine without network: FlagCX 0c721293 with the flagcx_mesh patch,
# `make USE_NVIDIA=1` against the machine's CUDA and the NCCL of its torch environment (the
# nvidia-nccl wheel's headers and library), then real/onesided_real.cc through FlagCX's public
# API on 2, 4 and 8 ranks of this host, and a rank killed mid-build; then (stage perf, with MPI
# from FXM_MPI_HOME or FXM_MPI_WHEEL: real/perf_mpi.sh) FlagCX's own one-sided program
# test/perf/host_api/test_one_side_register.cpp on 2 ranks under mpiexec. Everything comes from the
# FlagCX tree given (made by real/prepare_tree.sh), this repository and the local Python.
#
#   bash integrations/flagcx/build_real.sh FLAGCX_TREE [OUTDIR]
#   bash integrations/flagcx/build_real.sh --dry-run FLAGCX_TREE [OUTDIR]   # no CUDA/NCCL needed
#
# OUTDIR (default $OUT, else ./flagcx-real-out): env.txt, mesh-install.log, make.log, runs.txt
# (every rank's lines of every run), debug.txt (FlagCX's and NCCL's logs: every rank's warnings,
# rank 0's last lines), summary.txt (which variant worked, the figures), perf.txt and perf-make.log
# (stage perf). Environment: PYTHON
# (python3: the one holding torch), CUDA_HOME (/usr/local/cuda, else the toolkit of the nvcc on
# PATH), RANKS ("2 4 8"), JOBS (make -j, default nproc), FLAGCX_MESH_TIMEOUT (build deadline,
# 10 s here), FXM_REAL_BYTES (bytes per registered buffer, 64 MiB), FXM_REAL_STEP_TIMEOUT (30 s),
# and those of real/runs.sh (the FlagCX configurations tried first, each run's bound, the budget).
# --dry-run: applies the patch, compiles what compiles without CUDA and NCCL (the patched
# flagcx.cc, the glue, real/probe.cc, the test program against declarations only) and
# prints the commands it would run.
set -uo pipefail
DRY=0
[ "${1:-}" = --dry-run ] && { DRY=1; shift; }
TREE=${1:?usage: build_real.sh [--dry-run] FLAGCX_TREE [OUTDIR]}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$REPO/integrations/flagcx
OUTDIR=${2:-${OUT:-$PWD/flagcx-real-out}}
PY=${PYTHON:-python3}
CUDA=${CUDA_HOME:-/usr/local/cuda}
if [ -z "${CUDA_HOME:-}" ] && [ ! -f "$CUDA/include/cuda_runtime.h" ] && command -v nvcc >/dev/null; then
  CUDA=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")  # the toolkit of the nvcc on PATH
fi
RANKS=${RANKS:-2 4 8}
JOBS=${JOBS:-$(nproc)}
export FLAGCX_MESH_TIMEOUT=${FLAGCX_MESH_TIMEOUT:-10}
# Never NVLink multicast on the lent machines (their rule), also for programs started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
TREE=$(cd "$TREE" && pwd) || exit 2
# FXM_REAL_WORK: a folder kept between calls (e.g. an ignored one inside the repository, which a
# warm machine keeps): the steps already done there are skipped, so STAGES=build in one call and
# STAGES=run in the next fit the per-call limit. Default: a scratch folder, removed at the end.
WORK=${FXM_REAL_WORK:-$(mktemp -d /tmp/flagcx-real.XXXXXX)}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
[ -n "${FXM_REAL_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT
STAGES=${STAGES:-build run perf}
SUMMARY=$OUTDIR/summary.txt
: >"$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }
die() { say "build_real.sh: FAILED: $*"; exit 1; }
run_or_show() {  # the command, or in a dry run its text
  if [ $DRY = 1 ]; then echo "  (dry run) $*"; else "$@"; fi
}

[ -f "$TREE/flagcx/flagcx.cc" ] || die "$TREE is not a FlagCX tree"
JSON=$TREE/third-party/json/single_include
[ -f "$JSON/nlohmann/json.hpp" ] || die "$JSON/nlohmann/json.hpp missing: make the tree with real/prepare_tree.sh"

step_facts() {
  { date -u; uname -a; nvidia-smi -L 2>&1; "$CUDA/bin/nvcc" --version 2>&1 | tail -2; g++ --version | head -1
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
"gpus", torch.cuda.device_count())' 2>&1
    ls /sys/class/infiniband 2>&1 | head -3; } >"$OUTDIR/env.txt" 2>&1
  say "machine: $(nvidia-smi -L 2>/dev/null | head -1 || true), $(nproc) cores"
  [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ] || say "no RDMA device (/sys/class/infiniband is empty or absent)"
}

find_nccl() {  # NCCL shim: $WORK/nccl/{include,lib/libnccl.so} from the torch env's nvidia-nccl wheel
  local d inc lib
  [ -e "$WORK/nccl/lib/libnccl.so" ] && { say "NCCL: as before ($WORK/nccl)"; return 0; }
  d=$("$PY" -c 'import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])' 2>/dev/null) \
    || { [ $DRY = 1 ] && { echo "  (dry run) no nvidia.nccl in $PY: the GPU machine's torch env has it"; return 0; }
         die "$PY has no nvidia.nccl (the nvidia-nccl wheel torch depends on)"; }
  inc=$(find "$d" -name nccl.h | head -1)
  lib=$(find "$d" -name 'libnccl.so*' | sort | head -1)
  [ -n "$inc" ] && [ -n "$lib" ] || die "no nccl.h or libnccl.so* under $d"
  mkdir -p "$WORK/nccl/lib"
  ln -s "$(dirname "$inc")" "$WORK/nccl/include"
  ln -s "$lib" "$WORK/nccl/lib/libnccl.so"
  ln -s "$lib" "$WORK/nccl/lib/$(basename "$lib")" 2>/dev/null
  say "NCCL: $(grep -E '#define NCCL_(MAJOR|MINOR|PATCH) ' "$inc" | awk '{printf "%s.", $3}' | sed 's/\.$//') from $d"
}

install_mesh() {  # flagcx_mesh from this repository into $WORK/site with the torch env's build tools (offline)
  # (--target, not a venv: a venv made from the torch env's python, itself a venv, would not see
  # that env's scikit-build-core and pybind11)
  if [ $DRY = 1 ]; then
    MESH_HOME=$(dirname "$("$PY" -c 'import flagcx_mesh; print(flagcx_mesh.get_include())')") || die "dry run: $PY has no flagcx_mesh"
    echo "  (dry run) $PY -m pip install --no-index --no-build-isolation --no-deps --target $WORK/site $REPO"
  elif [ -d "$WORK/site/flagcx_mesh" ] && [ "${STAGES/build/}" = "$STAGES" ]; then
    MESH_HOME=$WORK/site/flagcx_mesh
  else
    rm -rf "$WORK/site"
    "$PY" -m pip install -q --no-index --no-build-isolation --no-deps --target "$WORK/site" "$REPO" \
      >"$OUTDIR/mesh-install.log" 2>&1 || { tail -30 "$OUTDIR/mesh-install.log"; die "pip install of flagcx_mesh"; }
    MESH_HOME=$(dirname "$(PYTHONPATH=$WORK/site "$PY" -c 'import flagcx_mesh; print(flagcx_mesh.get_include())')")
  fi
  [ -f "$MESH_HOME/include/flagcx_mesh_net.h" ] && ls "$MESH_HOME"/lib/libflagcx_mesh.so >/dev/null \
    || die "no include/flagcx_mesh_net.h or lib/libflagcx_mesh.so in $MESH_HOME"
  say "flagcx_mesh: $MESH_HOME"
}

patch_tree() {
  [ -f "$WORK/flagcx/flagcx/service/flagcx_mesh_glue.cc" ] && { say "patched: as before"; return 0; }
  rm -rf "$WORK/flagcx" && cp -r "$TREE" "$WORK/flagcx" || die "copying $TREE"
  (cd "$WORK/flagcx" && export GIT_DIR=/nonexistent && git apply "$HERE/flagcx-mesh-0c721293.patch") \
    || die "the patch does not apply to $TREE"
  say "patched: $(grep -c flagcx_mesh "$WORK/flagcx/flagcx/flagcx.cc") flagcx_mesh lines in flagcx/flagcx.cc"
}

FLAGCX_INC=(-I"$WORK/flagcx/flagcx/include" -I"$WORK/flagcx/flagcx/adaptor/include" -I"$WORK/flagcx/flagcx/core/include"
            -I"$WORK/flagcx/flagcx/service/include" -I"$WORK/flagcx/flagcx/runner/include"
            -I"$WORK/flagcx/flagcx/adaptor/device_api" -I"$WORK/flagcx/flagcx/adaptor/shmem" -I"$JSON")

build_flagcx() {
  local t0=$SECONDS lib=$WORK/flagcx/build/lib/libflagcx.so
  local args=(-C "$WORK/flagcx" -j"$JOBS" USE_NVIDIA=1 DEVICE_HOME="$CUDA" CCL_HOME="$WORK/nccl"
              JSON_INCLUDE_DIR="$JSON" FLAGCX_MESH_HOME="$MESH_HOME")
  if [ $DRY = 1 ]; then
    echo "  (dry run) make ${args[*]}"
    g++ -std=c++17 -c "${FLAGCX_INC[@]}" -I"$MESH_HOME/include" "$WORK/flagcx/flagcx/flagcx.cc" -o "$WORK/flagcx.o" \
      && g++ -std=c++17 -c "${FLAGCX_INC[@]}" -I"$MESH_HOME/include" "$WORK/flagcx/flagcx/service/flagcx_mesh_glue.cc" -o "$WORK/glue.o" \
      || die "dry run: the patched flagcx.cc or the glue does not compile"
    say "dry run: the patched flagcx.cc and the glue compile"
    return
  fi
  if ! make "${args[@]}" >"$OUTDIR/make.log" 2>&1; then
    # NCCL >= 2.29 selects FlagCX's NCCL device-API backend; should that not build, its default one.
    say "make USE_NVIDIA=1 failed ($(grep -m1 -E 'error' "$OUTDIR/make.log" | cut -c1-200)); again with FORCE_DEFAULT_PATH=1"
    make "${args[@]}" FORCE_DEFAULT_PATH=1 >>"$OUTDIR/make.log" 2>&1 \
      || { tail -40 "$OUTDIR/make.log"; die "make USE_NVIDIA=1 (see make.log)"; }
  fi
  local syms
  syms=$(nm -D "$lib") || die "nm -D $lib"
  grep -q ' U flagcx_mesh_net_build_full_mesh$' <<<"$syms" || die "libflagcx.so does not call flagcx_mesh_net_build_full_mesh"
  say "libflagcx.so built in $((SECONDS - t0)) s ($(du -h "$lib" | cut -f1)); links: $(ldd "$lib" | grep -oE 'lib(flagcx_mesh|nccl|cudart)[^ ]*' | sort -u | tr '\n' ' ')"
}

build_programs() {
  local b=$WORK/flagcx/build
  if [ $DRY = 1 ]; then
    mkdir -p "$WORK/cudadecl"
    printf '%s\n' '#include <stddef.h>' 'typedef enum { cudaSuccess = 0 } cudaError_t;' \
      'cudaError_t cudaGetDeviceCount(int *); cudaError_t cudaSetDevice(int);' \
      'cudaError_t cudaMalloc(void **, size_t); cudaError_t cudaMemset(void *, int, size_t);' >"$WORK/cudadecl/cuda_runtime.h"
    g++ -std=c++17 -Wall -fsyntax-only -I"$WORK/cudadecl" "${FLAGCX_INC[@]}" "$HERE/real/onesided_real.cc" || die "dry run: onesided_real.cc"
    g++ -std=c++17 -w -c "${FLAGCX_INC[@]}" "$HERE/real/probe.cc" -o "$WORK/probe.o" || die "dry run: probe.cc"
  else
    g++ -std=c++17 -O2 -w -rdynamic "$HERE/real/onesided_real.cc" "$HERE/real/probe.cc" -o "$WORK/onesided_real" \
      "${FLAGCX_INC[@]}" -I"$CUDA/include" -L"$b/lib" -Wl,-rpath,"$b/lib" -lflagcx \
      -L"$CUDA/lib64" -Wl,-rpath,"$CUDA/lib64" -lcudart -ldl -lpthread || die "building onesided_real"
  fi
  say "programs: onesided_real (with real/probe.cc)"
}

source "$HERE/real/runs.sh"  # launch, the variants tried, runs
source "$HERE/real/perf_mpi.sh"  # the perf stage: FlagCX's own one-sided program under MPI

step_facts
find_nccl
install_mesh
patch_tree
if [[ " $STAGES " == *" build "* ]]; then
  build_flagcx
  build_programs
elif [[ " $STAGES " == *" run "* ]]; then
  [ -x "$WORK/onesided_real" ] || die "STAGES=$STAGES but nothing was built in FXM_REAL_WORK=$WORK"
fi
[[ " $STAGES " == *" run "* ]] && runs
[[ " $STAGES " == *" perf "* ]] && perf_stage
say "build_real.sh: done ($([ $DRY = 1 ] && echo 'dry run' || echo "outputs in $OUTDIR"))"
