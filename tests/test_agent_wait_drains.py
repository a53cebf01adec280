"""Waits for notifications are woken by what they wait for (agent/doorbell.h), not paced by a
timer: agent.stats()["notification_drains"] counts the times a wait looked at the connections.
A wait that nothing wakes looks a few times a second (the safety net), where a polled wait
looked every 0.2 ms (thousands of times a second); a notification that arrives is seen by about
one look. Counts, not times: the waits' speed is shown by `bench notify` (docs/benchmarks.md)."""

import pytest

from flagcx_mesh import Agent, MeshTimeout

pytestmark = pytest.mark.timeout(60)

IDLE_LOOKS_PER_S = 30  # the safety net looks 10 times a second; a polled wait looked ~5000 times


def drains(agent) -> int:
    return agent.stats()["notification_drains"]


@pytest.fixture
def agents():
    with Agent("drains-a", "s", timeout=10) as a, Agent("drains-b", "s", timeout=10) as b:
        conn = b.connect(a.metadata())
        yield a, b, conn


def test_a_notifications_wait_with_nothing_arriving_does_not_poll(agents):
    a, _, _ = agents
    before = drains(a)
    assert a.notifications(1.0) == []
    assert drains(a) - before <= IDLE_LOOKS_PER_S


def test_a_wait_notification_with_nothing_arriving_does_not_poll(agents):
    a, _, _ = agents
    before = drains(a)
    with pytest.raises(MeshTimeout):
        a.wait_notification("drains-b", timeout=1.0)
    assert drains(a) - before <= IDLE_LOOKS_PER_S


def test_each_notification_waited_for_costs_a_few_looks(agents):
    a, _, conn = agents
    before = drains(a)
    for i in range(50):
        conn.notify(b"n%d" % i)
        assert a.wait_notification("drains-b", timeout=10).data == b"n%d" % i
    assert drains(a) - before <= 50 * 3 + IDLE_LOOKS_PER_S


def test_a_notification_wakes_a_long_wait_and_a_wake_returns_at_once(agents):
    """Returned by the arrival, not by the timeout (the test's own 60 s would end it first)."""
    import threading

    a, _, conn = agents
    box = []
    t = threading.Thread(target=lambda: box.append(a.wait_notification("drains-b", timeout=300)), daemon=True)
    t.start()
    conn.notify(b"late")
    t.join(30)
    assert not t.is_alive() and box[0].data == b"late"
    a.wake_notifications()
    assert a.notifications(300) == []  # the wake was waiting for it
