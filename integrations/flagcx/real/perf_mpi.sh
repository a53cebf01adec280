# shellcheck shell=bash
# The "perf" stage of build_real.sh (sourced by it: WORK, OUTDIR, CUDA, DRY, say, die, variant_env
# there): FlagCX's own one-sided program, test/perf/host_api/test_one_side_register.cpp, built by
# FlagCX's test Makefile against the patched libflagcx and run under MPI on 2 ranks (it takes
# exactly 2), once per FlagCX memory setting:
#   vmm      FlagCX's default: flagcxMemAlloc of a heteroComm job takes cuMem (VMM) memory
#   cudamalloc  FLAGCX_VMM_ENABLE=0: flagcxMemAlloc is cudaMalloc
# Each run uses the FlagCX configuration the runs chose (CHOSEN), else split-hostid, with @R the
# rank MPI gives (PMI_RANK). What one host without an IB NIC allows is the program's own
# "[SKIP] flagcxCommWindowRegister returned NotSupported" (only IB's adaptor has iput).
#
# MPI: FXM_MPI_HOME (a folder with include/mpi.h, lib/libmpi.so and bin/mpiexec), else
# FXM_MPI_WHEEL (an mpich wheel from PyPI, e.g. mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl,
# 13 MB: unpacked into $WORK/mpich). Neither: the stage says so and is skipped.
# Environment: FXM_PERF_ARGS (the program's arguments, default "-b 1K -e 4M -f 4 -w 2 -n 5 -R 2";
# its own default of -e 1G -n 20 allocates 20 GiB per buffer), FXM_PERF_BOUND (seconds a run, 90),
# FXM_PERF_MEMS ("vmm cudamalloc").

PERF_PROG=perf_one_side_register

