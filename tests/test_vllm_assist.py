"""poll()'s part of the transfer thread's step (flagcx_mesh.vllm.transfer, module docstring): while
the thread waits for the interpreter lock (a busy engine thread keeps taking it back), the
engine's own poll() runs the queued holds and handles what arrived, so a decode's first request
(its layout, then a ``W``) is pushed and the acknowledged blocks are released in the engine's
steps; the other commands (a connect may wait on the network) stay the thread's. One process,
KVTransfer agents over cma (host memory), torch CPU tensors.

Skipped without torch, unless FXM_REQUIRE_TORCH=1 (scripts/test.sh sets it)."""

import contextlib
import os
import sys
import threading
import time

import pytest

if os.environ.get("FXM_REQUIRE_TORCH") != "1":
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kv_transfer_util import fill_all, only_these_blocks, transfer_pair, wait_for  # noqa: E402,F401
from test_vllm_pull import wait_until  # noqa: E402
from test_vllm_served import pair, pushed_pair, takes_w  # noqa: E402,F401 (pair: the fixture)

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def thread_stalled(x, monkeypatch):
    """x's transfer thread stopped where it waits for what arrives (before a step, holding no lock
    of x's: as when the engine thread keeps the interpreter lock from it) until the block ends;
    the same calls from any other thread go through."""
    resume, stalled = threading.Event(), threading.Event()

    def stalling(real, waits):
        def call(timeout=None):
            if threading.current_thread() is x._thread and waits(timeout):
                stalled.set()
                resume.wait(60)
            return real(timeout)
        return call

    # (its wait: await_notifications; a thread that waits in notifications() itself, with a timeout)
    monkeypatch.setattr(x.agent, "await_notifications", stalling(x.agent.await_notifications, lambda t: True))
    monkeypatch.setattr(x.agent, "notifications", stalling(x.agent.notifications, lambda t: bool(t)))
    try:
        assert stalled.wait(10), "the transfer thread did not come back to its wait"
        yield
    finally:
        resume.set()


def engine_steps(until, *xs, timeout=20.0):
    """Polls each of ``xs`` (poll(0), as an engine's steps) until ``until(reports)``, reports being
    per x the union of what its polls reported ({"sending", "recving", "failed"}); those reports."""
    got = [dict(sending=set(), recving=set(), failed={}) for _ in xs]
    end = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < end, f"not within {timeout} s: {got}"
        for x, g in zip(xs, got):
            done = x.poll()
            g["sending"] |= done.sending
            g["recving"] |= done.recving
            g["failed"].update(done.failed)
        time.sleep(0.002)
    return got


def test_a_first_request_is_pushed_and_released_by_the_prefills_polls_while_its_thread_waits(pair, monkeypatch):
    """The prefill's thread never steps: its polls run the hold, answer the decode's layout, push
    the blocks of the decode's first want (a W: no prefill layout known yet) and release them on
    the decode's ack. (Before, all of it waited for the thread: the fetch failed at its timeout.)"""
    pre, pkv = pair("p", pull=False)
    dec, dkv = pair("d", pull=False)
    fill_all(pkv)
    with thread_stalled(pre, monkeypatch):
        pre.hold("r0", [3, 4])
        dec.fetch("t0", pre.metadata, "r0", [3, 4], [5, 6])
        got = engine_steps(lambda g: "r0" in g[0]["sending"] and "t0" in g[1]["recving"], pre, dec)
        assert got[1]["failed"] == {} and only_these_blocks(dkv, [{5: 3, 6: 4}] * 2) == []
        s = pre.stats()
        assert s["pushes"] == 1 and s["pushes_done"] == 1 and s["released_served"] == 1


def test_a_decode_whose_thread_waits_takes_its_answers_in_its_polls(pair, monkeypatch):
    """The decode's thread stalled after its first fetch went: the prefill's refusal (F) of a
    fetch of the request it released comes to the decode's polls, which report it failed with
    its blocks."""
    pre, dec, dkv = pushed_pair(pair)  # (r0 released)
    with thread_stalled(dec, monkeypatch):
        dec.fetch("t1", pre.metadata, "r0", [1], [8])  # (on the caller's thread: its connection is known)
        got = engine_steps(lambda g: "t1" in g[0]["recving"], dec)
        assert got[0]["failed"] == {"t1": [8]} and pre.stats()["refused"] == 1


