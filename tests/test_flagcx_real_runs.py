"""The runs of integrations/flagcx/build_real.sh (real/runs.sh), without a GPU: STAGES=run over a
work folder whose onesided_real is a stand-in script that passes flagcxCommInitRank only in the
environment a FlagCX configuration sets. The runs try the configurations in order, bound every
run, run the rest with the first that builds the mesh, and record which worked."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_REAL = os.path.join(ROOT, "integrations", "flagcx", "build_real.sh")

# Passes init with FLAGCX_HOSTID and FLAGCX_CLUSTER_SPLIT_LIST=NRANKS set (as FlagCX on one GPU
# does, per the sources); sleeps past any bound with NCCL_HOSTID set; logs where FlagCX would.
STAND_IN = r"""#!/bin/bash
r=$2; n=$3
echo "FLAGCX INFO debug=$FLAGCX_DEBUG hostid=${FLAGCX_HOSTID:-}" >"$FLAGCX_DEBUG_FILE"
echo "NCCL INFO debug=$NCCL_DEBUG" >"$NCCL_DEBUG_FILE"
[ -n "${NCCL_HOSTID:-}" ] && exec sleep 60
if [ -z "${FLAGCX_HOSTID:-}" ] || [ "${FLAGCX_CLUSTER_SPLIT_LIST:-}" != "$n" ]; then
  echo "FLAGCX WARN Duplicate GPU detected" >>"$FLAGCX_DEBUG_FILE"
  echo "rank $r: flagcxCommInitRank: flagcxInvalidUsage (5) in 1.0 ms: device 0 of 1"
  exit 1
fi
echo "rank $r: flagcxCommInitRank: ok (0) in 1.0 ms: device 0 of 1 as ${FLAGCX_HOSTID}"
if [ "$FXM_REAL_PROBE" = 1 ]; then
  echo "rank $r: flagcxOneSideRegister #0 (builds the mesh): ok (0) in 1.0 ms: 64 bytes of GPU memory"
else
  echo "rank $r: flagcxOneSideRegister #0 (builds the mesh): flagcxNotSupported (9) in 0.1 ms: x"
fi
"""


def work_folder(tmp_path):
    """A FlagCX tree and a work folder in which build, patch and installs count as done."""
    tree = tmp_path / "tree"
    (tree / "flagcx").mkdir(parents=True)
    (tree / "flagcx" / "flagcx.cc").write_text("")
    (tree / "third-party" / "json" / "single_include" / "nlohmann").mkdir(parents=True)
    (tree / "third-party" / "json" / "single_include" / "nlohmann" / "json.hpp").write_text("")
    work = tmp_path / "work"
    for d in ("nccl/lib", "site/flagcx_mesh/include", "site/flagcx_mesh/lib", "flagcx/flagcx/service"):
        (work / d).mkdir(parents=True)
    for f in ("nccl/lib/libnccl.so", "site/flagcx_mesh/include/flagcx_mesh_net.h",
              "site/flagcx_mesh/lib/libflagcx_mesh.so", "flagcx/flagcx/service/flagcx_mesh_glue.cc"):
        (work / f).write_text("")
    prog = work / "onesided_real"
    prog.write_text(STAND_IN)
    prog.chmod(0o755)
    return tree, work


def run_stage(tmp_path, **env_extra):
    tree, work = work_folder(tmp_path)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, STAGES="run", FXM_REAL_WORK=str(work), RANKS="2 4",
               FXM_REAL_TRY_BOUND="3")
    env.update(env_extra)
    p = subprocess.run(["bash", BUILD_REAL, str(tree), str(out)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return {f: (out / f).read_text() for f in os.listdir(out)}


@pytest.mark.timeout(150)
def test_the_first_configuration_that_builds_the_mesh_runs_the_rest(tmp_path):
    files = run_stage(tmp_path, FXM_REAL_VARIANTS="baseline split-only split-hostid split-hostid-notopo")
    s = files["summary.txt"]
    assert "variant baseline: flagcxCommInitRank ok on 0/2 ranks" in s
    assert "variant split-only: flagcxCommInitRank ok on 0/2 ranks" in s
    assert ("variant split-hostid: flagcxCommInitRank ok on 2/2 ranks, "
            "mesh-building flagcxOneSideRegister ok on 2/2") in s
    assert "variant chosen for the runs: split-hostid" in s
    for run in ("probe-4: 4 ranks", "probe-die-4: 4 ranks, rank 2 dies", "plain-2: 2 ranks", "plain-4: 4 ranks"):
        assert "== " + run in s, s
    # the variant after the chosen one is tried after the runs, for the record
    assert s.index("== plain-4") < s.index("variant split-hostid-notopo:")
    runs = files["runs.txt"]
    assert "rank 3: flagcxCommInitRank: ok (0) in 1.0 ms: device 0 of 1 as fxmhost3" in runs  # @R per rank
    assert "plain-4 (4 ranks; variant split-hostid: " in runs
    debug = files["debug.txt"]
    assert "FLAGCX WARN Duplicate GPU detected" in debug  # every rank's warnings are kept
    assert "FLAGCX INFO debug=INFO" in debug and "NCCL INFO debug=INFO" in debug  # logging was on
    assert len(files) <= 8


@pytest.mark.timeout(150)
def test_a_hanging_configuration_is_killed_at_its_bound(tmp_path):
    files = run_stage(tmp_path, FXM_REAL_VARIANTS="nccl-hostid split-hostid", RANKS="2")
    s = files["summary.txt"]
    assert "variant nccl-hostid: flagcxCommInitRank ok on 0/2 ranks" in s
    assert "rank 0: exit 124 (killed at the 3 s bound)" in files["runs.txt"]
    assert "variant chosen for the runs: split-hostid" in s


@pytest.mark.timeout(150)
def test_no_configuration_passing_is_said(tmp_path):
    s = run_stage(tmp_path, FXM_REAL_VARIANTS="baseline")["summary.txt"]
    assert "variants: none passed flagcxCommInitRank on 2 ranks" in s
    assert "== probe-4" not in s


# The perf stage's stand-ins: an mpiexec that starts its 2 ranks with PMI_RANK set, and FlagCX's
# test_one_side_register that skips (as it does without IB) only in the environment the runs'
# configuration sets per rank, and hangs with FLAGCX_VMM_ENABLE=0 (to show the bound).
FAKE_MPIEXEC = r"""#!/bin/bash
[ "$1" = -launcher ] && [ "$2" = fork ] && [ "$3" = -n ] || { echo "fake mpiexec: unexpected $*"; exit 9; }
n=$4; shift 4
for r in $(seq 0 $((n - 1))); do PMI_RANK=$r "$@" & done
wait
"""
FAKE_PERF = r"""#!/bin/bash
r=$PMI_RANK
echo "flagcx log of rank $r" >"$FLAGCX_DEBUG_FILE"
[ "${FLAGCX_VMM_ENABLE:-1}" = 0 ] && exec sleep 60
if [ "${FLAGCX_HOSTID:-}" != "fxmhost$r" ] || [ "${FLAGCX_CLUSTER_SPLIT_LIST:-}" != 2 ]; then
  echo "WARN Duplicate GPU detected" >>"$FLAGCX_DEBUG_FILE"
  echo "[rank $r] FATAL: flagcxCommInitRank (comm1) failed (err=3)"; exit 1
