"""Arguments in the agent's one contract: bytes-likes wherever bytes are taken (notifications,
notify, stream waits), anything else refused with InvalidArgument naming the argument (a str
raised 'string argument without an encoding', a bytearray notification a TypeError); a batch's
bad op named as `op N` (a non-tuple op raised "'int' object is not iterable"; an out-of-range
op of a batch was not named)."""

import pytest

from flagcx_mesh import Agent, InvalidArgument

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    with Agent("types-a", "s", timeout=10) as a, Agent("types-b", "s", timeout=10) as b:
        mine = a.register(bytearray(1 << 16))
        theirs = b.register(bytearray(1 << 16))
        yield a, b, a.connect(b.metadata()), mine, theirs


@pytest.mark.parametrize("data", [bytearray(b"kv"), memoryview(b"kv"), b"kv"], ids=["bytearray", "memoryview", "bytes"])
def test_bytes_likes_are_taken_for_notifications(pair, data):
    a, b, conn, mine, theirs = pair
    conn.write(mine, theirs, 16, notification=data).wait(10)
    conn.notify(data)
    got = [n.data for n in b.notifications(10)]
    while len(got) < 2:
        got += [n.data for n in b.notifications(10)]
    assert got == [b"kv", b"kv"]


@pytest.mark.parametrize("call,name", [
    (lambda conn, m, t: conn.write(m, t, 16, notification="kv"), "notification"),
    (lambda conn, m, t: conn.batch_write([(m, 0, t, 0, 16)], notification=7), "notification"),
    (lambda conn, m, t: conn.notify("kv"), "data"),
    (lambda conn, m, t: conn.notify(None), "data"),
])
def test_anything_else_is_refused_naming_the_argument(pair, call, name):
    a, b, conn, mine, theirs = pair
    with pytest.raises(InvalidArgument, match=rf"^{name} must be bytes-like"):
        call(conn, mine, theirs)


@pytest.mark.parametrize("bad,why", [(5, "not int"), ("abcde", "not str"), (None, "not NoneType")])
def test_a_batch_op_that_is_no_tuple_is_named(pair, bad, why):
    a, b, conn, mine, theirs = pair
    with pytest.raises(InvalidArgument, match=rf"op 1: a transfer is \(local, local_offset, remote, remote_offset, "
                                              rf"size\), {why}"):
        conn.batch_write([(mine, 0, theirs, 0, 16), bad])


def test_an_out_of_range_op_of_a_batch_is_named(pair):
    a, b, conn, mine, theirs = pair
    ops = [(mine, 16 * i, theirs, 16 * i, 16) for i in range(60)]
    ops[57] = (mine, 0, theirs, (1 << 16) - 8, 16)
    with pytest.raises(InvalidArgument, match=r"write op 57 of 16 bytes at remote .*out of range"):
        conn.batch_write(ops)
    conn.write(mine, theirs, 16).wait(10)  # nothing was issued; the connection still works
