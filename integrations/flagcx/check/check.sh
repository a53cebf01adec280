#!/usr/bin/env bash
# Builds mesh_check against FlagCX's sources with the patch applied (CPU only:
# FlagCX's socket adaptor, its collective bootstrap and the patch's glue),
# compiles the patched flagcx/flagcx.cc and checks that it links against the
# glue and libflagcx_mesh, then runs every builder over the socket adaptor and
# a rank that dies mid-build. Exits non-zero when a builder that must work
# hangs, miswires or fails.
#
#   FLAGCX_SRC=/path/to/FlagCX bash check.sh [NRANKS] [TRIALS]
#
# FLAGCX_SRC: a FlagCX tree at 0c721293, patched or not (a plain one is copied
#   and patched in a scratch folder; the tree itself is never written).
# FLAGCX_JSON_INCLUDE: a folder holding nlohmann/json.hpp (FlagCX's utils.h
#   includes it). Unset: FlagCX's third-party/json submodule, the system's
#   (Debian: nlohmann-json3-dev), or the nlohmann-json PyPI package.
# CHECK_BUILD_DIR: keep the objects there between runs (default: a scratch folder).
# CHECK_SCENARIOS (default "1sock 4sock die"), CHECK_BUILDERS (default
#   "legacy ordered tagged"), CHECK_CLEAN (default "ordered tagged": the
#   builders that must complete every trial; legacy, FlagCX's loop as shipped,
#   is expected to miswire), CHECK_RANK_TIMEOUT (s a rank may run, default 120).
# Exit: 0 every verdict passed; 1 a builder hung, miswired or failed where it
# must not; 2 the check could not run (sources, header, compiler), said why.
set -uo pipefail
N=${1:-8}
T=${2:-20}
HERE=$(cd "$(dirname "$0")" && pwd)
PATCH=$HERE/../flagcx-mesh-0c721293.patch
PY=${PYTHON:-python3}
SCENARIOS=${CHECK_SCENARIOS:-1sock 4sock die}
BUILDERS=${CHECK_BUILDERS:-legacy ordered tagged}
CLEAN=${CHECK_CLEAN:-ordered tagged}
RANK_TIMEOUT=${CHECK_RANK_TIMEOUT:-120}
failures=()

setup_error() { echo "check.sh: cannot run: $*" >&2; exit 2; }
verdict_fail() { echo "  FAIL: $*"; failures+=("$*"); }

[ -n "${FLAGCX_SRC:-}" ] || setup_error "set FLAGCX_SRC to a FlagCX checkout at 0c721293 (patched or not)"
[ -f "$FLAGCX_SRC/flagcx/flagcx.cc" ] || setup_error "FLAGCX_SRC=$FLAGCX_SRC holds no flagcx/flagcx.cc: not a FlagCX tree"
MESH_INC=$($PY -c 'import flagcx_mesh; print(flagcx_mesh.get_include())' 2>/dev/null) \
  || setup_error "$PY cannot import flagcx_mesh: pip install . in the flagcx_mesh repository (or set PYTHON)"
MESH_LIB=$(dirname "$MESH_INC")/lib
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
OBJ=${CHECK_BUILD_DIR:-$WORK}  # CHECK_BUILD_DIR: objects kept there, rebuilt only when older than their source
mkdir -p "$OBJ" || setup_error "cannot create CHECK_BUILD_DIR=$OBJ"

find_json() {  # prints a folder holding nlohmann/json.hpp, or fails
  local d spec
  if [ -n "${FLAGCX_JSON_INCLUDE:-}" ]; then
    [ -f "$FLAGCX_JSON_INCLUDE/nlohmann/json.hpp" ] && { echo "$FLAGCX_JSON_INCLUDE"; return 0; }
    echo "FLAGCX_JSON_INCLUDE=$FLAGCX_JSON_INCLUDE holds no nlohmann/json.hpp" >&2
    return 1
  fi
  for d in "$FLAGCX_SRC/third-party/json/single_include" "$FLAGCX_SRC/third-party/json/include" /usr/include /usr/local/include; do
    [ -f "$d/nlohmann/json.hpp" ] && { echo "$d"; return 0; }
  done
  # the nlohmann-json PyPI package, found without importing it (its __init__ needs importlib_resources)
  spec=$($PY -c 'import importlib.util as u; s = u.find_spec("nlohmann_json"); print(list(s.submodule_search_locations)[0])' 2>/dev/null) \
    && [ -f "$spec/include/nlohmann/json.hpp" ] && { echo "$spec/include"; return 0; }
  echo "nlohmann/json.hpp not found (FlagCX keeps it in its third-party/json submodule, empty in a plain" \
       "clone). Any one of: git -C \$FLAGCX_SRC submodule update --init third-party/json;" \
       "apt-get install nlohmann-json3-dev; pip install nlohmann-json; or set FLAGCX_JSON_INCLUDE" >&2
  return 1
}
JSON_INC=$(find_json) || setup_error "no JSON header (see above)"

