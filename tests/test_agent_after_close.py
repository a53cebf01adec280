"""After close() every call of an agent, and of its connections and regions, raises MeshClosed
naming the call (it raised PeerLost 'this agent was closed', returned [] at once from
notifications(), answered metadata(), and said a region 'was deregistered'); its accessors
(name, incarnation, address, stats, peers, closed) still answer, and close() again is a no-op."""

import pytest

from flagcx_mesh import Agent, MeshClosed

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def closed_pair():
    a = Agent("after-close-a", "s", timeout=10)
    b = Agent("after-close-b", "s", timeout=10)
    mine = a.register(bytearray(4096))
    theirs = b.register(bytearray(4096))
    conn = a.connect(b.metadata())
    conn.write(mine, theirs, 16).wait(10)
    md = b.metadata()
    a.close()
    yield a, conn, mine, theirs, md
    b.close()


CALLS = {
    "metadata": lambda a, c, m, t, md: a.metadata(),
    "notifications": lambda a, c, m, t, md: a.notifications(0.5),
    "connect": lambda a, c, m, t, md: a.connect(md, timeout=2),
    "register": lambda a, c, m, t, md: a.register(bytearray(64)),
    "alloc": lambda a, c, m, t, md: a.alloc(4096),
    "deregister": lambda a, c, m, t, md: a.deregister(m),
    "write": lambda a, c, m, t, md: c.write(m, t, 16),
    "read": lambda a, c, m, t, md: c.read(m, t, 16),
    "write_sync": lambda a, c, m, t, md: c.write_sync(m, t, 16),
    "batch_write": lambda a, c, m, t, md: c.batch_write([(m, 0, t, 0, 16)]),
    "notify": lambda a, c, m, t, md: c.notify(b"x"),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_call_after_close_raises_closed_naming_it(closed_pair, call):
    a, conn, mine, theirs, md = closed_pair
    with pytest.raises(MeshClosed) as e:
        CALLS[call](a, conn, mine, theirs, md)
    assert "closed" in str(e.value) and "agent after-close-a" in str(e.value), str(e.value)


def test_notifications_after_close_raise_at_once(closed_pair):
    import time

    a = closed_pair[0]
    t0 = time.monotonic()
    with pytest.raises(MeshClosed):
        a.notifications(5)
    assert time.monotonic() - t0 < 1


def test_accessors_still_answer_and_close_again_is_a_no_op(closed_pair):
    a = closed_pair[0]
    assert a.closed and a.name == "after-close-a" and a.incarnation and a.address
    assert isinstance(a.stats(), dict) and a.peers() == []
    a.close()
