"""Shared pytest set-up: the suite tests the INSTALLED package.

Tiers the test command runs apart (scripts/test.sh; docs/testing.md, "Parallel runs"):
``serial`` files watch state every process of the machine shares (/dev/shm names, thousands of
descriptors, network namespaces) and run alone after the parallel run;
``slow`` tests take minutes each (``-m "not slow"`` leaves them out of a quick local run; CI runs
them all the same).
"""

import os
import resource

import pytest

SERIAL_FILES = {
    "test_shm_names.py",       # counts every fxm- name in /dev/shm
    "test_auth.py",            # a flood of thousands of connections
    "test_netns.py",           # network namespaces and veth pairs of the host
    "test_netns_faults.py",    # the same, with nft rules
    "test_soak.py",            # many meshes at once, long
    "test_onesided_races.py",  # crash races and a PID namespace
    "test_agent_churn.py",     # 8 decode processes in churn for 10 s (FLAGCX_MESH_AGENT_CHURN_S)
    "test_ucx_netns.py",       # network namespaces and veth pairs of the host (the ucx path)
}
SLOW_FILES = {"test_soak.py", "test_netns_faults.py"}
# Of the serial files, those that watch or change what the MPI and vLLM stages of
# scripts/test.sh use too (every fxm- name in /dev/shm; links and namespaces of the host's
# network) run alone; the test command runs the other serial files beside those stages, whose
# programs touch nothing the others watch (their own descriptors, threads and children).
ALONE_FILES = {"test_shm_names.py", "test_netns.py", "test_netns_faults.py", "test_ucx_netns.py"}
assert ALONE_FILES <= SERIAL_FILES


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: run after the parallel run, apart from it (SERIAL_FILES)")
    config.addinivalue_line("markers", "slow: minutes per test; CI runs them (SLOW_FILES)")
    config.addinivalue_line("markers", "alone: a serial file run with no other stage beside it (ALONE_FILES)")
    # Ranks-as-threads tests open 2 * nranks * contexts sockets per rank.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        import flagcx_mesh._core  # noqa: F401
    except ImportError as e:  # pragma: no cover - set-up error, not a test failure
        raise pytest.UsageError(
            f"flagcx_mesh is not installed with its compiled core ({e}); "
            "run the suite with: bash scripts/test.sh") from e
    _check_expected_package()


def _check_expected_package():
    """FXM_EXPECT_PKG_DIR (the vLLM stage of scripts/test.sh: this run's wheel in build/vllm-site):
    a flagcx_mesh imported from anywhere else, a stale install in the shared venv, fails the run."""
    want = os.environ.get("FXM_EXPECT_PKG_DIR")
    if not want:
        return
    import flagcx_mesh

    got = os.path.realpath(os.path.dirname(flagcx_mesh.__file__))
    if not got.startswith(os.path.realpath(want) + os.sep):
        raise pytest.UsageError(f"flagcx_mesh was imported from {got}, not from FXM_EXPECT_PKG_DIR={want}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = os.path.basename(str(item.fspath))
        if name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
        if name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if name in ALONE_FILES:
            item.add_marker(pytest.mark.alone)
