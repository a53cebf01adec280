"""Wants served by the core (agent/want.h, agent/want_server.h, ``_core._BlockPuller.serve_wants``):
the binary want format round-trips and refuses each malformed want for its reason; a want of
blocks offered is served by the serving agent's core with no thread of its reading notifications
(every byte where the rows say, the tail of the held ids, the answer after the data, started and
ended events); a want the core cannot serve (no offer, no tables, too many blocks, ids out of
range, malformed, withdrawn) reaches the serving agent's notifications() unchanged and promptly;
other notifications and host waits still work beside the claim; pushes held in flight by the
fake CUDA driver (late once, withdraw counting them, close ending each once) in
tests/want_serve_prog.py."""

import array
import os
import struct
import time

import pytest

import fakecuda
import gpujobs
from flagcx_mesh import Agent, _core
from flagcx_mesh.errors import InvalidArgument
from meshutil import finish_prog, spawn_prog
from test_agent_block_pull import notes as answers  # what reaches an agent (all of it, then nothing for 0.2 s)
from test_agent_block_pull import outcomes

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.timeout(60)

BLOCK, BLOCKS = 256, 64
PART = (0, 1, 0, 1)
STARTED, ENDED, LATE = 1, 2, 3


def ids(v):
    return array.array("q", v)


def want(req="req-1", answer=b"D-1", part=PART, readers=0, counts=None, dst=(10, 11)):
    return _core._encode_want(req, answer, part, readers, [len(dst)] if counts is None else counts, ids(dst))


# ---- the format -------------------------------------------------------------------------------


def test_a_want_round_trips():
    data = want("r\u00e9q", b"\x00ans", (1, 2, 0, 4), 3, [2, 0, 1], (5, 6, 7))
    assert data.startswith(_core.WANT_PREFIX) and _core.WANT_PREFIX == b"fxkv1w"
    req, answer, part, readers, counts, dst = _core._parse_want(data)
    assert (req, answer, part, readers, counts) == ("r\u00e9q", b"\x00ans", (1, 2, 0, 4), 3, [2, 0, 1])
    assert isinstance(dst, array.array) and dst.typecode == "q" and list(dst) == [5, 6, 7]
    assert list(_core._parse_want(want(counts=[0], dst=()))[5]) == []


def raw(req=b"r", answer=b"a", part=PART, readers=0, counts=(1,), dst=(0,), prefix=b"fxkv1w", version=1):
    """A want's bytes laid out by hand (what a peer might send), without the encoder's checks."""
    return (prefix + bytes([version]) + struct.pack("<5I", *part, readers) + struct.pack("<H", len(req)) + req +
            struct.pack("<H", len(answer)) + answer + struct.pack("<I", len(counts)) +
            struct.pack(f"<{len(counts)}Q", *counts) + struct.pack("<Q", len(dst)) + struct.pack(f"<{len(dst)}q", *dst))


