"""A decode's wants served by the prefill's core (flagcx_mesh.vllm.transfer: hold() offers the
blocks to the core, which serves a binary want, ``w``, with no step of the prefill's transfer
thread): a push runs while that thread is held (as a busy engine thread keeps the interpreter
lock from it), its counters and release follow when the thread steps on; what the core cannot
serve (no hold yet, an unknown request, blocks the hold lacks) comes to the thread, which serves
or refuses it as a ``W``; a prefill whose layout does not say it takes ``w`` gets a ``W``; the
binary want's encoding and refusals. One process, KVTransfer agents over cma (host memory),
torch CPU tensors.

Skipped without torch, unless FXM_REQUIRE_TORCH=1 (scripts/test.sh sets it)."""

import json
import os
import sys
import time

import pytest

if os.environ.get("FXM_REQUIRE_TORCH") != "1":
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from flagcx_mesh.vllm import protocol  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kv_transfer_util import fill_all, only_these_blocks, transfer_pair, wait_for  # noqa: E402,F401
from test_vllm_pull import count_messages, not_within, thread_held, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pair(transfer_pair):
    return transfer_pair


def pushed_pair(pair, **pre_kw):
    """A prefill and a decode that push (no pulls), whose first request went (the two layouts
    exchanged on their connection), and the decode's KV caches, the prefill's filled."""
    pre, pkv = pair("p", pull=False, **pre_kw)
    dec, dkv = pair("d", pull=False)
    fill_all(pkv)
    pre.hold("r0", [1])
    dec.fetch("t0", pre.metadata, "r0", [1], [1])
    assert wait_for(dec, "recving", "t0") == {}
    wait_for(pre, "sending", "r0")
    return pre, dec, dkv


def takes_w(dec, pre) -> bool:
    return (pre.agent.name, pre.agent.incarnation) in dec._takes_w


def test_a_want_is_served_by_the_core_while_the_prefill_thread_is_held(pair, monkeypatch):
    """With the prefill's transfer thread held from before hold() until after the blocks landed,
    the push still runs: the core took the decode's binary want. Every block lands byte for
    byte; once the thread steps on, the push is counted and the decode's ack releases the blocks."""
    pre, dec, dkv = pushed_pair(pair)
    wait_until(lambda: takes_w(dec, pre), "the decode took the prefill's layout (it says w)")
    seen = count_messages(pre)
    with thread_held(pre, monkeypatch):
        pre.hold("r1", [3, 4, 9])
        dec.fetch("t1", pre.metadata, "r1", [3, 4, 9], [5, 6, 7])
        assert wait_for(dec, "recving", "t1", timeout=20) == {}
        assert pre.stats()["pushes"] == 1  # (the first request's: nothing of r1 counted yet)
    assert only_these_blocks(dkv, [{1: 1, 5: 3, 6: 4, 7: 9}] * 2) == []
    wait_for(pre, "sending", "r1")
    wait_until(lambda: pre.stats()["pushes_done"] == 2, "the served push counted done")
    s = pre.stats()
    assert s["pushes"] == 2 and s["pushes_served"] == 2 and s["pushes_failed"] == 0 and s["released_served"] == 2
    assert s["bytes_pushed"] > 0 and "W" not in seen  # (no want of r1 came to the thread)


def test_the_first_want_of_a_connection_is_pushed_by_the_core(pair, monkeypatch):
    """A decode's first want on a connection is a ``W`` (it has not heard yet that the prefill
    takes the binary form): the prefill's thread makes its binary form and hands it to the core,
    which pushes it; no write of the thread's (on a host path it copies the bytes itself, on the
    engine's thread where poll() steps in). (Before, the thread pushed it: pushes_served 0.)"""
    from flagcx_mesh.agent import AgentConnection

    writes = []
    write_blocks = AgentConnection.write_blocks
    monkeypatch.setattr(AgentConnection, "write_blocks", lambda *a, **k: (writes.append(a), write_blocks(*a, **k))[1])
    pre, pkv = pair("p", pull=False)
    dec, dkv = pair("d", pull=False)
    fill_all(pkv)
    seen = count_messages(pre)
    pre.hold("r0", [3, 4])
    dec.fetch("t0", pre.metadata, "r0", [3, 4], [5, 6])
    assert wait_for(dec, "recving", "t0") == {}
    wait_for(pre, "sending", "r0")
    assert seen.get("W") == 1  # (the W came to the thread)
    assert only_these_blocks(dkv, [{5: 3, 6: 4}] * 2) == []
    s = pre.stats()
    assert s["pushes"] == 1 and s["pushes_served"] == 1 and s["pushes_done"] == 1 and writes == []


