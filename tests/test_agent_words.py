"""Agent errors in the agents' words: the exception of an agent op names the peer agent
(err.peer_name), a failed handle says its own ops and bytes (not the connection's count of
ops in flight), no text of an agent's error or of its engine's log names a rank, a context or a
mesh, a wrong secret is counted as bad authentication and metadata naming another incarnation
gives both in full."""

import os
import pickle
import signal
import time

import numpy as np
import pytest

from flagcx_mesh import InvalidArgument, MeshError, PeerLost
from flagcx_mesh.agent import Agent
from meshutil import spawn_prog, wait_file, wait_rejected

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_prog.py")
SECRET = "agent-test-secret"

pytestmark = pytest.mark.timeout(120)

MESH_WORDS = ("rank 0", "peer 0", "(ctx 0)", "closed its mesh", "wait_counter")




def assert_agent_words(text):
    for w in MESH_WORDS:
        assert w not in text, f"{w!r} in {text!r}"


def test_an_agent_op_error_carries_the_peer_agents_name():
    with Agent("b", SECRET) as b, Agent("a", SECRET) as a:
        remote = b.register(np.zeros(64, dtype=np.uint8))
        local = a.register(np.zeros(64, dtype=np.uint8))
        conn = a.connect(b.metadata(), timeout=10)
        with pytest.raises(InvalidArgument) as e:
            conn.write(local, remote, 65)  # beyond both regions
        assert e.value.peer_name == "b" and e.value.peer == -1, (e.value.peer_name, e.value)
        back = pickle.loads(pickle.dumps(e.value))
        assert back.peer_name == "b" and str(back) == str(e.value)
        with pytest.raises(InvalidArgument) as e:
            conn.batch_write([(local, 0, remote, 0, 8), (local, 0, remote, 60, 8)])
        assert e.value.peer_name == "b", e.value


def test_an_error_of_no_agent_names_none():
    assert MeshError("x").peer_name == ""
    with pytest.raises(InvalidArgument) as e:
        Agent("", SECRET)
    assert e.value.peer_name == ""


