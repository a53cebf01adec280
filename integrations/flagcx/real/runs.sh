# shellcheck shell=bash
# The runs of build_real.sh (sourced by it: WORK, OUTDIR, SUMMARY, DRY, RANKS, say, die there).
#
# Several FlagCX configurations ("variants") are tried first, each on 2 ranks with the probe;
# the first whose ranks all pass flagcxCommInitRank and the mesh-building flagcxOneSideRegister
# (else the first whose ranks all pass flagcxCommInitRank) then runs the rest: probe on 4 and 8
# ranks, the rank that dies mid-build, and plain (no probe) on RANKS.
#
# Why variants (FlagCX 0c721293 on one GPU, several ranks; see docs/flagcx-dropin.md): every
# rank sits on the same GPU, and both NCCL (the homo comm: its "Duplicate GPU detected" check
# gives ncclInvalidUsage, 5) and FlagCX's heteroComm (flagcx/core/init.cc: the same check,
# flagcxInternalError, 3) refuse two ranks with one host hash and one PCI bus id.
#   baseline             run 1's configuration: NCCL refuses (5)
#   split-only           FLAGCX_CLUSTER_SPLIT_LIST=N: one NCCL comm of 1 rank per rank, so NCCL
#                        is content, and FlagCX's heteroComm refuses (3)
#   split-hostid         + FLAGCX_HOSTID per rank: FlagCX's heteroComm sees one host per rank
#   nccl-hostid          NCCL_HOSTID and FLAGCX_HOSTID per rank instead of the split: NCCL sees
#                        N hosts of one GPU each (its Socket net between them)
#   *-notopo             + FLAGCX_TOPO_DETECTION_DISABLE=1 FLAGCX_USE_HOST_COMM=1: no topology
#                        detection (it needs a NIC path from the GPU); the host comm skips the
#                        NIC-distance step that reads the topology
# In a variant's environment @R is the rank and @N the number of ranks.
#
# Logging: FLAGCX_DEBUG=INFO (FLAGCX_DEBUG_SUBSYS FXM_REAL_FLAGCX_SUBSYS) and NCCL_DEBUG=INFO
# (NCCL_DEBUG_SUBSYS INIT,ENV,NET) into one file per rank, of which debug.txt keeps every rank's
# warnings and rank 0's last lines. Environment: FXM_REAL_VARIANTS (the list below),
# FXM_REAL_VARIANT (skip the tries, use this one), FXM_REAL_BUDGET (seconds for all runs, 330),
# FXM_REAL_TRY_BOUND / FXM_REAL_RUN_BOUND (seconds per try / per run, 45 / 60).

VARIANTS_DEFAULT="baseline split-only split-hostid nccl-hostid split-hostid-notopo nccl-hostid-notopo"

variant_env() {  # the environment of variant $1 (KEY=VALUE words, @R and @N expanded per rank)
  local base="FLAGCX_USE_HETERO_COMM=1" notopo="FLAGCX_TOPO_DETECTION_DISABLE=1 FLAGCX_USE_HOST_COMM=1"
  local split="FLAGCX_CLUSTER_SPLIT_LIST=@N" fhost="FLAGCX_HOSTID=fxmhost@R"
  local nhost="NCCL_HOSTID=fxmhost@R NCCL_NET=Socket NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
  case $1 in
    baseline) echo "$base" ;;
    split-only) echo "$base $split" ;;
    split-hostid) echo "$base $split $fhost" ;;
    nccl-hostid) echo "$base $nhost $fhost" ;;
    split-hostid-notopo) echo "$base $split $fhost $notopo" ;;
    nccl-hostid-notopo) echo "$base $nhost $fhost $notopo" ;;
    *) return 1 ;;
  esac
}

# shellcheck disable=SC2054  # commas inside the values
DEBUG_ENV=(FLAGCX_DEBUG=INFO "FLAGCX_DEBUG_SUBSYS=${FXM_REAL_FLAGCX_SUBSYS:-INIT,ENV,NET,REG,BOOTSTRAP}"
           NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,NET)
RUNS_T0=$SECONDS  # again at the start of runs()
BUDGET=${FXM_REAL_BUDGET:-330}
export FXM_REAL_STEP_TIMEOUT=${FXM_REAL_STEP_TIMEOUT:-30}

debug_excerpt() {  # NAME NRANKS: every rank's warnings, rank 0's last lines, into debug.txt
  local r
  { echo "==== $1 ($VARIANT: $VENV)"
    for r in $(seq 0 $(($2 - 1))); do
      grep -h -iE "warn|error|fail|duplicate|not found|no interface" "$WORK/f$r.log" "$WORK/n$r.log" 2>/dev/null \
        | head -12 | cut -c1-400 | sed "s/^/rank $r: /"
    done
    echo "-- rank 0, FlagCX, last lines:"; tail -n "${FXM_REAL_DEBUG_TAIL:-40}" "$WORK/f0.log" 2>/dev/null | cut -c1-300
    echo "-- rank 0, NCCL, last lines:"; tail -n 15 "$WORK/n0.log" 2>/dev/null | cut -c1-300
  } >>"$OUTDIR/debug.txt"
}