find_mpi() {  # sets MPI: a folder with include/mpi.h, lib/libmpi.so, bin/mpiexec
  MPI=${FXM_MPI_HOME:-}
  if [ -z "$MPI" ] && [ -n "${FXM_MPI_WHEEL:-}" ]; then
    MPI=$(ls -d "$WORK"/mpich/mpich-*.data/data 2>/dev/null | head -1)
    if [ -z "$MPI" ]; then
      [ -f "$FXM_MPI_WHEEL" ] || { say "perf: FXM_MPI_WHEEL=$FXM_MPI_WHEEL is not a file"; return 1; }
      mkdir -p "$WORK/mpich" && "${PY:-python3}" -m zipfile -e "$FXM_MPI_WHEEL" "$WORK/mpich" || { say "perf: cannot unpack $FXM_MPI_WHEEL"; return 1; }
      MPI=$(ls -d "$WORK"/mpich/mpich-*.data/data 2>/dev/null | head -1)
    fi
  fi
  [ -n "$MPI" ] || { say "perf: skipped: no MPI (set FXM_MPI_HOME, or FXM_MPI_WHEEL to an mpich wheel)"; return 1; }
  chmod +x "$MPI"/bin/* 2>/dev/null  # a wheel unpacked by Python's zipfile keeps no modes
  [ -f "$MPI/include/mpi.h" ] && [ -e "$MPI/lib/libmpi.so" ] && [ -x "$MPI/bin/mpiexec" ] \
    || { say "perf: skipped: $MPI lacks include/mpi.h, lib/libmpi.so or bin/mpiexec"; return 1; }
  say "perf: MPI from $MPI ($("$MPI/bin/mpichversion" 2>/dev/null | head -1 | tr -s ' ' || echo 'version unknown'))"
}

build_perf() {  # FlagCX's test Makefile, for the one program
  local t0=$SECONDS bin=$WORK/perf/bin/$PERF_PROG
  local args=(-C "$WORK/flagcx/test/perf/host_api" USE_NVIDIA=1 DEVICE_HOME="$CUDA" CCL_HOME="$WORK/nccl"
              MPI_HOME="$MPI" BUILDDIR="$WORK/perf" "$bin")
  if [ $DRY = 1 ]; then echo "  (dry run) make ${args[*]}"; return 0; fi
  [ -x "$bin" ] && { say "perf: $PERF_PROG as before"; return 0; }
  make "${args[@]}" >"$OUTDIR/perf-make.log" 2>&1 || { tail -30 "$OUTDIR/perf-make.log"; say "perf: FAILED: make $PERF_PROG (perf-make.log)"; return 1; }
  say "perf: $PERF_PROG built in $((SECONDS - t0)) s by FlagCX's test/perf/host_api Makefile"
}

perf_wrapper() {  # the per-rank wrapper: the configuration's environment, @R = PMI_RANK, logs per rank
  local venv=${1//@N/2} w=$WORK/perf-rank.sh word
  { echo '#!/bin/sh'
    echo 'r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}'
    for word in $venv; do echo "export ${word//@R/\$r}"; done
    echo "export FLAGCX_DEBUG=INFO FLAGCX_DEBUG_SUBSYS=INIT,ENV,NET,REG FLAGCX_DEBUG_FILE=$WORK/pf\$r.log"
    echo 'exec "$@"'; } >"$w"
  chmod +x "$w"
  echo "$w"
}

perf_one() {  # MEM: one 2-rank run, bounded; its lines into perf.txt, the outcome into summary.txt
  local mem=$1 bound=${FXM_PERF_BOUND:-90} extra=() w rc log=$WORK/perf-$1.txt
  local -a pargs
  read -ra pargs <<<"${FXM_PERF_ARGS:--b 1K -e 4M -f 4 -w 2 -n 5 -R 2}"
  case $mem in
    vmm) ;;
    cudamalloc) extra=(FLAGCX_VMM_ENABLE=0) ;;
    *) say "perf: unknown memory setting $mem (vmm, cudamalloc)"; return 1 ;;
  esac
  w=$(perf_wrapper "$VENV")
  if [ $DRY = 1 ]; then
    echo "  (dry run) timeout $bound mpiexec -launcher fork -n 2 env ${extra[*]} $w $WORK/perf/bin/$PERF_PROG ${pargs[*]} ($mem)"
    return 0
  fi
  rm -f "$WORK"/pf*.log
  env "${extra[@]}" PATH="$MPI/bin:$PATH" LD_LIBRARY_PATH="$MPI/lib:$CUDA/lib64:${LD_LIBRARY_PATH:-}" \
    timeout -k 5 "$bound" "$MPI/bin/mpiexec" -launcher fork -n 2 "$w" "$WORK/perf/bin/$PERF_PROG" "${pargs[@]}" \
    >"$log" 2>&1
  rc=$?
  { echo "==== perf-$mem (2 ranks; ${extra[*]:-the default memory of FlagCX}; variant $VARIANT: $VENV; args ${pargs[*]})"
    head -n 200 "$log"
    echo "exit $rc$([ $rc = 124 ] && echo " (killed at the $bound s bound)")"
    for r in 0 1; do
      grep -h -iE "warn|error|fail|gdrMemAlloc" "$WORK/pf$r.log" 2>/dev/null | head -12 | cut -c1-400 | sed "s/^/rank $r flagcx: /"
    done; } >>"$OUTDIR/perf.txt"
  say "== perf-$mem: exit $rc$([ $rc = 124 ] && echo " (killed at the $bound s bound)")"
  grep -E "SKIP|FATAL|FAILED|succeeded|GB/s|requires|\[test\]" "$log" | head -12 | cut -c1-300 | tee -a "$SUMMARY"
  return 0
}

perf_stage() {
  local mem
  find_mpi || return 0
  build_perf || return 0
  VARIANT=${CHOSEN:-split-hostid}
  VENV=$(variant_env "$VARIANT") || die "unknown variant $VARIANT"
  : >"$OUTDIR/perf.txt"
  for mem in ${FXM_PERF_MEMS:-vmm cudamalloc}; do perf_one "$mem"; done
}