# A tree without the glue gets the patch applied to a copy of its sources.
SRC=$FLAGCX_SRC
if [ ! -f "$SRC/flagcx/service/flagcx_mesh_glue.cc" ]; then
  SRC=$OBJ/src  # kept with CHECK_BUILD_DIR, so its files keep their times
  if [ ! -f "$SRC/flagcx/service/flagcx_mesh_glue.cc" ] || [ "$PATCH" -nt "$SRC/flagcx/service/flagcx_mesh_glue.cc" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC" && cp -rp "$FLAGCX_SRC/flagcx" "$FLAGCX_SRC/Makefile" "$SRC/" \
      || setup_error "copying $FLAGCX_SRC"
    (cd "$SRC" && export GIT_DIR=/nonexistent && git apply --check "$PATCH" 2>/dev/null && git apply "$PATCH") \
      || setup_error "the patch does not apply to $FLAGCX_SRC (not FlagCX 0c721293?)"
  fi
  echo "patched a copy of $FLAGCX_SRC"
fi

cd "$SRC" || setup_error "cd $SRC"
INC=(-Iflagcx/include -Iflagcx/adaptor/include -Iflagcx/adaptor/device_api -Iflagcx/adaptor/shmem
     -Iflagcx/runner/include -Iflagcx/core/include -Iflagcx/service/include -I"$MESH_INC" -I"$JSON_INC")
objs=()
compile() {  # compile SOURCE OPT OBJECT (skipped when OBJECT is newer than SOURCE and this script)
  local f=$1 opt=$2 o=$3
  [[ $OBJ != "$WORK" && $o -nt $f && $o -nt $HERE/check.sh ]] \
    || g++ -std=c++17 "$opt" -c "${INC[@]}" "$f" -o "$o" || setup_error "compiling $f failed"
  [[ $o == */flagcx_cc.o ]] || objs+=("$o")
}
for f in "$HERE/mesh_check.cc" "$HERE/stubs.cc" flagcx/service/flagcx_mesh_glue.cc flagcx/adaptor/net/socket_adaptor.cc \
         flagcx/core/socket.cc flagcx/service/bootstrap.cc flagcx/service/param.cc flagcx/service/debug.cc \
         flagcx/service/utils.cc; do
  compile "$f" -O1 "$OBJ/$(basename "$f" .cc).o"
done
g++ -o "$WORK/mesh_check" "${objs[@]}" -L"$MESH_LIB" -Wl,-rpath,"$MESH_LIB" -lflagcx_mesh -lpthread -ldl \
  || setup_error "linking mesh_check failed"

# The patched flagcx.cc: it compiles, and every flagcx_mesh symbol it needs is
# defined by the glue (same C++ signatures) or by libflagcx_mesh.
echo "patched flagcx/flagcx.cc:"
compile flagcx/flagcx.cc -O0 "$OBJ/flagcx_cc.o"
wanted=$(nm "$OBJ/flagcx_cc.o" | awk '$1 == "U" && $2 ~ /flagcx_mesh|flagcxMesh/ {print $2}' | sort -u)
have=$( { nm "$OBJ/flagcx_mesh_glue.o"; nm -D "$MESH_LIB/libflagcx_mesh.so"; } | awk '$2 ~ /^[TDBR]$/ {print $3}' | sort -u)
if ! grep -qx flagcx_mesh_net_build_full_mesh <<<"$wanted"; then
  verdict_fail "flagcx/flagcx.cc does not call flagcx_mesh_net_build_full_mesh: the patch is not in it"
fi
missing=$(comm -23 <(echo "$wanted") <(echo "$have"))
if [ -n "$missing" ]; then
  verdict_fail "flagcx/flagcx.cc needs symbols that neither the glue nor libflagcx_mesh defines: $missing"
else
  echo "  compiles; its $(wc -l <<<"$wanted") flagcx_mesh symbols are all defined by the glue or libflagcx_mesh"
fi

rc_of=()
run() {  # run NRANKS BUILDER TRIALS [DIE_RANK]: every rank, with the environment given; rc_of[rank]
  local n=$1 b=$2 t=$3 die=${4:-} r pids=()
  rm -f "$WORK/handle"
  for r in $(seq 0 $((n - 1))); do
    timeout -k 5 "$RANK_TIMEOUT" "$WORK/mesh_check" "$WORK/handle" "$r" "$n" "$b" "$t" $die >"$WORK/out$r" 2>"$WORK/err$r" &
    pids[r]=$!
  done
  rc_of=()
  for r in $(seq 0 $((n - 1))); do wait "${pids[r]}"; rc_of[r]=$?; done
}

count() { grep -c ": $1" "$WORK/out0" || true; }

timed_out_ranks() {  # the ranks that ran past the rank timeout (killed by timeout: 124 or 137)
  local r out=()
  for r in "${!rc_of[@]}"; do [[ ${rc_of[r]} == 124 || ${rc_of[r]} == 137 ]] && out+=("$r"); done
  echo "${out[*]}"
}

judge() {  # judge SCENARIO BUILDER: the summary line, then the verdict
  local s=$1 b=$2 done_n mis hung fail stuck
  done_n=$(count completed); mis=$(count miswired); hung=$(count hung); fail=$(count failed)
  stuck=$(timed_out_ranks)
  echo "  $b: $done_n completed, $mis miswired, $hung hung, $fail failed"
  grep -v ': completed' "$WORK/out0" | head -1 | cut -c1-300
  [[ " $CLEAN " == *" $b "* ]] || return 0  # not required to work (legacy: the bug itself)
  [ -z "$stuck" ] || { verdict_fail "$s/$b: rank(s) $stuck still running after ${RANK_TIMEOUT}s (hung), killed"; return; }
  [ "$mis" = 0 ] || verdict_fail "$s/$b: $mis of $T trials miswired"
  if [ "$s" = 4sock ] && [ "$b" = tagged ]; then
    # tagged's precondition is broken with several sockets per connection: it
    # may fail (saying so) but never miswire or hang for ever.
    return
  fi
  [ "$done_n" = "$T" ] || verdict_fail "$s/$b: $done_n of $T trials completed ($hung hung, $fail failed)"
}

scenario_socks() {  # scenario_socks SCENARIO: every builder over 1 or 4 sockets per connection
  local s=$1 b
  if [ "$s" = 4sock ]; then
    echo "FlagCX socket adaptor, $N ranks, $T trials per builder, 4 sockets per connection (FLAGCX_SOCKET_NTHREADS=2 FLAGCX_NSOCKS_PERTHREAD=2):"
  else
    echo "FlagCX socket adaptor, $N ranks, $T trials per builder, 1 socket per connection:"
  fi
  for b in $BUILDERS; do
    if [ "$s" = 4sock ]; then
      FLAGCX_SOCKET_NTHREADS=2 FLAGCX_NSOCKS_PERTHREAD=2 run "$N" "$b" "$T"
    else
      FLAGCX_SOCKET_NTHREADS=1 FLAGCX_NSOCKS_PERTHREAD=0 run "$N" "$b" "$T"
    fi
    judge "$s" "$b"
  done
}

scenario_die() {  # ordered, 4 ranks, rank 2 exits mid-build: every survivor fails by itself
  local r line stuck
  echo "ordered over FlagCX's bootstrap, 4 ranks, rank 2 exits after the listen-handle allgather (deadline 5 s):"
  FLAGCX_SOCKET_NTHREADS=1 FLAGCX_NSOCKS_PERTHREAD=0 run 4 ordered 1 2
  stuck=$(timed_out_ranks)
  for r in 0 1 3; do
    line=$(cut -c1-400 "$WORK/out$r")
    echo "  ${line:-rank $r: (no line; exit ${rc_of[r]})}"
    [[ " $stuck " == *" $r "* ]] && continue
    [[ $line == *": hung: "* || $line == *": failed: "* ]] || verdict_fail "die: survivor rank $r did not fail naming the build: ${line:-no output}"
  done
  [ -z "$stuck" ] || verdict_fail "die: survivor rank(s) $stuck still blocked after ${RANK_TIMEOUT}s (hung), killed"
  [ "${rc_of[2]}" = 86 ] || verdict_fail "die: rank 2 exited ${rc_of[2]}, not 86 (its planned exit)"
}

for s in $SCENARIOS; do
  case $s in
    1sock|4sock) scenario_socks "$s" ;;
    die) scenario_die ;;
    *) setup_error "unknown scenario '$s' in CHECK_SCENARIOS (1sock, 4sock, die)" ;;
  esac
done

if [ ${#failures[@]} -gt 0 ]; then
  echo "check.sh: FAILED (${#failures[@]}):"
  printf '  %s\n' "${failures[@]}"
  exit 1
fi
echo "check.sh: PASSED (clean builders: $CLEAN)"