launch() {  # launch NAME NRANKS BOUND [DIE_RANK] (variant VARIANT, probe FXM_REAL_PROBE): runs.txt
  local name=$1 n=$2 bound=$3 die=${4:-} r pids=() rcs=() log=$WORK/run-$1.txt left env_r
  left=$((BUDGET - (SECONDS - RUNS_T0)))
  if [ $DRY = 1 ]; then
    echo "  (dry run) $n x onesided_real ${die:+(rank $die dies mid-build) }[$VARIANT, FXM_REAL_PROBE=${FXM_REAL_PROBE:-0}, ${bound} s] -> runs.txt ($name)"
    echo "  (dry run)   rank r's environment: $VENV"
    return 0
  fi
  [ "$left" -ge 15 ] || { say "== $name: skipped (run budget FXM_REAL_BUDGET=$BUDGET s spent)"; return 1; }
  [ "$bound" -le "$left" ] || bound=$left
  rm -f "$WORK/uid" "$WORK"/f*.log "$WORK"/n*.log
  for r in $(seq 0 $((n - 1))); do
    env_r=${VENV//@R/$r}
    read -ra env_r <<<"${env_r//@N/$n}"
    env "${env_r[@]}" "${DEBUG_ENV[@]}" FLAGCX_DEBUG_FILE="$WORK/f$r.log" NCCL_DEBUG_FILE="$WORK/n$r.log" \
      timeout -k 5 "$bound" "$WORK/onesided_real" "$WORK/uid" "$r" "$n" $die >"$WORK/o$r" 2>"$WORK/e$r" &
    pids[r]=$!
  done
  for r in $(seq 0 $((n - 1))); do wait "${pids[r]}"; rcs[r]=$?; done
  { for r in $(seq 0 $((n - 1))); do
      head -n 200 "$WORK/o$r"; echo "rank $r: exit ${rcs[r]}$([ "${rcs[r]}" = 124 ] && echo " (killed at the ${bound} s bound)")"
    done
    for r in $(seq 0 $((n - 1))); do sed "s/^/rank $r stderr: /" "$WORK/e$r" | tail -15; done; } >"$log"
  { echo "==== $name ($n ranks${die:+, rank $die dies mid-build}; variant $VARIANT: $VENV; FXM_REAL_PROBE=${FXM_REAL_PROBE:-0})"
    cat "$log"; } >>"$OUTDIR/runs.txt"
  debug_excerpt "$name" "$n"
  say "== $name: $n ranks${die:+, rank $die dies mid-build} [$VARIANT]; exits: ${rcs[*]}"
  if [ -n "$die" ]; then  # every survivor's registration (it must fail by the deadline)
    grep -E "OneSideRegister #0|dies|HUNG" "$log" | cut -c1-400 | tee -a "$SUMMARY"
  else
    grep -E "^rank 0: .*(CommInitRank|OneSideRegister|Put|Get|WaitCounter|never)|HUNG" "$log" | cut -c1-400 | tee -a "$SUMMARY"
  fi
  return 0
}

count_ok() {  # NAME STEP: how many ranks of run NAME printed "STEP...: ok"
  grep -cE "^rank [0-9]+: $2[^:]*: ok " "$WORK/run-$1.txt" 2>/dev/null
}

try_one() {  # try_one VARIANT: probe on 2 ranks; says how far its ranks got
  local inits meshes
  VARIANT=$1
  VENV=$(variant_env "$1") || die "unknown variant $1 (known: $VARIANTS_DEFAULT)"
  FXM_REAL_PROBE=1 launch "try-$1-2" 2 "${FXM_REAL_TRY_BOUND:-45}" || return 1
  [ $DRY = 1 ] && return 1
  inits=$(count_ok "try-$1-2" flagcxCommInitRank)
  meshes=$(count_ok "try-$1-2" "flagcxOneSideRegister #0")
  say "variant $1: flagcxCommInitRank ok on $inits/2 ranks, mesh-building flagcxOneSideRegister ok on $meshes/2"
  [ "$inits" = 2 ] && [ -z "$FIRST_INIT" ] && FIRST_INIT=$1
  [ "$meshes" = 2 ]
}

try_variants() {  # sets CHOSEN: the first variant that builds the mesh, else the first that inits;
  local v          # UNTRIED: the ones after it (tried after the runs, for the record)
  CHOSEN="" FIRST_INIT="" UNTRIED=""
  for v in ${FXM_REAL_VARIANTS:-$VARIANTS_DEFAULT}; do
    if [ -n "$CHOSEN" ]; then UNTRIED="$UNTRIED $v"; continue; fi
    try_one "$v" && CHOSEN=$v
  done
  [ -n "$CHOSEN" ] || CHOSEN=$FIRST_INIT
}

runs() {
  local n v
  RUNS_T0=$SECONDS
  : >"$OUTDIR/runs.txt"
  : >"$OUTDIR/debug.txt"
  if [ -n "${FXM_REAL_VARIANT:-}" ]; then
    CHOSEN=$FXM_REAL_VARIANT
  else
    try_variants
  fi
  [ $DRY = 1 ] && CHOSEN=${CHOSEN:-split-hostid}
  [ -n "$CHOSEN" ] || { say "variants: none passed flagcxCommInitRank on 2 ranks (debug.txt has FlagCX's and NCCL's logs)"; return 0; }
  VARIANT=$CHOSEN
  VENV=$(variant_env "$CHOSEN") || die "unknown variant $CHOSEN"
  say "variant chosen for the runs: $CHOSEN ($VENV)"
  for n in $RANKS; do
    [ "$n" = 2 ] && [ -z "${FXM_REAL_VARIANT:-}" ] && continue  # try-$CHOSEN-2 was probe-2
    FXM_REAL_PROBE=1 launch "probe-$n" "$n" "${FXM_REAL_RUN_BOUND:-60}"
  done
  FXM_REAL_PROBE=1 launch "probe-die-4" 4 "${FXM_REAL_RUN_BOUND:-60}" 2
  for n in $RANKS; do FXM_REAL_PROBE=0 launch "plain-$n" "$n" "${FXM_REAL_RUN_BOUND:-60}"; done
  for v in ${UNTRIED:-}; do try_one "$v"; done  # the variants after the chosen one, for the record
  say "runs: $((SECONDS - RUNS_T0)) s"
}