def test_a_refused_want_counts_no_readers(pair):
    """A want the prefill refuses (more blocks than it holds) that says 4 decode ranks read the
    request does not make the blocks wait for 4 acks: a valid fetch's one ack releases them.
    (Found by review: the hand-off to the core had counted a want's readers before its checks.)"""
    pre, pkv = pair("p", pull=False, hold_timeout=60)
    dec, dkv = pair("d", pull=False)
    fill_all(pkv)
    pre.hold("r1", [3])
    dec.fetch("x", pre.metadata, "r1", [2, 3], [5, 6], readers=4)  # (the prefill holds one block)
    assert wait_for(dec, "recving", "x") == {"x": [5, 6]}
    dec.fetch("t", pre.metadata, "r1", [3], [7])
    assert wait_for(dec, "recving", "t") == {}
    wait_for(pre, "sending", "r1", timeout=10)  # (not at its 60 s hold timeout)
    assert only_these_blocks(dkv, [{7: 3}] * 2) == [] and pre.stats()["released_served"] == 1


def test_the_first_blocks_a_decode_has_are_not_sent(pair):
    """A want of fewer blocks than held (the decode had the first ones from its prefix cache):
    the core sends the held tail, as the thread does."""
    pre, dec, dkv = pushed_pair(pair)
    wait_until(lambda: takes_w(dec, pre), "the decode took the prefill's layout")
    pre.hold("r1", [10, 11, 12, 13])
    dec.fetch("t1", pre.metadata, "r1", [10, 11, 12, 13], [14, 15])
    assert wait_for(dec, "recving", "t1") == {}
    assert only_these_blocks(dkv, [{1: 1, 14: 12, 15: 13}] * 2) == []


def test_a_want_before_its_hold_is_served_by_the_core_when_the_hold_comes(pair):
    """The core has no offer yet: it hands the want to the thread, which keeps it until the
    hold comes (as a W), then hands it back to the core, which pushes it (no push of the
    thread's: before, the thread pushed it itself)."""
    pre, dec, dkv = pushed_pair(pair)
    wait_until(lambda: takes_w(dec, pre), "the decode took the prefill's layout")
    seen = count_messages(pre)
    dec.fetch("t1", pre.metadata, "r1", [3], [4])
    wait_until(lambda: seen.get("W") == 1, "the want came to the prefill's thread")
    assert not_within(dec, "recving", "t1", 0.3)
    pre.hold("r1", [3])
    assert wait_for(dec, "recving", "t1") == {}
    assert only_these_blocks(dkv, [{1: 1, 4: 3}] * 2) == []
    wait_for(pre, "sending", "r1")
    s = pre.stats()
    assert s["pushes"] == 2 and s["pushes_served"] == 2 and seen.get("W") == 1


def test_wants_the_core_cannot_serve_are_refused_by_the_thread(pair):
    """An unknown request, and more blocks than held: handed to the thread, which answers F (the
    decode's fetch fails at once with the reason, no block changes)."""
    pre, dec, dkv = pushed_pair(pair, hold_timeout=60)
    wait_until(lambda: takes_w(dec, pre), "the decode took the prefill's layout")
    pre.hold("r1", [3])
    pre.hold("gone", [2])
    dec.fetch("x", pre.metadata, "gone", [2], [9])
    assert wait_for(dec, "recving", "x") == {}  # (served: "gone" is held)
    wait_for(pre, "sending", "gone")
    t0 = time.monotonic()
    dec.fetch("t1", pre.metadata, "r1", [3, 4], [5, 6])  # r1 holds one block
    dec.fetch("t2", pre.metadata, "gone", [2], [7])  # released on its ack
    failed = wait_for(dec, "recving", "t1")
    failed.update(wait_for(dec, "recving", "t2") if "t2" not in failed else {})
    assert failed == {"t1": [5, 6], "t2": [7]}
    assert time.monotonic() - t0 < 10  # answered, not left to the fetch timeout
    assert pre.stats()["refused"] == 2
    assert only_these_blocks(dkv, [{1: 1, 9: 2}] * 2) == []


def test_a_prefill_whose_layout_does_not_say_w_gets_a_W(pair):
    """A prefill of before the binary want (its layout without ``w``): the decode sends the JSON
    ``W`` (this prefill's thread hands each to its core in the binary form: _to_core)."""
    pre, pkv = pair("p", pull=False)
    old = json.loads(pre._layout_msg[len(protocol.MAGIC) + 1:])
    old.pop("w")
    pre._layout_msg = protocol.encode("L", **old)
    dec, dkv = pair("d", pull=False)
    fill_all(pkv)
    seen = count_messages(pre)
    for i in range(2):
        pre.hold(f"r{i}", [i + 3])
        dec.fetch(f"t{i}", pre.metadata, f"r{i}", [i + 3], [i + 5])
        assert wait_for(dec, "recving", f"t{i}") == {}
    assert not takes_w(dec, pre) and seen.get("W") == 2 and pre.stats()["pushes_served"] == 2
    assert only_these_blocks(dkv, [{5: 3, 6: 4}] * 2) == []


