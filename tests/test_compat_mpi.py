"""flagcx_mesh.compat under `mpiexec` of MPICH or Open MPI: comm_init_from_env bootstraps
through mpi4py; the PD example and tests/compat_prog.py must pass.

Skipped without a usable MPI (mpiexec and mpi4py, found as tests/test_bootstrap_mpi.py does),
unless FXM_REQUIRE_MPI=1, which turns the skip into a failure. Rank counts for compat_prog
come from FXM_MPI_RANKS (default "2 4 8"); the example always runs on 2.
"""
import os

import pytest

from bootstrap_helpers import HERE, PY, run
from test_bootstrap_mpi import usable_mpiexec

pytestmark = pytest.mark.timeout(240)
RANKS = [int(n) for n in os.environ.get("FXM_MPI_RANKS", "2 4 8").split()]
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "pd_kv_transfer.py")


@pytest.fixture(scope="module")
def mpi():
    return usable_mpiexec()


def test_pd_example_under_mpiexec(mpi):
    argv, what = mpi
    res = run(argv + ["-n", "2", PY, EXAMPLE, "--layers", "6", "--chunks", "8", "--chunk-bytes", "65536",
                      "--rounds", "2", "--timeout", "30"], 180)
    assert res.rc == 0 and not res.timed_out, res
    assert "decode: all 2 round(s) passed: checksums match" in res.out, res
    assert res.out.count("checksums match prefill's for all 6 layers") == 4, res
    launcher = "Open MPI" if what == "Open MPI" else "MPICH hydra (PMI)"
    assert f"launcher {launcher}" in res.out, res


@pytest.mark.parametrize("n", RANKS)
def test_compat_prog_under_mpiexec(mpi, n):
    argv, _ = mpi
    res = run(argv + ["-n", str(n), PY, os.path.join(HERE, "compat_prog.py"), "--timeout", "30"], 180)
    assert res.rc == 0 and not res.timed_out, res
    for r in range(n):
        assert f"OK rank {r} compat: {n} peers, 5 bad calls refused" in res.out, res