fi
[ "$r" = 0 ] && echo "[test] comm1=0x1  comm2=0x2 args $*"
[ "$r" = 0 ] && echo "[SKIP] flagcxCommWindowRegister returned NotSupported; set FLAGCX_USE_HETERO_COMM=1 and ensure IB net adaptor."
exit 0
"""


@pytest.mark.timeout(150)
def test_the_perf_stage_runs_flagcx_own_program_under_mpi_bounded(tmp_path):
    tree, work = work_folder(tmp_path)
    mpi = tmp_path / "mpi"
    for d in ("include", "lib", "bin"):
        (mpi / d).mkdir(parents=True)
    (mpi / "include" / "mpi.h").write_text("")
    (mpi / "lib" / "libmpi.so").write_text("")
    (mpi / "bin" / "mpiexec").write_text(FAKE_MPIEXEC)
    (work / "perf" / "bin").mkdir(parents=True)
    (work / "perf" / "bin" / "perf_one_side_register").write_text(FAKE_PERF)
    for f in (mpi / "bin" / "mpiexec", work / "perf" / "bin" / "perf_one_side_register"):
        f.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, STAGES="perf", FXM_REAL_WORK=str(work), FXM_MPI_HOME=str(mpi),
               FXM_PERF_BOUND="3")
    p = subprocess.run(["bash", BUILD_REAL, str(tree), str(out)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    s = (out / "summary.txt").read_text()
    assert "perf: perf_one_side_register as before" in s
    assert "== perf-vmm: exit 0" in s
    assert "[SKIP] flagcxCommWindowRegister returned NotSupported" in s  # ranks had @R expanded
    assert "== perf-cudamalloc: exit 124 (killed at the 3 s bound)" in s
    perf = (out / "perf.txt").read_text()
    assert "args -b 1K -e 4M -f 4 -w 2 -n 5 -R 2" in perf
    assert "rank 1 flagcx: " not in perf.split("==== perf-cudamalloc")[0]  # no warning on the good run
    assert "FLAGCX_VMM_ENABLE=0" in perf


@pytest.mark.timeout(60)
def test_the_perf_stage_without_mpi_says_so(tmp_path):
    tree, work = work_folder(tmp_path)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("FXM_MPI_HOME", "FXM_MPI_WHEEL")}
    env.update(PYTHON=sys.executable, STAGES="perf", FXM_REAL_WORK=str(work))
    p = subprocess.run(["bash", BUILD_REAL, str(tree), str(out)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "perf: skipped: no MPI (set FXM_MPI_HOME, or FXM_MPI_WHEEL to an mpich wheel)" in (out / "summary.txt").read_text()