def test_a_release_waits_for_a_push_the_core_serves(pair, monkeypatch):
    """Blocks the core still pushes are not released (by an ack, a cancel, the hold's deadline):
    the release waits until the core says the push is over."""
    pre, dec, dkv = pushed_pair(pair)
    pre.hold("r1", [3])
    wait_until(lambda: "r1" in pre._held, "the hold taken")
    real = pre._puller

    class Busy:  # the core reports a push of r1 in flight
        def __getattr__(self, name):
            return getattr(real, name)

        def withdraw(self, token):
            real.withdraw(token)
            return 1

        def in_flight(self, token):
            return 1

    monkeypatch.setattr(pre, "_puller", Busy())
    dec.release(pre.metadata, "r1")
    assert not_within(pre, "sending", "r1", 0.5)
    assert pre._held["r1"].release_when_idle == "cancelled"
    monkeypatch.setattr(pre, "_puller", real)
    wait_for(pre, "sending", "r1")


def test_the_binary_want_round_trip_and_refusals():
    answer = protocol.encode("D", tag="t", n=7)
    w = protocol.encode_want(dict(req="r", tag="t", dst=[1, 2, 3], groups=[2, 1], readers=2, part=[1, 2, 0, 1], n=7),
                             answer)
    assert w.startswith(protocol.MAGIC + b"w")
    kind, f = protocol.decode(w)
    assert kind == "W" and f == {"req": "r", "tag": "t", "dst": [1, 2, 3], "groups": [2, 1], "readers": 2,
                                 "part": [1, 2, 0, 1], "n": 7}
    whole = protocol.decode(protocol.encode_want(dict(req="r", dst=[4]), protocol.encode("D", tag="u")))[1]
    assert whole == {"req": "r", "tag": "u", "dst": [4], "groups": [1], "part": [0, 1, 0, 1]}
    for bad in (w[:-1], w + b"\0", w[:6] + b"\x02" + w[7:], protocol.MAGIC + b"w"):
        with pytest.raises(protocol.ProtocolViolation):
            protocol.decode(bad)
    with pytest.raises(protocol.ProtocolViolation, match="not a D"):
        protocol.decode(protocol.encode_want(dict(req="r", dst=[1]), protocol.encode("F", tag="t")))