def test_polls_leave_a_connect_to_the_thread(pair, monkeypatch):
    """A fetch from a prefill not connected yet is a command: polls never run it (a connect may
    wait on the network), the thread does once it steps."""
    pre, pkv = pair("p", pull=False)
    dec, dkv = pair("d", pull=False)
    fill_all(pkv)
    pre.hold("r0", [3])
    with thread_stalled(dec, monkeypatch):
        dec.fetch("t0", pre.metadata, "r0", [3], [5])
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            assert "t0" not in dec.poll().recving
            time.sleep(0.01)
        assert dec.agent.peers() == [] and pre.agent.peers() == []
    assert wait_for(dec, "recving", "t0") == {} and only_these_blocks(dkv, [{5: 3}] * 2) == []


def test_polls_serve_while_the_thread_connects(pair, monkeypatch):
    """The prefill's thread connects for a fetch of its own (to a prefill that takes 3 s to
    answer, then fails): it connects before its step takes the step lock, so meanwhile the
    prefill's polls answer a decode's first request (its layout, then a W). (Before, the thread
    connected inside its step, holding the lock, and that request waited for the connect.)"""
    pre, pkv = pair("p", pull=False)
    dec, dkv = pair("d", pull=False)
    fill_all(pkv)
    slow, dials = slow_prefill(pre, monkeypatch, 3.0)
    pre.hold("r0", [3, 4])
    pre.fetch("x", slow, "elsewhere", [1], [9])
    wait_until(lambda: dials, "the thread began its connect")
    t0 = time.monotonic()
    dec.fetch("t0", pre.metadata, "r0", [3, 4], [5, 6])
    got = engine_steps(lambda g: "t0" in g[1]["recving"], pre, dec)
    assert time.monotonic() - t0 < 2.0, "the first request waited for the thread's connect"
    assert got[1]["failed"] == {} and only_these_blocks(dkv, [{5: 3, 6: 4}] * 2) == []
    assert wait_for(pre, "recving", "x", timeout=10) == {"x": [9]} and len(dials) == 1  # (its failure reported)


def slow_prefill(x, monkeypatch, seconds):
    """x's connects to the metadata returned take ``seconds``, then fail; (that metadata, the
    times each began)."""
    from flagcx_mesh import MeshTimeout

    connect, slow, dials = x.agent.connect, b"a prefill that answers late", []

    def connect_slowly(md, timeout=None):
        if md != slow:
            return connect(md, timeout=timeout)
        dials.append(time.monotonic())
        time.sleep(seconds)
        raise MeshTimeout("connect: no answer (made up)")

    monkeypatch.setattr(x.agent, "connect", connect_slowly)
    return slow, dials


def test_a_fetch_waiting_for_its_tag_is_connected_for_once_it_starts(pair, monkeypatch):
    """A fetch waiting for an earlier fetch of its id (still out) is not connected for before
    every step: with its prefill taking 1 s to fail a connect, the thread would step once a
    second meanwhile (deadlines and commands held up). (A review found it so before the mend.)"""
    pre, pkv = pair("p", pull=False)
    dec, dkv = pair("d", pull=False, fetch_timeout=4.0)
    slow, dials = slow_prefill(dec, monkeypatch, 1.0)
    dec.fetch("t", pre.metadata, "never-held", [3], [5])  # out until its fetch_timeout (4 s)
    time.sleep(0.3)
    dec.fetch("t", slow, "elsewhere", [1], [9])  # waits for the first
    steps, step = [], dec._step
    monkeypatch.setattr(dec, "_step", lambda *a: (steps.append(time.monotonic()), step(*a))[1])
    time.sleep(2.0)
    assert dials == [] and len(steps) > 20, (len(dials), len(steps))
    assert wait_for(dec, "recving", "t", timeout=20) == {"t": [5]}  # the first, at its timeout
    assert wait_for(dec, "recving", "t", timeout=20) == {"t": [9]} and len(dials) == 1  # then the second


def test_a_fetch_with_nothing_to_receive_waits_for_no_connect(pair, monkeypatch):
    """A fetch whose blocks are all here needs no connection: reported at once, not after a
    connect made ahead for it. (A review found it waiting before the mend.)"""
    dec, dkv = pair("d", pull=False)
    slow, dials = slow_prefill(dec, monkeypatch, 2.0)
    t0 = time.monotonic()
    dec.fetch("t", slow, "r", [1], [])
    assert wait_for(dec, "recving", "t", timeout=10) == {} and time.monotonic() - t0 < 1.0
    assert dials == []


class EndsHeldBack:
    """A prefill's block puller whose served pushes' ended events are held back until let go (the
    decode's ack then comes to the prefill first); everything else goes through."""

    def __init__(self, puller):
        self._puller, self.held, self.let_go = puller, [], False

    def __getattr__(self, name):
        return getattr(self._puller, name)

    def take_served(self):
        events = self.held + self._puller.take_served()
        self.held = [] if self.let_go else [e for e in events if e[2] == 2]  # (kind 2: ended)
        return events if self.let_go else [e for e in events if e[2] != 2]


