"""One rule for every timeout an agent call takes: None or 0 keep the call's default (the
agent's timeout; notifications(): return at once), a number > 0 is seconds, inf no limit; a
negative number or NaN raises InvalidArgument naming the call's timeout before anything starts
(h.wait(-1), h.wait(nan), notifications(-1), connect(timeout=-1) passed silently; wait(None) and
notifications(None) raised pybind11's TypeError)."""

import math

import pytest

from flagcx_mesh import Agent, InvalidArgument

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pair():
    with Agent("to-a", "s", timeout=10) as a, Agent("to-b", "s", timeout=10) as b:
        mine = a.register(bytearray(4096))
        theirs = b.register(bytearray(4096))
        yield a, b, a.connect(b.metadata()), mine, theirs


CALLS = {
    "wait": lambda a, b, c, m, t, to: c.write(m, t, 16).wait(to),
    "write_sync": lambda a, b, c, m, t, to: c.write_sync(m, t, 16, timeout=to),
    "read_sync": lambda a, b, c, m, t, to: c.read_sync(m, t, 16, timeout=to),
    "connect": lambda a, b, c, m, t, to: a.connect(b.metadata(), timeout=to),
    "connect_address": lambda a, b, c, m, t, to: a.connect(b.address, timeout=to),
    "notifications": lambda a, b, c, m, t, to: a.notifications(to),
    "stream_wait_notification": lambda a, b, c, m, t, to: a.stream_wait_notification(b"x", 0, timeout=to),
    "wait_notification": lambda a, b, c, m, t, to: a.wait_notification("to-b", timeout=to),
}


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, -math.inf], ids=["-1", "-0.5", "nan", "-inf"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_negative_or_nan_timeout_is_refused_naming_it(pair, call, bad):
    with pytest.raises(InvalidArgument, match="timeout must be a finite number of seconds > 0 .or inf"):
        CALLS[call](*pair, bad)


@pytest.mark.parametrize("good", [None, 0, 5, math.inf], ids=["None", "0", "5", "inf"])
@pytest.mark.parametrize("call", ["wait", "write_sync", "read_sync", "connect", "connect_address"])
def test_none_zero_seconds_and_inf_are_taken(pair, call, good):
    CALLS[call](*pair, good)


@pytest.mark.parametrize("good", [None, 0, 0.2], ids=["None", "0", "0.2"])
def test_notifications_take_none_zero_and_seconds(pair, good):
    assert pair[0].notifications(good) == []


def test_notifications_with_no_limit_return_what_arrives(pair):
    a, b = pair[0], pair[1]
    b.connect(a.metadata()).notify(b"here")
    assert [n.data for n in a.notifications(math.inf)] == [b"here"]


def test_the_agents_own_timeout_none_is_the_default_and_negative_is_refused():
    with Agent("to-c", "s", timeout=None) as c:
        assert c._core.timeout > 0
    with pytest.raises(InvalidArgument, match="timeout"):
        Agent("to-d", "s", timeout=-1)


def test_deregister_takes_the_same_rule(pair):
    a = pair[0]
    r = a.register(bytearray(64))
    with pytest.raises(InvalidArgument, match="deregister: timeout"):
        a.deregister(r, math.nan)
    a.deregister(r, None)
