"""deregister while a peer's put is landing (issue 34, item 4): the writer is stopped (SIGSTOP)
in the middle of a 64 MiB tcp put; the owner's deregister(timeout=1) must not return success
while bytes can still land. It raises (the region closed, the put cut off); once the writer
goes on, not one more byte reaches the buffer, and the writer's handle fails naming the region."""

import os
import signal
import time

import numpy as np
import pytest

import fakecuda
import gpujobs
from flagcx_mesh import MeshTimeout
from flagcx_mesh.agent import Agent
from meshutil import finish_prog, publish, spawn_prog, wait_stopped

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_dereg_prog.py")
SECRET = "agent-test-secret"
SIZE = 64 << 20
ATTEMPTS = 5  # a put that landed whole before the writer stopped is tried again

pytestmark = pytest.mark.timeout(240)


def stop_once_landing(writer, buf):
    """SIGSTOPs the writer as soon as the first byte of its put landed (busy: a put takes ms)."""
    end = time.monotonic() + 60
    while buf[0] == 0:
        assert writer.poll() is None, finish_prog(writer)
        assert time.monotonic() < end, "no byte of the put landed"
    writer.send_signal(signal.SIGSTOP)
    wait_stopped(writer.pid, "the writer", end - time.monotonic())
    time.sleep(0.3)  # what the kernel held of it lands; then nothing more comes


def half_landed_put(owner, tmp_path, env, how="put"):
    """(writer, buf, region) with the writer stopped in the middle of its put into region (how:
    "blocks", a batch of 64 KiB writes: over tcp one frame of blocks)."""
    for _ in range(ATTEMPTS):
        buf = np.zeros(SIZE, dtype=np.uint8)
        region = owner.register(buf)
        publish(str(tmp_path), "owner.region", region.descriptor)
        publish(str(tmp_path), "owner.meta", owner.metadata())
        writer = spawn_prog(PROG, "put", tmp_path, SIZE, *([how] if how != "put" else []), env=env)
        stop_once_landing(writer, buf)
        if buf[-1] == 0:
            return writer, buf, region
        writer.send_signal(signal.SIGCONT)  # it landed whole before the stop: again
        finish_prog(writer, timeout=60, ok="handle ok")
        region.deregister(timeout=10)
    pytest.fail(f"every one of {ATTEMPTS} puts landed whole before its writer stopped")


@pytest.mark.parametrize("lanes,how", [(1, "put"), (2, "put"), (1, "blocks")])
def test_deregister_during_a_landing_put_raises_and_nothing_lands_after(tmp_path, lanes, how):
    """how: one 64 MiB write, or a batch of 1024 writes of 64 KiB (one frame of blocks over tcp,
    each read of its blocks counted in its region's io as a put's is)."""
    env = dict(os.environ, FLAGCX_MESH_TRANSPORT="tcp", FLAGCX_MESH_TCP_LANES=str(lanes))
    os.environ["FLAGCX_MESH_TCP_LANES"] = str(lanes)
    try:
        owner = Agent("owner", SECRET, timeout=30)
    finally:
        del os.environ["FLAGCX_MESH_TCP_LANES"]
    writer = None
    try:
        writer, buf, region = half_landed_put(owner, tmp_path, env, how)
        t0 = time.monotonic()
        with pytest.raises(MeshTimeout, match=rf"region #{region.index} was closed.*landing"):
            region.deregister(timeout=1)
        assert time.monotonic() - t0 < 10
        before = buf.copy()
        writer.send_signal(signal.SIGCONT)
        out, _ = finish_prog(writer, timeout=60)
        assert "handle failed" in out and f"window #{region.index}" in out and "deregistered" in out, out
        time.sleep(0.2)
        assert np.array_equal(buf, before), f"{int((buf != before).sum())} bytes landed after deregister"
    finally:
        if writer is not None and writer.poll() is None:
            writer.send_signal(signal.SIGCONT)
            writer.kill()
            writer.communicate()
        owner.close()


def test_deregister_of_a_device_region_cuts_off_a_staged_put_landing_in_it(tmp_path):
    """The same over staged into device memory (the fake CUDA driver, each copy up slowed to
    20 ms a chunk, so the 64 MiB put takes over a second to land): deregister(timeout=0.2)
    raises once the put began landing, not one byte reaches the device memory after it, and the
    writer's handle fails naming the region."""
    env = gpujobs.job_env(fakecuda.env(), ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FLAGCX_MESH_TCP_LANES"),
                          FLAGCX_MESH_TRANSPORT="tcp", FLAGCX_MESH_CUDA_PATH="staged",
                          FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS=20)
    owner = spawn_prog(PROG, "dev-owner", tmp_path, SIZE, env=env, cwd=HERE)
    writer = spawn_prog(PROG, "put", tmp_path, SIZE, env=env, cwd=HERE)
    try:
        out, _ = finish_prog(writer, timeout=120)
        assert "handle failed" in out and "window #0" in out and "deregistered" in out, out
        publish(str(tmp_path), "writer.done", b"")
        got, _ = finish_prog(owner, timeout=120, ok="dev-owner ok")
        assert "raised: " in got and "region #0 was closed" in got, got
        assert "unchanged" in got, got  # read once deregister returned: no copy may run then (TSan)
    finally:
        for p in (owner, writer):
            if p.poll() is None:
                p.kill()
                p.communicate()