def test_a_served_push_that_ends_after_its_ack_is_released_by_the_polls(pair, monkeypatch):
    """The decode's ack of a push the core serves comes before the core's word that the push
    ended: the polls release the blocks as that word comes. (Before, the release waited for the
    thread's next look at the held requests: never, with the thread stalled.)"""
    pre, dec, dkv = pushed_pair(pair)
    wait_until(lambda: takes_w(dec, pre), "the decode took the prefill's layout")
    ends = EndsHeldBack(pre._puller)
    monkeypatch.setattr(pre, "_puller", ends)
    with thread_stalled(pre, monkeypatch):
        pre.hold("r1", [4])
        dec.fetch("t1", pre.metadata, "r1", [4], [6])
        engine_steps(lambda g: "t1" in g[1]["recving"], pre, dec)
        got = engine_steps(lambda g: ends.held, pre)  # (the ack is taken meanwhile)
        assert "r1" not in got[0]["sending"]
        ends.let_go = True
        engine_steps(lambda g: "r1" in g[0]["sending"], pre)
    assert only_these_blocks(dkv, [{1: 1, 6: 4}] * 2) == [] and pre.stats()["pushes_served"] == 2


def test_polls_leave_the_work_to_a_thread_that_keeps_up(pair, monkeypatch):
    """poll() does the thread's part only once the thread has not finished a step for ASSIST_AFTER
    seconds: with that set out of reach, a stalled prefill thread's first request does not move
    in the polls; set back, it does (the pushes and sends of a thread that keeps up stay off the
    engine's thread)."""
    from flagcx_mesh.vllm import transfer

    pre, pkv = pair("p", pull=False)
    dec, dkv = pair("d", pull=False)
    fill_all(pkv)
    after = transfer.ASSIST_AFTER
    with thread_stalled(pre, monkeypatch):
        monkeypatch.setattr(transfer, "ASSIST_AFTER", 3600.0)
        pre.hold("r0", [3])
        dec.fetch("t0", pre.metadata, "r0", [3], [5])
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            assert "t0" not in dec.poll().recving and not pre.poll().sending
            time.sleep(0.01)
        assert "r0" not in pre._held  # (its hold command not run)
        monkeypatch.setattr(transfer, "ASSIST_AFTER", after)
        engine_steps(lambda g: "r0" in g[0]["sending"] and "t0" in g[1]["recving"], pre, dec)


class ScriptedPuller:
    """A prefill's block puller whose served events, in-flight counts and withdrawals the test
    scripts (the real one takes and withdraws as well)."""

    def __init__(self, real):
        self._real, self.events, self.flight = real, [], 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def take_served(self):
        self._real.take_served()
        out, self.events = self.events, []
        return out

    def in_flight(self, token):
        return self.flight

    def withdraw(self, token):
        self._real.withdraw(token)
        return self.flight


def served_event(token, push, kind):
    return (token, push, kind, "dec", "inc", 1, 1, 4096, "", time.monotonic())


@pytest.fixture
def scripted(pair, monkeypatch):
    """A prefill (its thread stalled, so only the test steps it) holding r0, its puller scripted."""
    x, _ = pair("p", pull=False)
    fake = ScriptedPuller(x._puller)
    monkeypatch.setattr(x, "_puller", fake)
    with thread_stalled(x, monkeypatch):
        x.hold("r0", [3])
        engine_steps(lambda g: "r0" in x._held, x)  # (a poll runs the hold)
        yield x, fake, x._held["r0"].offers[0]


def test_an_ack_before_the_served_push_posted_its_start_releases_once(scripted):
    """The decode's ack comes while the core counts the push in flight and before it posted the
    push's start (block_pull.h: it may); start and end are then taken in the thread's look at the
    held requests: one release, one report. (Before, the end's release ran inside the look's own
    release: counted twice, and reported twice where a poll came between.)"""
    x, fake, token = scripted
    from flagcx_mesh.vllm.transfer import SERVED_ENDED, SERVED_STARTED
    with x._step_lock:
        fake.flight = 1
        x._on_ack("dec", "r0")
        assert x._held["r0"].release_when_idle == "served"
        fake.flight = 0
        fake.events = [served_event(token, 1, SERVED_STARTED), served_event(token, 1, SERVED_ENDED)]
        x._check_held(time.monotonic())
    assert "r0" not in x._held and x.stats()["released_served"] == 1
    assert x.poll().sending == {"r0"} and x.poll().sending == set()


