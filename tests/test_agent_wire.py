"""The agent roles of the wire header: ext_len at offset 48, refused in a mesh
header; an agent listener refuses mesh headers, agent headers of a bad shape
and the reflection of its own answer."""

import socket
import struct
import time

import pytest

from flagcx_mesh import _core
from flagcx_mesh.agent import Agent

pytestmark = pytest.mark.timeout(60)
SECRET = "wire-secret"


def header(**over):
    h = dict(role=_core.ROLE_CONNECT, mesh_id=bytes(range(16)), epoch=7, src=2, dst=1, context=1,
             nranks=4, ncontexts=3)
    h.update(over)
    return h


def expect():
    return dict(role=_core.ROLE_CONNECT, mesh_id=bytes(range(16)), epoch=7, src=0, dst=1, context=0,
                nranks=4, ncontexts=3)


def wait_rejected(agent, reason, limit=20.0):
    end = time.monotonic() + limit
    while agent.stats()["rejected"].get(reason, 0) == 0 and time.monotonic() < end:
        time.sleep(0.02)
    return agent.stats()["rejected"].get(reason, 0)


def test_ext_len_sits_at_offset_48():
    assert (_core.ROLE_AGENT_CONNECT, _core.ROLE_AGENT_ACCEPT) == (3, 4)
    raw = _core._wire_encode(header(ext_len=0x0A0B0C0D))
    assert struct.unpack_from("<I", raw, 48)[0] == 0x0A0B0C0D
    assert raw[52:60] == bytes(8)  # still reserved
    assert _core._wire_check(_core._wire_encode(header()), expect())[0] == "accepted"


def test_a_mesh_header_with_ext_len_is_refused():
    assert _core._wire_check(_core._wire_encode(header(ext_len=1)), expect())[0] == "nranks/contexts mismatch"


def test_an_agent_header_at_a_mesh_rank_is_refused():
    raw = _core._wire_encode(header(role=_core.ROLE_AGENT_CONNECT, src=-1, dst=-1, nranks=0, ncontexts=1, epoch=0,
                                    ext_len=20))
    assert _core._wire_check(raw, expect())[0] == "bad role"


def agent_hello(**over):
    h = dict(role=_core.ROLE_AGENT_CONNECT, mesh_id=bytes(16), epoch=0, src=-1, dst=-1, context=0, nranks=0,
             ncontexts=1, ext_len=18)
    h.update(over)
    return _core._wire_encode(h) + bytes(32)


@pytest.mark.parametrize("raw,reason", [
    (lambda: _core._wire_encode(header()) + bytes(32), "bad role"),  # a mesh rank's hello
    (lambda: agent_hello(role=_core.ROLE_AGENT_ACCEPT), "bad role"),  # its own answer reflected
    (lambda: agent_hello(ext_len=100000), "nranks/contexts mismatch"),  # an identity block too long
    (lambda: agent_hello(nranks=4), "nranks/contexts mismatch"),
    (lambda: agent_hello() + bytes([0]) + bytes(17), "nranks/contexts mismatch"),  # an empty name
])
def test_agent_listener_refuses(raw, reason):
    with Agent("b", SECRET) as b:
        host, port = b.address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        s.sendall(raw())
        assert wait_rejected(b, reason) == 1, b.stats()
        s.close()