def test_a_want_is_served_over_tcp_its_answer_behind_the_data(pair, monkeypatch):
    """Over tcp (the path between hosts) the core serves the want too, its ``D`` sent with the
    write (the socket orders it behind the data): every block has landed when the decode sees it."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    pre, dec, dkv = pushed_pair(pair)
    wait_until(lambda: takes_w(dec, pre), "the decode took the prefill's layout")
    seen = count_messages(pre)
    for i, src in enumerate(([3, 4, 9], [12]), start=1):
        pre.hold(f"r{i}", src)
        dec.fetch(f"t{i}", pre.metadata, f"r{i}", src, [b + 1 for b in src])
        assert wait_for(dec, "recving", f"t{i}") == {}
    assert only_these_blocks(dkv, [{1: 1, 4: 3, 5: 4, 10: 9, 13: 12}] * 2) == []
    assert dec.agent.connection(pre.name).path_to(pre._regions[0].descriptor, dec._regions[0].descriptor) == "tcp"
    assert "W" not in seen


def test_a_request_held_again_keeps_waiting_for_the_pushes_of_its_first_hold(pair, monkeypatch):
    """hold() of a request id still held: a release waits for the pushes the core serves of the
    first hold's offer too (before, the first offer's pushes were forgotten with it)."""
    pre, dec, dkv = pushed_pair(pair)
    pre.hold("r1", [3])
    wait_until(lambda: "r1" in pre._held, "the hold taken")
    first = pre._held["r1"].offers[-1]
    real = pre._puller

    class FirstBusy:  # the core reports a push of the first offer in flight
        def __getattr__(self, name):
            return getattr(real, name)

        def withdraw(self, token):
            return 1 if real.withdraw(token) or token == first else 0

        def in_flight(self, token):
            return 1 if token == first else real.in_flight(token)

    monkeypatch.setattr(pre, "_puller", FirstBusy())
    pre.hold("r1", [3])
    wait_until(lambda: pre._held["r1"].offers[-1] != first, "the second hold taken")
    dec.release(pre.metadata, "r1")
    assert not_within(pre, "sending", "r1", 0.5), "released while a push of the first offer is in flight"
    monkeypatch.setattr(pre, "_puller", real)
    wait_for(pre, "sending", "r1")


@pytest.mark.parametrize("tag,req", [("t" * 4090, "r"), ("\u00e9" * 700, "r"), ("t", "\u00e9" * 2100)],
                         ids=["long-tag", "non-ascii-tag", "non-ascii-request"])
def test_ids_the_binary_want_cannot_carry_go_as_a_W(pair, tag, req):
    """A tag or request id within what a W carries (4096 characters) but over the binary want's
    4096 bytes (its D escapes non-ASCII characters as 6 bytes each): the want goes as a W, served
    by the thread, not failed."""
    pre, dec, dkv = pushed_pair(pair)
    wait_until(lambda: takes_w(dec, pre), "the decode took the prefill's layout")
    with pytest.raises(ValueError):
        protocol.encode_want(dict(req=req, tag=tag, dst=[1], n=3), protocol.encode("D", tag=tag, n=3))
    pre.hold(req, [3])
    dec.fetch(tag, pre.metadata, req, [3], [4])
    assert wait_for(dec, "recving", tag) == {}
    assert only_these_blocks(dkv, [{1: 1, 4: 3}] * 2) == []


def test_a_layout_sent_again_drops_the_tables_the_core_made_of_the_earlier_one(pair):
    """A decode that sends its layout again on the same connection: the core forgets every table
    it made of the earlier one (a half of the heads here, not only whole blocks), so the next want
    of that half comes to the thread, which makes them of the new layout and serves it. (Before,
    the core kept serving that half by the tables of the layout it had replaced.)"""
    pre, pkv = pair("p", heads=4, pull=False, hold_timeout=60)
    dec, dkv = pair("d", heads=2, pull=False)
    fill_all(pkv)
    seen = count_messages(pre)
    for i in range(2):  # the first want via the thread (it hands the half's tables to the core), the second the core's
        pre.hold(f"r{i}", [i + 3])
        dec.fetch(f"t{i}", pre.metadata, f"r{i}", [i + 3], [i + 5], (0, 2, 0, 1))
        assert wait_for(dec, "recving", f"t{i}") == {}
    assert seen.get("W") == 1 and seen.get("L") == 1 and pre.stats()["pushes_served"] == 2
    forgot = []
    forget = pre._forget_tables
    pre._forget_tables = lambda conn: (forget(conn), forgot.append(conn))
    dec.agent.connection(pre.agent.name).notify(dec._layout_msg)
    wait_until(lambda: forgot, "the prefill took the layout sent again")
    pre.hold("r2", [7])
    dec.fetch("t2", pre.metadata, "r2", [7], [8], (0, 2, 0, 1))
    assert wait_for(dec, "recving", "t2") == {}
    assert seen.get("W") == 2 and pre.stats()["pushes_served"] == 3


def test_a_request_cancelled_before_its_hold_is_never_served_by_the_core(pair, monkeypatch):
    """The decode gave a request up before the prefill's worker held it; the hold's command runs
    before hold() has offered the blocks to the core (forced here: the offer waits for it). The
    offer must not outlive the hold: a later want of that request is refused, not served from
    blocks vLLM has back. (Before, hold() queued the command first, and an offer made after the
    command's withdraw stayed in the core.)"""
    pre, dec, dkv = pushed_pair(pair)
    wait_until(lambda: takes_w(dec, pre), "the decode took the prefill's layout")
    ran, cmd = [], pre._cmd_hold
    pre._cmd_hold = lambda *a: (cmd(*a), ran.append(a[0]))

    class OfferAfterTheHold:
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            return getattr(self._real, name)

        def offer(self, token, req, groups, timeout):
            end = time.monotonic() + 1.0  # (with the offer first, the command is not queued yet: it waits in vain)
            while req not in ran and time.monotonic() < end:
                time.sleep(0.005)
            return self._real.offer(token, req, groups, timeout)

    dec.release(pre.metadata, "rx")
    wait_until(lambda: "rx" in pre._gone, "the prefill heard the request was given up")
    monkeypatch.setattr(pre, "_puller", OfferAfterTheHold(pre._puller))
    pre.hold("rx", [3])
    wait_for(pre, "sending", "rx")
    dec.fetch("t", pre.metadata, "rx", [3], [7])
    assert wait_for(dec, "recving", "t") == {"t": [7]}
    assert only_these_blocks(dkv, [{1: 1}] * 2) == [] and pre.stats()["pushes_served"] == 1  # (r0's)
