#!/usr/bin/env bash
# Builds mesh_check against a FlagCX checkout with the patch applied (CPU only:
# FlagCX's socket adaptor, its collective bootstrap and the patch's glue) and
# runs every builder over it, then a rank that dies mid-build.
#   FLAGCX_SRC=/path/to/FlagCX bash check.sh [NRANKS] [TRIALS]
set -euo pipefail
: "${FLAGCX_SRC:?set FLAGCX_SRC to a FlagCX checkout (0c721293) with flagcx-mesh-0c721293.patch applied}"
N=${1:-8}
T=${2:-20}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
MESH_INC=$($PY -c 'import flagcx_mesh; print(flagcx_mesh.get_include())')
MESH_LIB=$(dirname "$MESH_INC")/lib
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$FLAGCX_SRC"
INC="-Iflagcx/include -Iflagcx/adaptor/include -Iflagcx/adaptor/device_api -Iflagcx/adaptor/shmem
     -Iflagcx/runner/include -Iflagcx/core/include -Iflagcx/service/include -I$MESH_INC"
for f in "$HERE/mesh_check.cc" "$HERE/stubs.cc" flagcx/service/flagcx_mesh_glue.cc flagcx/adaptor/net/socket_adaptor.cc \
         flagcx/core/socket.cc flagcx/service/bootstrap.cc flagcx/service/param.cc flagcx/service/debug.cc \
         flagcx/service/utils.cc; do
  g++ -std=c++17 -O1 -c $INC "$f" -o "$WORK/$(basename "$f" .cc).o"
done
g++ -o "$WORK/mesh_check" "$WORK"/*.o -L"$MESH_LIB" -Wl,-rpath,"$MESH_LIB" -lflagcx_mesh -lpthread -ldl

run() {  # run NRANKS BUILDER TRIALS [DIE_RANK], with the environment given
  local n=$1 b=$2 t=$3 die=${4:-} r
  rm -f "$WORK/handle"
  for r in $(seq 0 $((n - 1))); do
    timeout 120 "$WORK/mesh_check" "$WORK/handle" "$r" "$n" "$b" "$t" $die >"$WORK/out$r" 2>"$WORK/err$r" &
  done
  wait || true
}

summary() {  # completed / miswired / hung / failed out of T, from rank 0's lines
  local f=$WORK/out0
  echo "$(grep -c ': completed' "$f" || true) completed, $(grep -c ': miswired' "$f" || true) miswired," \
       "$(grep -c ': hung' "$f" || true) hung, $(grep -c ': failed' "$f" || true) failed"
  grep -v ': completed' "$f" | head -1 | cut -c1-300 || true
}

for socks in "1 socket per connection:" "4 sockets per connection (FLAGCX_SOCKET_NTHREADS=2 FLAGCX_NSOCKS_PERTHREAD=2):"; do
  echo "FlagCX socket adaptor, $N ranks, $T trials per builder, $socks"
  for b in legacy ordered tagged; do
    if [[ $socks == 4* ]]; then
      FLAGCX_SOCKET_NTHREADS=2 FLAGCX_NSOCKS_PERTHREAD=2 run "$N" "$b" "$T"
    else
      FLAGCX_SOCKET_NTHREADS=1 FLAGCX_NSOCKS_PERTHREAD=0 run "$N" "$b" "$T"
    fi
    echo "  $b: $(summary)"
  done
done
echo "ordered over FlagCX's bootstrap, 4 ranks, rank 2 exits after the listen-handle allgather (deadline 5 s):"
FLAGCX_SOCKET_NTHREADS=1 FLAGCX_NSOCKS_PERTHREAD=0 run 4 ordered 1 2
for r in 0 1 3; do echo "  $(cut -c1-400 "$WORK/out$r")"; done