def test_the_events_after_the_releasing_end_in_one_take_are_counted(scripted):
    """One take of the core's events: the end of the push whose ack came first, then the start and
    end of a second push of the request: both pushes counted, one release. (Before, the release in
    the middle of the take dropped the events after it.)"""
    x, fake, token = scripted
    from flagcx_mesh.vllm.transfer import SERVED_ENDED, SERVED_STARTED
    with x._step_lock:
        fake.flight, fake.events = 1, [served_event(token, 1, SERVED_STARTED)]
        x._take_served()
        x._on_ack("dec", "r0")
        fake.flight = 0
        fake.events = [served_event(token, 1, SERVED_ENDED), served_event(token, 2, SERVED_STARTED),
                       served_event(token, 2, SERVED_ENDED)]
        x._take_served()
    s = x.stats()
    assert "r0" not in x._held and s["released_served"] == 1
    assert s["pushes_served"] == 2 and s["pushes_done"] == 2


def test_a_thread_that_steps_marks_it_and_polls_then_leave_the_step_to_it(pair, monkeypatch):
    """The thread marks each step it finished (the gate of poll()'s part); a poll() right after
    one does none of the step's work, one long after does (the thread stalled here)."""
    pre, pkv = pair("p", pull=False)
    time.sleep(0.2)
    assert time.monotonic() - pre._stepped < 0.2  # (idle, it still steps every poll_interval)
    ran = []
    with thread_stalled(pre, monkeypatch):
        monkeypatch.setattr(pre, "_take_arrivals", lambda: ran.append(threading.current_thread()))
        pre._stepped = time.monotonic() + 3600  # (as if it had just stepped)
        pre.poll()
        assert ran == []
        pre._stepped = time.monotonic() - 1.0
        pre.poll()
        assert ran == [threading.current_thread()]


def test_the_events_of_a_hold_that_runs_inside_a_take_and_releases_at_once_are_counted(scripted):
    """A take of the core's events finds a token whose hold has not run: it runs the holds, and
    that hold (of a request the decode acknowledged before it) releases at once, counting its
    pushes' events first, the ones of this very take too. (Before, those were dropped.)"""
    x, fake, _ = scripted
    from flagcx_mesh.vllm.transfer import SERVED_ENDED, SERVED_STARTED
    token = x._holds_run + 1
    with x._step_lock:
        x._on_ack("dec", "r1")  # (before its hold: remembered as gone)
        assert "r1" in x._gone
        x.hold("r1", [4])  # its token: the next one
        fake.flight = 0
        fake.events = [served_event(token, 7, SERVED_STARTED), served_event(token, 7, SERVED_ENDED)]
        x._take_served()
    s = x.stats()
    assert "r1" not in x._held and s["pushes_served"] == 1 and s["pushes_done"] == 1


class _Conn:
    def __init__(self, incarnation):
        self.peer_incarnation, self._core = incarnation, object()


def early_want_held(x, fake, monkeypatch, incarnation, closing=False):
    """Runs the hold of r9, whose binary want came before it from ``dec`` (its incarnation
    "old"), the connection to ``dec`` now of ``incarnation``: (what the core was handed, the
    requests whose push waits for the close of the connection)."""
    import flagcx_mesh.vllm.transfer as transfer

    handed = []
    monkeypatch.setattr(fake, "resubmit", lambda conn, raw: handed.append(raw) or True, raising=False)
    monkeypatch.setattr(x.agent, "connection", lambda peer: _Conn(incarnation))
    with x._step_lock:
        x._closing.clear()
        x._after_close.clear()
        if closing:
            x._closing[("dec", "old")] = transfer._Closing("dec", threading.Event())
        x._early["r9"] = [("dec", dict(req="r9", tag="t", dst=[1], _inc="old", _raw=b"want"), time.monotonic() + 60)]
        x._cmd_hold("r9", [[4]], 99)
        return handed, [r for r, *_ in x._after_close.get(("dec", "old"), [])]


def test_an_early_want_goes_back_to_the_core_only_on_its_own_connection(scripted, monkeypatch):
    """An early binary want is not handed back to the core when its hold comes where the decode's
    connection is now another incarnation's (dropped: its successor asks again) or is being
    abandoned (its push waits for the close, which refuses it)."""
    x, fake, _ = scripted
    assert early_want_held(x, fake, monkeypatch, "new") == ([], [])
    assert early_want_held(x, fake, monkeypatch, "old", closing=True) == ([], ["r9"])
