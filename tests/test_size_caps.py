"""The documented caps (docs/agent.md, "Sizes"), tested at and just over the limit: a notification
holds at most 64 MiB (100 MiB was accepted), whole at the limit and refused with InvalidArgument
naming the limit one byte over it, before anything moves; a mesh message holds at most 4 GiB."""

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import Agent, InvalidArgument, Mesh
from flagcx_mesh.agent import MAX_NOTIFICATION_BYTES

pytestmark = pytest.mark.timeout(120)

LIMIT = 64 << 20


@pytest.fixture(scope="module")
def pair():
    with Agent("caps-a", "s", timeout=30) as a, Agent("caps-b", "s", timeout=30) as b:
        mine = a.register(bytearray(4096))
        theirs = b.register(bytearray(4096))
        yield a, b, a.connect(b.metadata()), mine, theirs


def _received(b):
    got = []
    while not got:
        got = b.notifications(30)
    return [n.data for n in got]


def test_the_cap_is_64_mib():
    assert MAX_NOTIFICATION_BYTES == LIMIT


@pytest.mark.parametrize("how", ["notify", "write"])
def test_a_notification_at_the_limit_arrives_whole(pair, how):
    a, b, conn, mine, theirs = pair
    data = np.full(LIMIT, 7, np.uint8)
    data[-1] = 9
    if how == "notify":
        conn.notify(data)
    else:
        conn.write(mine, theirs, 16, notification=data).wait(30)
    (got,) = _received(b)
    assert len(got) == LIMIT and got[0] == 7 and got[-1] == 9


CALLS = {
    "notify": lambda c, m, t, n: c.notify(n),
    "write": lambda c, m, t, n: c.write(m, t, 16, notification=n),
    "read": lambda c, m, t, n: c.read(m, t, 16, notification=n),
    "write_sync": lambda c, m, t, n: c.write_sync(m, t, 16, notification=n),
    "batch_write": lambda c, m, t, n: c.batch_write([(m, 0, t, 0, 16)], notification=n),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_one_byte_over_is_refused_before_anything_moves(pair, call):
    a, b, conn, mine, theirs = pair
    mine.view[:16] = b"x" * 16
    with pytest.raises(InvalidArgument, match=r"a notification of 67108865 bytes exceeds the limit of 67108864"):
        CALLS[call](conn, mine, theirs, bytearray(LIMIT + 1))
    assert b.notifications(0.2) == []
    assert bytes(theirs.view[:16]) == bytes(16)  # the write's bytes did not move either


def test_a_mesh_message_over_4_gib_is_refused_naming_the_limit():
    assert flagcx_mesh._core.MAX_MESSAGE_BYTES == 1 << 32
    over = np.zeros((1 << 32) + 1, np.uint8)  # calloc'd: no page is touched before the refusal
    with Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=20) as m:
        with pytest.raises(InvalidArgument, match=r"4294967297 bytes exceed the message limit of 4294967296"):
            m.send(0, over)
        m.send(0, b"after")
        assert m.recv(0, timeout=10) == b"after"