REFUSED = {
    "prefix": (raw(prefix=b"fxkv1W"), "prefix"),
    "version": (raw(version=2), "version 2"),
    "truncated": (raw()[:-1], "truncated"),
    "trailing": (raw() + b"\x00", "1 trailing bytes"),
    "too long": (raw(dst=(0,) * 600_000, counts=(600_000,)), "at most 4194304"),
    "req empty": (raw(req=b""), "req is empty"),
    "req too long": (raw(req=b"r" * 4097), "req of 4097 bytes"),
    "answer empty": (raw(answer=b""), "answer is empty"),
    "answer too long": (raw(answer=b"a" * 4097), "answer of 4097 bytes"),
    "sn 0": (raw(part=(0, 0, 0, 1)), "part"),
    "dn 0": (raw(part=(0, 1, 0, 0)), "part"),
    "si >= sn": (raw(part=(2, 2, 0, 1)), "part"),
    "di >= dn": (raw(part=(0, 1, 1, 1)), "part"),
    "no groups": (raw(counts=(), dst=()), "0 groups"),
    "too many groups": (raw(counts=(0,) * 1025, dst=()), "1025 groups"),
    "counts below dst": (raw(counts=(1,), dst=(0, 1)), "add up to 1, not the 2"),
    "counts above dst": (raw(counts=(3,), dst=(0, 1)), "more than the 2"),
    "negative dst": (raw(dst=(-1,)), "negative"),
    "a huge ndst": (raw(dst=())[:-8] + struct.pack("<Q", 1 << 62), "truncated"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_malformed_want_is_refused_for_its_reason(case):
    data, why = REFUSED[case]
    with pytest.raises(ValueError, match=why):
        _core._parse_want(data)


def test_a_want_whose_req_is_not_utf8_is_refused():
    _core._parse_want(raw(req=b"ok"))
    with pytest.raises(ValueError, match="UTF-8"):
        _core._parse_want(raw(req=b"\xff"))


@pytest.mark.parametrize("args,why", [
    (dict(req=""), "req is empty"), (dict(answer=b""), "answer is empty"), (dict(part=(1, 1, 0, 1)), "part"),
    (dict(counts=[1]), "add up to 1"), (dict(counts=[]), "0 groups"), (dict(dst=(-3, 1)), "negative"),
])
def test_encode_refuses_what_parse_would(args, why):
    with pytest.raises(InvalidArgument, match=why):
        want(**args)


# ---- served by the core -----------------------------------------------------------------------


class Serving:
    """A decode agent (its blocks zeros) and a prefill agent whose puller serves wants (its
    blocks a pattern), one layer of BLOCKS blocks each side; nobody reads the prefill's
    notifications unless a test does."""

    def __init__(self, decode, prefill):
        self.decode, self.prefill = decode, prefill
        self.mine = bytearray(BLOCK * BLOCKS)
        self.theirs = bytearray(bytes((i * 7 + i // BLOCK) % 256 for i in range(BLOCK * BLOCKS)))
        self.dec_region, self.pre_region = decode.register(self.mine), prefill.register(self.theirs)
        self.conn = decode.connect(prefill.metadata())
        self.back = prefill.connect(decode.metadata())  # (the same connection: the wants arrive on it)
        self.puller = _core._BlockPuller(prefill._core)
        self.puller.serve_wants(True)
        table = _core._BlockRows([(0, BLOCK, 0, BLOCK)], [0], [0], BLOCK, True, BLOCKS, BLOCKS)
        self.puller.serve_layout(self.back._core, PART, [self.pre_region], [self.dec_region], [[table]])

    def block(self, side, b):
        return bytes(side[b * BLOCK:(b + 1) * BLOCK])


@pytest.fixture
def serving():
    with Agent("want-decode", "s", timeout=20) as decode, Agent("want-prefill", "s", timeout=20) as prefill:
        s = Serving(decode, prefill)
        yield s
        s.puller.close()


def served(puller, n, timeout=20.0):
    """The first ``n`` served events (no more)."""
    return outcomes(puller, n, timeout, take=puller.take_served)


def test_a_want_is_served_by_the_core_with_no_reader_of_notifications(serving):
    """The prefill's thread never calls notifications(): the inbox's watcher drains the want, the
    puller pushes the tail of the held ids into dst and then sends the answer."""
    s = serving
    s.puller.offer(7, "req-1", [ids([3, 4, 5, 6])], 20.0)
    s.conn.notify(want(readers=0, dst=(10, 11, 40)))
    assert answers(s.decode) == [b"D-1"]  # (after the data: checked right away)
    for d, h in zip([10, 11, 40], [4, 5, 6]):
        assert s.block(s.mine, d) == s.block(s.theirs, h)
    untouched = set(range(BLOCKS)) - {10, 11, 40}
    assert all(s.block(s.mine, b) == bytes(BLOCK) for b in untouched)
    started, ended = served(s.puller, 2)
    inc = s.decode.incarnation
    assert started[:9] == (7, 1, STARTED, "want-decode", inc, 1, 2, 3 * BLOCK, "")  # 10, 11 <- 4, 5: one op
    assert ended[:9] == (7, 1, ENDED, "want-decode", inc, 1, 2, 3 * BLOCK, "")
    assert started[9] <= ended[9] and s.puller.in_flight(7) == 0


def test_the_first_held_ids_are_skipped_and_readers_and_groups_are_kept(serving):
    """Two KV cache groups: each serves the last counts[g] of its held ids into its slice of dst;
    readers given is what the events say."""
    s = serving
    table = _core._BlockRows([(0, BLOCK, 0, BLOCK)], [0], [0], BLOCK, True, BLOCKS, BLOCKS)
    s.puller.serve_layout(s.back._core, PART, [s.pre_region], [s.dec_region], [[table], [table]])
    s.puller.offer(8, "req-2", [ids([1, 2, 3]), ids([20, 30])], 20.0)
    s.conn.notify(want("req-2", b"D-2", readers=4, counts=[1, 2], dst=(50, 51, 52)))
    assert answers(s.decode) == [b"D-2"]
    assert s.block(s.mine, 50) == s.block(s.theirs, 3)
    assert [s.block(s.mine, 51), s.block(s.mine, 52)] == [s.block(s.theirs, 20), s.block(s.theirs, 30)]
    assert s.block(s.mine, 1) == bytes(BLOCK)  # (1, 2: the decode has them)
    started, ended = served(s.puller, 2)
    assert (started[2], started[5], started[7]) == (STARTED, 4, 3 * BLOCK) and ended[8] == ""


def test_a_want_of_no_blocks_is_answered(serving):
    s = serving
    s.puller.offer(9, "req-1", [ids([1])], 20.0)
    s.conn.notify(want(counts=[0], dst=()))
    assert answers(s.decode) == [b"D-1"]
    assert [e[2:8] for e in served(s.puller, 2)] == [(STARTED, "want-decode", s.decode.incarnation, 1, 0, 0),
                                                      (ENDED, "want-decode", s.decode.incarnation, 1, 0, 0)]


HANDED_BACK = {
    "no offer": lambda s: want("req-unknown"),
    "no tables for its part": lambda s: want(part=(0, 2, 0, 1)),
    "no tables for its groups": lambda s: want(counts=[1, 1]),
    "more blocks than held": lambda s: want(dst=(1, 2, 3, 4, 5)),
    "a dst id out of range": lambda s: want(dst=(1, BLOCKS)),
    "malformed": lambda s: _core.WANT_PREFIX + b"\x01 not a want",
}


@pytest.mark.parametrize("case", sorted(HANDED_BACK))
def test_a_want_the_core_cannot_serve_reaches_notifications_unchanged_and_promptly(serving, case):
    s = serving
    s.puller.offer(3, "req-1", [ids([1, 2, 3, 4])], 20.0)
    data = HANDED_BACK[case](s)
    s.conn.notify(data)
    t0 = time.monotonic()
    got = s.prefill.notifications(timeout=5.0)  # waiting as it is handed back
    assert time.monotonic() - t0 < 1.0, time.monotonic() - t0
    assert [(n.peer, bytes(n.data)) for n in got] == [("want-decode", data)]
    assert s.puller.take_served() == [] and answers(s.decode, 0.3) == []
    assert s.mine == bytearray(BLOCK * BLOCKS)


def test_a_handed_back_want_wakes_a_notifications_call_already_waiting(serving):
    """The hand-back rings the doorbell: a take(5 s) that waits since before the want was sent
    returns it well before its timeout."""
    import threading

    s = serving
    got = []
    t = threading.Thread(target=lambda: got.append((s.prefill.notifications(timeout=5.0), time.monotonic())))
    t.start()
    time.sleep(0.3)
    sent = time.monotonic()
    s.conn.notify(want("req-none"))
    t.join(10)
    (notes, at), = got
    assert [bytes(n.data) for n in notes] == [want("req-none")] and at - sent < 1.0, at - sent


def test_withdraw_hands_later_wants_back_and_offer_replaces(serving):
    s = serving
    s.puller.offer(4, "req-1", [ids([1, 2])], 20.0)
    s.puller.offer(5, "req-1", [ids([6, 7])], 20.0)  # replaces token 4's offer of req-1
    s.conn.notify(want(dst=(30, 31)))
    assert answers(s.decode) == [b"D-1"] and s.block(s.mine, 30) == s.block(s.theirs, 6)
    assert {e[0] for e in served(s.puller, 2)} == {5}
    assert s.puller.withdraw(4) == 0 and s.puller.withdraw(5) == 0  # (its push is over)
    s.conn.notify(want(answer=b"D-again"))
    assert [bytes(n.data) for n in s.prefill.notifications(timeout=5.0)] == [want(answer=b"D-again")]


def test_the_claim_leaves_other_notifications_and_host_waits_alone(serving):
    s = serving
    s.puller.offer(6, "req-1", [ids([1, 2])], 20.0)
    s.conn.notify(b"hello")
    s.conn.notify(b"fxkv1W{}")  # (a JSON want: not the prefix)
    s.conn.notify(want(dst=(8, 9)))
    s.conn.notify(b"wait-for-me")
    got = s.prefill.wait_notification("want-decode", timeout=10.0, data=b"wait-for-me")
    assert bytes(got.data) == b"wait-for-me"
    assert answers(s.prefill) == [b"hello", b"fxkv1W{}"]
    assert answers(s.decode) == [b"D-1"]


def test_serve_wants_off_gives_wants_back_to_notifications(serving):
    s = serving
    s.puller.offer(6, "req-1", [ids([1, 2])], 20.0)
    s.puller.serve_wants(False)
    s.conn.notify(want())
    assert [bytes(n.data) for n in s.prefill.notifications(timeout=5.0)] == [want()]
    s.puller.serve_wants(True)
    s.conn.notify(want())
    assert answers(s.decode) == [b"D-1"]


def test_close_takes_the_claim_out(serving):
    s = serving
    s.puller.offer(6, "req-1", [ids([1, 2])], 20.0)
    s.puller.close()
    s.conn.notify(want())
    assert [bytes(n.data) for n in s.prefill.notifications(timeout=5.0)] == [want()]
    with pytest.raises(Exception, match="closed"):
        s.puller.serve_wants(True)


def test_a_second_puller_of_the_agent_is_refused_and_leaves_the_first_serving(serving):
    """One puller of an agent serves its wants: a second's serve_wants(True) is refused, and its
    close leaves the first's claim in place. (Before, the second replaced the first's claim and its
    close took the claim out: the first's offers were then never served.)"""
    s = serving
    other = _core._BlockPuller(s.prefill._core)
    with pytest.raises(InvalidArgument, match="another block puller"):
        other.serve_wants(True)
    other.close()
    s.puller.offer(6, "req-1", [ids([1, 2])], 20.0)
    s.conn.notify(want(dst=(12, 13)))
    assert answers(s.decode) == [b"D-1"] and s.block(s.mine, 13) == s.block(s.theirs, 2)
    assert answers(s.prefill) == []
    s.puller.serve_wants(False)
    other = _core._BlockPuller(s.prefill._core)  # (the claim is free again)
    other.serve_wants(True)
    other.close()


def test_forget_layouts_hands_the_wants_of_its_connection_back_until_served_again(serving):
    s = serving
    s.puller.offer(6, "req-1", [ids([1, 2])], 20.0)
    s.puller.forget_layouts(s.back._core)
    s.conn.notify(want())
    assert [bytes(n.data) for n in s.prefill.notifications(timeout=5.0)] == [want()]
    table = _core._BlockRows([(0, BLOCK, 0, BLOCK)], [0], [0], BLOCK, True, BLOCKS, BLOCKS)
    s.puller.serve_layout(s.back._core, PART, [s.pre_region], [s.dec_region], [[table]])
    s.conn.notify(want())
    assert answers(s.decode) == [b"D-1"]


def test_a_want_handed_back_is_served_when_resubmitted_once_its_blocks_are_offered(serving):
    """A want before its offer goes to notifications(); resubmitted once the blocks are offered, the
    core serves it (an early want needs no push of the caller's); resubmitted while still not
    servable, it goes to notifications() again."""
    s = serving
    s.conn.notify(want(dst=(20, 21)))
    assert [bytes(n.data) for n in s.prefill.notifications(timeout=5.0)] == [want(dst=(20, 21))]
    assert s.puller.resubmit(s.back._core, want(dst=(20, 21))) is True  # (no offer yet: back again)
    assert [bytes(n.data) for n in s.prefill.notifications(timeout=5.0)] == [want(dst=(20, 21))]
    s.puller.offer(9, "req-1", [ids([5, 6])], 20.0)
    assert s.puller.resubmit(s.back._core, want(dst=(20, 21))) is True
    assert answers(s.decode) == [b"D-1"] and s.block(s.mine, 21) == s.block(s.theirs, 6)
    assert answers(s.prefill) == [] and {e[2] for e in served(s.puller, 2)} == {STARTED, ENDED}
    s.puller.serve_wants(False)
    assert s.puller.resubmit(s.back._core, want()) is False
    with pytest.raises(InvalidArgument):
        s.puller.resubmit(s.conn._core, want())


def test_serve_layout_refuses_a_connection_of_another_agent(serving):
    s = serving
    with pytest.raises(InvalidArgument):
        s.puller.serve_layout(s.conn._core, PART, [s.pre_region], [s.dec_region], [[]])


@pytest.mark.parametrize("scenario", ["late", "withdraw", "close"])
def test_a_push_in_flight(scenario):
    """Pushes held in flight by the fake driver (copies from device memory take 1.5 s):
    tests/want_serve_prog.py."""
    env = gpujobs.job_env(fakecuda.env(), ("FLAGCX_MESH_CUDA_PATH",), FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS=1500)
    p = spawn_prog(os.path.join(HERE, "want_serve_prog.py"), scenario, env=env, cwd=HERE)
    finish_prog(p, timeout=60, what=scenario, ok=f"{scenario} ok")


def test_once_withdraw_said_none_in_flight_no_push_of_that_offer_starts():
    """withdraw() racing the puller's thread serving a want of 16384 ops (making them takes a
    while): where withdraw() returned 0, no push of that offer starts after it (the push is counted
    in flight as its offer is found, under the lock withdraw() takes). Before, the count came only
    once the ops were made, and the write was issued after a withdraw() that said 0 (5 of 150 tries)."""
    import random

    block, n, tries = 16, 32768, 150
    rng = random.Random(7)
    late = []
    with Agent("want-decode", "s", timeout=20) as decode, Agent("want-prefill", "s", timeout=20) as prefill:
        mine, theirs = bytearray(block * n), bytearray(block * n)
        dr, pr = decode.register(mine), prefill.register(theirs)
        conn = decode.connect(prefill.metadata())
        back = prefill.connect(decode.metadata())
        puller = _core._BlockPuller(prefill._core)
        try:
            puller.serve_wants(True)
            table = _core._BlockRows([(0, block, 0, block)], [0], [0], block, True, n, n)
            puller.serve_layout(back._core, PART, [pr], [dr], [[table]])
            src, dst = list(range(0, n, 2)), tuple(reversed(range(1, n, 2)))  # no two ops merge
            for i in range(tries):
                token = 100 + i
                puller.offer(token, f"req-{i}", [ids(src)], 20.0)
                conn.notify(want(f"req-{i}", dst=dst))
                spin = time.perf_counter() + rng.uniform(0, 0.004)
                while time.perf_counter() < spin:
                    pass
                none = puller.withdraw(token) == 0
                said, events = time.monotonic(), []
                while time.monotonic() < said + 10:  # until it ended, or came back unserved
                    events += [e for e in puller.take_served() if e[0] == token]
                    if any(e[2] == ENDED for e in events) or prefill.notifications(timeout=0.001):
                        break
                if none:
                    late += [(i, round(e[9] - said, 6)) for e in events if e[2] == STARTED and e[9] > said]
                decode.notifications(timeout=0)
        finally:
            puller.close()
    assert late == [], f"withdraw() said 0 in flight, then a push of that offer started: {late[:5]}"
