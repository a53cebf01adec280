"""Stream waits on notifications on the fake CUDA driver (no GPU needed): each scenario of
tests/agent_stream_wait_prog.py in its own process (a copy queued behind the wait shows when
the stream went on): released by its notification and not before, by one that arrived unread,
only by the named peer's, at its timeout (MeshTimeout), when the peer is killed (PeerLost
naming it) and when the agent closes (MeshClosed); the driver without stream memory operations
waits on the host. The same scenarios run on a real GPU from scripts/test-gpu.sh."""

from __future__ import annotations

import os

import pytest

import fakecuda
import gpujobs
from meshutil import finish_prog, spawn_prog

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_stream_wait_prog.py")


def run(tmp_path, scenario, **extra):
    env = gpujobs.job_env(fakecuda.env(granularity=64 << 10),
                          ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FXM_FAKECUDA_FAIL"), **extra)
    p = spawn_prog(PROG, scenario, tmp_path, "--timeout", 20, env=env, cwd=HERE)
    out, err = finish_prog(p, timeout=90, what=scenario, ok=f"{scenario} ok")
    return out + err


@pytest.mark.parametrize("scenario", ["arrives", "unread", "peer", "timeout", "killed", "closed"])
def test_a_stream_wait_on_a_notification(tmp_path, scenario):
    out = run(tmp_path, scenario)
    if scenario == "timeout":
        assert "released after" in out and "did not arrive" in out, out
    if scenario == "killed":
        assert "doomed" in out and "gone before sending it" in out, out


def test_without_stream_memory_operations_the_wait_is_on_the_host(tmp_path):
    """cuStreamWaitValue64 unsupported: the call waits on the host (logged) until the
    notification came, and returns at its timeout with the error when none does."""
    out = run(tmp_path, "hostwait", FXM_FAKECUDA_NO_STREAM_MEMOPS=1)
    assert "wait on the host" in out, out