def test_a_failed_handle_says_its_own_ops_and_bytes_and_names_the_agent(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    target = spawn_prog(PROG, "serve", tmp_path, "frozen", 1, env=dict(os.environ, FLAGCX_MESH_TRANSPORT="tcp"))
    try:
        with Agent("decode", SECRET, timeout=30) as a:
            conn = a.connect(wait_file(tmp_path / "frozen.meta"))
            remote = wait_file(tmp_path / "frozen.user")
            local = a.register(np.ones(1 << 20, dtype=np.uint8))
            conn.write(local, remote, 4096).wait(20)
            target.send_signal(signal.SIGSTOP)  # it reads nothing more: 64 MiB cannot all be acknowledged
            handles = [conn.batch_write([(local, 0, remote, 0, 1 << 19), (local, 0, remote, 0, 1 << 19)])
                       for _ in range(64)]
            assert not handles[-1].done()
            target.send_signal(signal.SIGKILL)
            target.communicate(timeout=30)
            with pytest.raises(PeerLost) as e:
                handles[-1].wait(30)
            text = str(e.value)
            assert e.value.peer_name == "frozen", text
            assert "its 2 op(s) (1048576 bytes) did not complete" in text, text
            assert "agent frozen" in text, text
            assert_agent_words(text)
            # the engine's log line of the loss is said of the agents too (written by the thread
            # that saw the loss: the failed wait may come back first, so it is looked for a while)
            log, lost, until = "", [], time.monotonic() + 10
            while not lost and time.monotonic() < until:
                log += capfd.readouterr().err
                lost = [line for line in log.splitlines() if " lost" in line and "WARN" in line]
                time.sleep(0.05)
            assert lost, log
            for line in lost:
                assert "[rank" not in line and "peer 0" not in line, line
                assert "agent decode: connection to agent frozen" in line and "agent frozen lost" in line, line
    finally:
        if target.poll() is None:
            target.kill()
            target.communicate(timeout=30)




def test_a_wrong_secret_is_counted_as_bad_authentication():
    from flagcx_mesh import ProtocolError
    with Agent("b", SECRET) as b, Agent("a", "another secret") as a:
        with pytest.raises(ProtocolError, match="does not prove the secret"):
            a.connect(b.metadata(), timeout=10)
        assert wait_rejected(b, "bad authentication") == 1, b.stats()
        assert b.stats()["rejected"].get("truncated header", 0) == 0, b.stats()


def _fnv1a(data: bytes) -> int:
    h = 2166136261
    for byte in data:
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


@pytest.mark.parametrize("at", [0, 4, 20, -6, -1], ids=["magic", "name", "incarnation", "address", "checksum"])
def test_corrupt_metadata_says_so_naming_no_incarnation(at):
    """Metadata has a checksum: a changed byte reads as corrupt (a flipped incarnation byte was
    taken as "restarted, or corrupt": the words could not tell)."""
    with Agent("b", SECRET) as b, Agent("a", SECRET) as a:
        md = bytearray(b.metadata())
        md[at] ^= 0x01
        with pytest.raises(InvalidArgument, match="not agent metadata" if at == 0 else
                           r"agent metadata is corrupt: its checksum does not match its \d+ bytes"):
            a.connect(bytes(md), timeout=10)
        assert b.peers() == [] and a.peers() == []


def test_metadata_of_an_earlier_incarnation_says_restarted_with_both_in_full():
    with Agent("b", SECRET) as b, Agent("a", SECRET) as a:
        md = bytearray(b.metadata())
        at = md.find(bytes.fromhex(b.incarnation[:12]))
        assert at > 0, (b.incarnation, md)
        md[at + 15] ^= 0xFF  # another incarnation of b at its address: its first 12 digits the same
        md[-4:] = _fnv1a(bytes(md[:-4])).to_bytes(4, "little")
        with pytest.raises(InvalidArgument) as e:
            a.connect(bytes(md), timeout=10)
        text = str(e.value)
        assert "that agent restarted since the metadata was made" in text and "corrupt" not in text, text
        mine = md[at:at + 16].hex()
        assert mine in text, text
        assert bytes(md[at:at + 15]).hex() in text.replace(mine, ""), text  # the live one, in full too
        assert b.peers() == [] and a.peers() == []


def test_the_c_abi_gives_the_peer_agents_name_of_the_last_error():
    import ctypes

    import flagcx_mesh
    lib = ctypes.CDLL(flagcx_mesh.get_library())
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.flagcx_mesh_agent_create.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double]
    lib.flagcx_mesh_agent_connect.argtypes = [vp, ctypes.c_char_p, sz, ctypes.c_double, ctypes.POINTER(vp)]
    lib.flagcx_mesh_agent_path_to.argtypes = [vp, ctypes.c_char_p, sz, ctypes.c_char_p, sz, ctypes.c_char_p,
                                              ctypes.POINTER(sz)]
    lib.flagcx_mesh_agent_conn_release.argtypes = [vp]
    lib.flagcx_mesh_agent_destroy.argtypes = [vp]
    lib.flagcx_mesh_last_error.restype = ctypes.c_char_p
    lib.flagcx_mesh_last_error_peer_name.restype = ctypes.c_char_p
    with Agent("b", SECRET) as b, Agent("c", SECRET) as c:
        remote = bytes(b.register(np.zeros(64, dtype=np.uint8)))
        foreign = bytes(c.register(np.zeros(64, dtype=np.uint8)))  # no region of agent a
        a, conn = vp(), vp()
        assert lib.flagcx_mesh_agent_create(ctypes.byref(a), b"a", SECRET.encode(), 10.0) == 0
        try:
            md = b.metadata()
            assert lib.flagcx_mesh_agent_connect(a, md, len(md), 10.0, ctypes.byref(conn)) == 0
            assert lib.flagcx_mesh_last_error_peer_name() == b""
            buf, n = ctypes.create_string_buffer(64), sz(64)
            rc = lib.flagcx_mesh_agent_path_to(conn, remote, len(remote), foreign, len(foreign), buf, ctypes.byref(n))
            assert rc == 1, lib.flagcx_mesh_last_error()  # INVALID_ARGUMENT
            assert lib.flagcx_mesh_last_error_peer_name() == b"b", lib.flagcx_mesh_last_error()
            n = sz(64)
            assert lib.flagcx_mesh_agent_path_to(conn, remote, len(remote), None, 0, buf, ctypes.byref(n)) == 0
            assert lib.flagcx_mesh_last_error_peer_name() == b""  # cleared by the success
            lib.flagcx_mesh_agent_conn_release(conn)
        finally:
            lib.flagcx_mesh_agent_destroy(a)
