"""The agent listener and handshake: a wrong secret, garbage, silent clients and
floods are closed and counted (bounded as the mesh listener bounds them), the
admission policy refuses with a reason the peer sees, connect has a deadline,
and an incarnation superseded by a restart under the same name is refused."""

import socket
import time

import pytest

from meshutil import wait_rejected

from flagcx_mesh import InvalidArgument, MeshTimeout, PeerLost, ProtocolError
from flagcx_mesh.agent import Agent

pytestmark = pytest.mark.timeout(120)
SECRET = "listener-secret"


def host_port(agent):
    host, port = agent.address.rsplit(":", 1)
    return host.strip("[]"), int(port)




def test_wrong_secret_is_refused_both_ways():
    with Agent("b", SECRET) as b, Agent("a", "another secret") as a:
        with pytest.raises(ProtocolError, match="does not prove the secret"):
            a.connect(b.metadata(), timeout=10)
        assert wait_rejected(b, "bad authentication") >= 1, b.stats()
        assert b.peers() == [] and a.peers() == []


def test_garbage_silent_and_mesh_headers_are_counted():
    with Agent("b", SECRET, header_timeout=0.5) as b:
        garbage = socket.create_connection(host_port(b))
        garbage.sendall(b"GET / HTTP/1.0\r\n" * 8)
        silent = socket.create_connection(host_port(b))
        assert wait_rejected(b, "bad magic") == 1
        assert wait_rejected(b, "silent (no header before deadline)") == 1
        garbage.close()
        silent.close()
        with Agent("a", SECRET) as a:  # the listener still admits a real peer
            conn = a.connect(b.metadata(), timeout=10)
            assert conn.peer_name == "b"


def test_flood_of_idle_connections_is_bounded():
    with Agent("b", SECRET, header_timeout=30) as b:
        idle = [socket.create_connection(host_port(b)) for _ in range(300)]
        assert wait_rejected(b, "too many pending connections", at_least=300 - 256) >= 300 - 256
        with Agent("a", SECRET) as a:
            assert a.connect(b.metadata(), timeout=10).peer_name == "b"
        for s in idle:
            s.close()


def test_admission_policy_refusal_reaches_the_peer():
    with Agent("b", SECRET, allow=["decode-1"]) as b, Agent("a", SECRET) as a, Agent("decode-1", SECRET) as d:
        with pytest.raises(InvalidArgument, match="refused this agent: agent a is not in this agent's allow list"):
            a.connect(b.metadata(), timeout=10)
        assert wait_rejected(b, "refused by the agent's policy") == 1
        assert d.connect(b.metadata(), timeout=10).peer_name == "b"
        assert [p[0] for p in b.peers()] == ["decode-1"]


def test_connect_has_a_deadline():
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel completes the TCP handshake; nobody ever answers
    with Agent("a", SECRET) as a:
        with pytest.raises(MeshTimeout, match="reading the answer"):
            a.connect(f"127.0.0.1:{mute.getsockname()[1]}", timeout=0.5)
    port = mute.getsockname()[1]
    mute.close()
    with Agent("a", SECRET) as a:
        with pytest.raises(PeerLost):
            a.connect(f"127.0.0.1:{port}", timeout=5)
        with pytest.raises(InvalidArgument):
            a.connect(b"not metadata")
        with pytest.raises(InvalidArgument, match="host:port"):
            a.connect("nonsense")


def test_connect_by_address_learns_the_peer():
    with Agent("b", SECRET) as b, Agent("a", SECRET) as a:
        conn = a.connect(b.address, timeout=10)
        assert conn.peer_name == "b" and conn.peer_incarnation == b.incarnation
        assert a.connect(b.metadata()) is not None  # reuses that connection's incarnation
        assert [p[0] for p in a.peers()] == ["b"]


def test_superseded_incarnation_is_refused():
    """The old incarnation of decode hangs (a connector that proved the secret and answers
    nothing more): a new decode is admitted once the old one stops answering, the old one's
    connection is closed, and the old incarnation is refused from then on."""
    import os

    import agent_handshake as hs

    with Agent("b", SECRET) as b:
        inc = os.urandom(16)
        old, verdict, _ = hs.dial(b.address, SECRET, hs.ident("decode"), incarnation=inc)
        assert verdict == ""
        with Agent("decode", SECRET) as new:  # the same name again: a restart
            new.connect(b.metadata(), timeout=10)
            peers = b.peers()
            assert [(p[0], p[1]) for p in peers] == [("decode", new.incarnation)]
            old.settimeout(20)  # b closed old's connection: its goodbye, then the end
            while old.recv(4096):
                pass
            _, verdict, _ = hs.dial(b.address, SECRET, hs.ident("decode"), incarnation=inc)
            assert "superseded" in verdict, verdict
            assert wait_rejected(b, "stale incarnation") == 1
        old.close()


def test_a_connection_keeps_its_agent_alive():
    import gc

    with Agent("b", SECRET) as b:
        conn = Agent("short-lived", SECRET).connect(b.metadata(), timeout=10)  # no reference to the agent kept
        gc.collect()
        assert conn.gone() == ""
        conn.notify(b"still here")
        assert [n.data for n in b.notifications(timeout=10)] == [b"still here"]


def free_ports(n: int):
    """n consecutive ports nothing listens on now (first of n)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            held = []
            for p in range(first, first + n):
                t = socket.socket()
                held.append(t)
                t.bind(("", p))
            return first
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    pytest.skip("no consecutive free ports")


def test_agents_listen_in_the_port_range_and_say_when_it_is_full(monkeypatch):
    first = free_ports(2)
    monkeypatch.setenv("FLAGCX_MESH_AGENT_PORTS", f"{first}-{first + 1}")
    with Agent("a", SECRET) as a, Agent("b", SECRET) as b:
        assert {host_port(a)[1], host_port(b)[1]} == {first, first + 1}
        with pytest.raises(Exception, match=f"FLAGCX_MESH_AGENT_PORTS={first}-{first + 1}"):
            Agent("c", SECRET)
        a.connect(b.metadata(), timeout=10).notify(b"over the range")  # they still serve


@pytest.mark.parametrize("bad", ["0", "x", "70000", "9-8", "10-", "5-x"])
def test_a_malformed_port_range_is_refused_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv("FLAGCX_MESH_AGENT_PORTS", bad)
    with pytest.raises(InvalidArgument, match="FLAGCX_MESH_AGENT_PORTS"):
        Agent("a", SECRET)
