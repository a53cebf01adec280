"""Shared pytest set-up: the suite tests the INSTALLED package."""

import resource

import pytest


def pytest_configure(config):
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
