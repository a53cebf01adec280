"""The agent's objects read as what they are: exported at the package's top level, and each
prints its agent, peer and state (handles and connections printed as <object at 0x...>, a
notification as a bare tuple)."""

import pytest

import flagcx_mesh
from flagcx_mesh import Agent, Handle, Notification, NotificationWait, Region

pytestmark = pytest.mark.timeout(60)


def test_top_level_exports():
    from flagcx_mesh import agent

    for name in ("Agent", "AgentConnection", "Region", "Handle", "Notification", "NotificationWait"):
        assert getattr(flagcx_mesh, name) is getattr(agent, name)
        assert name in flagcx_mesh.__all__


def test_every_object_prints_what_it_is():
    with Agent("surface-a", "s", timeout=10) as a, Agent("surface-b", "s", timeout=10) as b:
        assert repr(a) == f"Agent(name='surface-a', incarnation={a.incarnation}, address={a.address})"
        mine = a.register(bytearray(4096))
        theirs = b.register(bytearray(4096))
        assert isinstance(mine, Region) and "index=0, size=4096" in repr(mine)
        conn = a.connect(b.metadata())
        assert repr(conn) == f"AgentConnection(peer='surface-b', incarnation={conn.peer_incarnation})"
        h = conn.write(mine, theirs, 16, notification=b"hi")
        assert isinstance(h, Handle)
        h.wait(10)
        assert repr(h) == f"Handle({h.call}, done)" and "surface-b" in h.call, repr(h)
        got = b.notifications(10)
        assert got and isinstance(got[0], Notification)
        n = got[0]
        assert repr(n) == f"Notification(peer='surface-a', incarnation={n.incarnation!r}, data=b'hi')"
        assert tuple(n) == ("surface-a", n.incarnation, b"hi")  # still the tuple it was
    assert repr(a).endswith(", closed)")
    assert NotificationWait.__repr__ is not object.__repr__


def test_a_handle_says_its_ops_and_their_bytes():
    """Handle.ops and Handle.nbytes: what the call issued, for a write, a read, a batch and a
    table (what a caller counts without summing its table again)."""
    import numpy as np

    with Agent("surface-c", "s", timeout=10) as a, Agent("surface-d", "s", timeout=10) as b:
        mine, theirs = a.register(bytearray(1 << 16)), b.register(bytearray(1 << 16))
        conn = a.connect(b.metadata())
        table = np.array([[0, 0, 100], [512, 1024, 7], [4096, 8192, 4096]], dtype=np.int64)
        for h, ops, nbytes in ((conn.write(mine, theirs, 16), 1, 16), (conn.read(mine, theirs, 300), 1, 300),
                               (conn.batch_write([(mine, 0, theirs, 0, 5), (mine, 64, theirs, 64, 6)]), 2, 11),
                               (conn.read_blocks(mine, theirs, table), 3, 4203),
                               (conn.write_blocks(mine, theirs, table[:0]), 0, 0)):
            h.wait(10)
            assert (h.ops, h.nbytes) == (ops, nbytes), (h.call, h.ops, h.nbytes)
