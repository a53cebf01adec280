"""Running tests/gpu_prog.py scenarios as launcher jobs, on the fake driver or a real GPU."""

from __future__ import annotations

import os
import subprocess

import pytest

from meshutil import PY, subprocess_env

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "gpu_prog.py")


def job_env(base_extra, drop, **extra):
    """subprocess_env(base_extra) without the variables in `drop` (set by an outer run), then `extra`."""
    env = subprocess_env(base_extra)
    for k in drop:
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_job(n, scenario, *args, env, device, timeout, silent=(), prog=None):
    """Runs gpu_prog.py SCENARIO on n ranks (--device fake|torch); asserts exit 0 and an OK line
    from every rank not in `silent`; returns the CompletedProcess. `prog`: a sibling program
    of tests/ taking SCENARIO the same way (e.g. staged_traffic_prog.py) instead of gpu_prog.py."""
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", str(n), "--timeout", str(timeout), "--grace", "2",
           "--", PY, os.path.join(HERE, prog) if prog else PROG, scenario, "--device", device, *args]
    try:
        p = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario} x{n}: the job hung\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{scenario} x{n}: exit {p.returncode}\n{out[-8000:]}"
    for r in range(n):
        if r not in silent:
            assert f"OK rank {r} {scenario}" in p.stdout, f"rank {r} did not pass {scenario}\n{out[-8000:]}"
    return p
