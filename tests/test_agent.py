"""Agents in separate processes: writes, batched writes, reads and
notifications over tcp, cma and shm (forced by FLAGCX_MESH_TRANSPORT), a
killed peer, a restart under the same name, and churn."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from flagcx_mesh import InvalidArgument, MeshTimeout, PeerLost
from flagcx_mesh.agent import Agent
from meshutil import finish_prog, spawn_prog, wait_file

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_prog.py")
SECRET = "agent-test-secret"

pytestmark = pytest.mark.timeout(180)


def spawn(*args, transport="auto", stdin=None):
    return spawn_prog(PROG, *args, env=dict(os.environ, FLAGCX_MESH_TRANSPORT=transport), stdin=stdin)


def finish(p, timeout=90):
    return finish_prog(p, timeout=timeout)[0]




@pytest.mark.parametrize("transport,user_path,shm_path", [
    ("tcp", "tcp", "tcp"), ("cma", "cma", "cma"), ("shm", "cma", "shm")])
def test_write_notify_read(tmp_path, transport, user_path, shm_path):
    server = spawn("serve", tmp_path, "prefill", 1, transport=transport)
    writer = spawn("write", tmp_path, "prefill", 7, transport=transport)
    out = finish(writer)
    assert f"user over {user_path}" in out and f"shm over {shm_path}" in out, out
    assert "served 2" in finish(server)


def test_killed_target_fails_handles_and_others_are_served(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    doomed = spawn("serve", tmp_path, "doomed", 100, transport="tcp")
    other = spawn("serve", tmp_path, "other", 1, transport="tcp")
    with Agent("decode", SECRET, timeout=20) as a:
        conn = a.connect(wait_file(tmp_path / "doomed.meta"))
        remote = wait_file(tmp_path / "doomed.user")
        buf = np.ones(1 << 20, dtype=np.uint8)
        local = a.register(buf)
        conn.write(local, remote, 4096).wait(20)
        doomed.send_signal(signal.SIGKILL)
        doomed.communicate(timeout=30)
        with pytest.raises(PeerLost, match="doomed"):
            for _ in range(1000):  # the loss is seen within the timeout, by the call or its handle
                conn.write(local, remote, 1 << 20).wait(20)
                time.sleep(0.01)
        # the agent still serves another peer
        conn2 = a.connect(wait_file(tmp_path / "other.meta"))
        remote2 = wait_file(tmp_path / "other.user")
        buf[:16] = 5
        conn2.write(local, remote2, 16, notification=b"check user 0 16 0").wait(20)
        conn2.notify(b"bye")
    assert "served 1" in finish(other)


def test_pending_handles_fail_with_peer_lost_when_the_target_dies(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    target = spawn("serve", tmp_path, "frozen", 1, transport="tcp")
    with Agent("decode", SECRET, timeout=30) as a:
        conn = a.connect(wait_file(tmp_path / "frozen.meta"))
        remote = wait_file(tmp_path / "frozen.user")
        local = a.register(np.ones(1 << 20, dtype=np.uint8))
        conn.write(local, remote, 4096).wait(20)
        target.send_signal(signal.SIGSTOP)  # it reads nothing more: 64 MiB cannot all be acknowledged
        handles = [conn.write(local, remote, 1 << 20) for _ in range(64)]
        assert not handles[-1].done()
        target.send_signal(signal.SIGKILL)
        target.communicate(timeout=30)
        with pytest.raises(PeerLost, match="frozen"):
            handles[-1].wait(30)
        assert handles[-1].done()


def test_killed_initiator_does_not_stop_the_server(tmp_path):
    server = spawn("serve", tmp_path, "prefill", 1, transport="tcp")
    holder = spawn("hold", tmp_path, "prefill", transport="tcp", stdin=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "connected"
    holder.kill()
    holder.communicate(timeout=30)
    writer = spawn("write", tmp_path, "prefill", 3, transport="tcp")
    assert "write ok" in finish(writer)
    assert "served 2" in finish(server)


def test_initiator_killed_mid_transfer_does_not_stop_the_server(tmp_path):
    server = spawn("serve", tmp_path, "prefill", 1, transport="tcp")
    spammer = spawn("spam", tmp_path, "prefill", transport="tcp")
    assert spammer.stdout.readline().strip() == "writing"
    spammer.send_signal(signal.SIGKILL)  # frames half sent, acks owed
    spammer.communicate(timeout=30)
    assert "write ok" in finish(spawn("write", tmp_path, "prefill", 5, transport="tcp"))
    assert "served 2" in finish(server)


def test_restart_under_the_same_name(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    (tmp_path / "a").mkdir()
    first = spawn("serve", tmp_path / "a", "prefill", 100, transport="tcp")
    with Agent("decode", SECRET, timeout=20) as a:
        old_meta = wait_file(tmp_path / "a" / "prefill.meta")
        old_desc = wait_file(tmp_path / "a" / "prefill.user")
        conn = a.connect(old_meta)
        buf = np.arange(4096, dtype=np.uint8)
        local = a.register(buf)
        conn.write(local, old_desc, 4096).wait(20)
        first.kill()
        first.communicate(timeout=30)
        (tmp_path / "b").mkdir()
        second = spawn("serve", tmp_path / "b", "prefill", 1, transport="tcp")
        conn2 = a.connect(wait_file(tmp_path / "b" / "prefill.meta"))
        assert conn2.peer_incarnation != conn.peer_incarnation
        with pytest.raises(InvalidArgument, match="restarted"):
            conn2.write(local, old_desc, 16)
        with pytest.raises(PeerLost):
            conn.write(local, old_desc, 16).wait(20)
        new_desc = wait_file(tmp_path / "b" / "prefill.user")
        buf[:16] = 0
        conn2.write(local, new_desc, 16, notification=b"check user 0 16 0").wait(20)
        conn2.notify(b"bye")
    assert "served 1" in finish(second)


def test_churn_one_server_many_writers(tmp_path):
    rounds, width = 3, 4
    server = spawn("serve", tmp_path, "prefill", rounds * width, transport="auto")
    for r in range(rounds):
        writers = [spawn("write", tmp_path, "prefill", 10 * r + i) for i in range(width)]
        for w in writers:
            assert "write ok" in finish(w)
    assert f"served {2 * rounds * width}" in finish(server)


def test_pd_kv_agent_example_serves_decodes_that_come_and_go():
    example = os.path.join(HERE, os.pardir, "examples", "pd_kv_agent.py")
    if not os.path.exists(example):
        pytest.skip("examples/ is not beside the tests")
    p = subprocess.run([sys.executable, example, "--decodes", "3", "--rounds", "2", "--layers", "4"],
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0 and "pd_kv_agent: OK" in p.stdout, p.stdout + p.stderr
    assert p.stdout.count("blocks ok") == 6


def test_a_live_peer_paused_for_a_moment_is_not_superseded(tmp_path, monkeypatch):
    """The old incarnation is stopped with a write to it in flight while another agent of its
    name connects; it goes on within the name probe's limit and answers: the newcomer is refused
    (a live agent is never superseded), and the write it acknowledges completes."""
    import threading

    from test_agent_churn import stop

    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    old = spawn("serve", tmp_path, "decode", 1, transport="tcp")
    try:
        with Agent("prefill", SECRET, timeout=20) as p:
            conn = p.connect(wait_file(tmp_path / "decode.meta"))
            local = p.register(np.ones(1 << 20, dtype=np.uint8))
            remote = wait_file(tmp_path / "decode.user")
            conn.write(local, remote, 4096).wait(20)
            stop(old)  # it acknowledges nothing until it goes on
            h = conn.write(local, remote, 4096)
            assert not h.done()
            threading.Timer(0.3, old.send_signal, (signal.SIGCONT,)).start()
            with Agent("decode", SECRET, timeout=20) as new:  # another agent of its name, meanwhile
                with pytest.raises(InvalidArgument, match="agent decode is alive"):
                    new.connect(p.metadata())
                h.wait(20)
                assert p.connection("decode").peer_incarnation == conn.peer_incarnation
                assert conn.gone() == ""
    finally:
        old.kill()
        old.communicate(timeout=30)
