"""A decode reading (pulling) a request's KV blocks itself instead of asking the prefill to push
them (flagcx_mesh.vllm.transfer, module docstring): when it may, when it may not, what the
prefill releases on a pull's ack (``A`` with ``readers``), and the acks that come before the
prefill's hold(). One process, KVTransfer agents over cma (host memory), torch CPU tensors.

Skipped without torch, unless FXM_REQUIRE_TORCH=1 (scripts/test.sh sets it)."""

import contextlib
import os
import sys
import threading
import time

import pytest

if os.environ.get("FXM_REQUIRE_TORCH") != "1":
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
import torch  # noqa: E402

from flagcx_mesh.vllm import protocol  # noqa: E402
from flagcx_mesh.vllm.transfer import PULL_PATHS, KVTransfer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vllm_kv import as_bytes, block_matches, fill_block, make_kv_caches, pattern  # noqa: E402,F401
from kv_transfer_util import (SECRET, NUM_BLOCKS, fill_all, fill_heads, heads_match, only_these_blocks,  # noqa: E402,F401
                              transfer_pair, wait_for)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]

pytestmark = pytest.mark.timeout(120)


def block_bytes(heads):
    return heads * 16 * (2 * 16) * 2  # heads * block_size * (2 * head_size) * fp16 (make_kv_caches' defaults)


def far():
    """A hold that lasts: 600 s of the prefill's wall clock ahead."""
    return time.time() + 600


# ---- helpers (as in test_vllm_transfer.py) ----------------------------------------------

def wait_until(cond, what, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.005)


@contextlib.contextmanager
def thread_held(x, monkeypatch):
    """x's transfer thread held at its next step until the block ends (as when a busy engine
    thread keeps the interpreter lock from it), then stepping on."""
    stopped, resume = threading.Event(), threading.Event()
    step = x._step

    def held(*a):
        stopped.set()
        resume.wait(60)
        step(*a)

    monkeypatch.setattr(x, "_step", held)
    try:
        assert stopped.wait(10), "the transfer thread did not come back to its step"
        yield
    finally:
        resume.set()


def not_within(x, what, key, seconds):
    """Polls x for ``seconds``: True where ``key`` never appeared in ``what``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if key in getattr(x.poll(), what):
            return False
        time.sleep(0.01)
    return True


def nonzero_blocks(kv) -> set:
    return {(li, b) for li, t in enumerate(kv.values()) for b in range(t.shape[0]) if as_bytes(t[b]).any()}


def count_messages(x):
    """Counts the kinds of the well-formed notifications x's thread handles (set before any
    peer connects: the thread looks the handler up on the instance for each notification)."""
    seen = {}
    handle = x._on_notification

    def counting(peer, incarnation, data):
        try:
            kind = protocol.decode(data)[0]
        except protocol.ProtocolViolation:
            kind = "?"
        seen[kind] = seen.get(kind, 0) + 1
        return handle(peer, incarnation, data)

    x._on_notification = counting
    return seen


def fetch_and_wait(dec, tag, pre, req, remote, local, **kw):
    """Fetches and waits for the report; then, where both pull, until the decode's thread took the
    prefill's layout (it came before the push's D, which the core reports without that thread: a
    next fetch issued at once would otherwise be pushed for want of it, a race of tests alone)."""
    dec.fetch(tag, pre.metadata, req, remote, local, **kw)
    failed = wait_for(dec, "recving", tag)
    if dec.pull and pre.pull:
        wait_until(lambda: layout_taken(dec, pre), "the decode took the prefill's layout")
    return failed


def layout_taken(dec, pre) -> bool:
    """Whether dec's thread took pre's layout and readied its pulls (_ready_pulls: the path found
    not to suit a pull, or the plans made)."""
    return any(k[0] == pre.agent.name and (k in dec._plans or dec._pull_path.get(k) is False)
               for k in list(dec._peer_layouts))


# ---- one decode -------------------------------------------------------------------------

def test_the_first_request_on_a_connection_is_pushed_the_second_pulled(pair):
    """The first fetch has no prefill layout yet (pushed, though its hold lasts); the prefill's
    layout answers the decode's on that connection, so the second is read by the decode: no
    want, no push. Every block of both lands byte for byte, no other block changes, and the
    pull's ack releases the second request at the prefill."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    pre_msgs = count_messages(pre)
    fill_all(pkv)
    pre.hold("r1", [3, 4, 9])
    assert fetch_and_wait(dec, "t1", pre, "r1", [3, 4, 9], [0, 1, 2], hold_until=far()) == {}
    wait_for(pre, "sending", "r1")
    assert pre.stats()["pushes"] == 1 and dec.stats()["pulls"] == 0
    seconds = dec.stats()["fetch_seconds"]
    assert list(dec._peer_layouts) == [(pre.name, pre.agent.incarnation)]  # came before the push's D
    pre.hold("r2", [12, 5, 6])
    assert fetch_and_wait(dec, "t2", pre, "r2", [12, 5, 6], [7, 8], hold_until=far()) == {}  # the tail: 5, 6
    assert only_these_blocks(dkv, [{0: 3, 1: 4, 2: 9, 7: 5, 8: 6}] * 2) == []
    wait_for(pre, "sending", "r2")  # released by the pull's ack
    ps, ds = pre.stats(), dec.stats()
    assert ps["pushes"] == 1 and ps["pushes_done"] == 1 and ps["bytes_pushed"] == 2 * 3 * block_bytes(2), ps
    assert ps["released_served"] == 2 and ps["refused"] == 0, ps
    assert ds["pulls"] == 1 and ds["bytes_pulled"] == 2 * 2 * block_bytes(2), ds
    assert ds["fetches_done"] == 2 and ds["fetches_failed"] == 0 and ds["fetch_seconds"] > seconds > 0, ds
    assert pre_msgs == {"L": 1, "W": 1, "A": 2}, pre_msgs  # no want for the pulled one
    assert not pre.busy() and not dec.busy()


def test_without_hold_until_every_request_is_pushed(pair):
    """hold_until not given (0: the prefill's hold is not known to last): every request is
    pushed, though the decode knows the prefill's layout from the first on."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    fill_all(pkv)
    for i in range(3):
        pre.hold(f"r{i}", [10 + i])
        assert fetch_and_wait(dec, f"t{i}", pre, f"r{i}", [10 + i], [i]) == {}
        wait_for(pre, "sending", f"r{i}")
    assert dec._peer_layouts  # it could have read them
    assert only_these_blocks(dkv, [{0: 10, 1: 11, 2: 12}] * 2) == []
    assert pre.stats()["pushes"] == 3 and pre.stats()["pushes_done"] == 3, pre.stats()
    assert dec.stats()["pulls"] == 0 and dec.stats()["bytes_pulled"] == 0 and dec.stats()["fetches_done"] == 3


@pytest.mark.parametrize("decode_kw, hold_for, pulled", [
    (dict(pull_margin=10), 5, False),
    (dict(pull_margin=1), 5, True),
    (dict(pull=False), 600, False),
    (dict(), -1, False),
    (dict(), float("nan"), False),
], ids=["hold-within-the-margin", "hold-past-a-smaller-margin", "pull-off", "hold-over", "hold-nan"])
def test_a_short_hold_or_pull_off_is_pushed(pair, decode_kw, hold_for, pulled):
    """The second request (the prefill's layout known) is read only where the decode may pull
    and its hold lasts more than pull_margin from now: a hold 5 s ahead is pushed with the
    default 10 s margin and pulled with a 1 s one; pull=False pushes a 600 s hold; a hold
    already over is pushed, and so is a NaN one (no hold known)."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d", **decode_kw)
    fill_all(pkv)
    pre.hold("r1", [3])
    assert fetch_and_wait(dec, "t1", pre, "r1", [3], [0], hold_until=far()) == {}
    pre.hold("r2", [4, 5])
    assert fetch_and_wait(dec, "t2", pre, "r2", [4, 5], [1, 2], hold_until=time.time() + hold_for) == {}
    assert only_these_blocks(dkv, [{0: 3, 1: 4, 2: 5}] * 2) == []
    wait_for(pre, "sending", "r2")
    assert (pre.stats()["pushes"], dec.stats()["pulls"]) == ((1, 1) if pulled else (2, 0)), (pre.stats(), dec.stats())


def test_each_side_handles_one_layout_message_per_connection(pair):
    """The decode's layout goes once, before its first request; the prefill answers it once;
    the decode does not answer the answer (no ping-pong), over pushed and pulled requests."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    layouts = {"p": 0, "d": 0}
    for x, key in ((pre, "p"), (dec, "d")):
        on_layout = x._on_layout

        def counting(peer, incarnation, f, on_layout=on_layout, key=key):
            layouts[key] += 1
            return on_layout(peer, incarnation, f)

        x._on_layout = counting
    dec_msgs = count_messages(dec)
    fill_all(pkv)
    received = {}
    for i in range(5):
        pre.hold(f"r{i}", [10 + i])
        assert fetch_and_wait(dec, f"t{i}", pre, f"r{i}", [10 + i], [i], hold_until=far() if i % 2 else 0) == {}
        wait_for(pre, "sending", f"r{i}")
        received[i] = 10 + i
    time.sleep(0.3)  # a layout sent back and forth would have come by now
    assert layouts == {"p": 1, "d": 1}
    assert dec_msgs == {"L": 1}, dec_msgs  # r0, r2, r4 pushed (their D the core's: _await_done); r1, r3 pulled
    assert dec.stats()["pulls"] == 2 and pre.stats()["pushes"] == 3
    assert only_these_blocks(dkv, [received] * 2) == []


# ---- several decode ranks: the prefill waits for every reader ---------------------------

def hetero(pair, **pre_kw):
    """A prefill of 4 KV heads, two decode ranks of 2 each (slices 0 and 1 of its heads), every
    head of every prefill block its own pattern; a warm-up request (pushed) lets each decode
    learn the prefill's layout: it lands in block 9 of each."""
    pre, pkv = pair("p", heads=4, hold_timeout=60, **pre_kw)
    d0, kv0 = pair("d0", heads=2)
    d1, kv1 = pair("d1", heads=2)
    fill_heads(pkv, lambda li, b, h: f"{li}/{b}/{h}")
    pre.hold("w", [15])
    for d, i in ((d0, 0), (d1, 1)):
        assert fetch_and_wait(d, "tw", pre, "w", [15], [9], part=(i, 2, 0, 1), hold_until=far()) == {}
    wait_for(pre, "sending", "w")
    assert pre.stats()["pushes"] == 2 and d0._peer_layouts and d1._peer_layouts
    return pre, d0, kv0, d1, kv1


def check_slices(kv, i, received):
    """Decode rank i's blocks: ``received`` {block: prefill block} holds heads 2i, 2i + 1 of it
    (block 9 the warm-up's), every other block zero."""
    for dst, src in {**received, 9: 15}.items():
        assert heads_match(kv, dst, lambda li, h: f"{li}/{src}/{h + 2 * i}"), (i, dst)
    assert nonzero_blocks(kv) == {(li, b) for li in range(2) for b in list(received) + [9]}


def test_two_decode_ranks_each_pull_half_the_heads_and_the_prefill_waits_for_both(pair):
    """Another TP size, pulled: each decode reads its slice of the prefill's heads; the first
    decode's ack (readers 2) does not release the blocks, the second's does."""
    pre, d0, kv0, d1, kv1 = hetero(pair)
    pre.hold("r", [5, 6])
    assert fetch_and_wait(d0, "t", pre, "r", [5, 6], [1, 2], part=(0, 2, 0, 1), hold_until=far()) == {}
    check_slices(kv0, 0, {1: 5, 2: 6})
    assert not_within(pre, "sending", "r", 0.5), "released after one of two readers"
    assert pre._held["r"].acked == {d0.name}
    assert fetch_and_wait(d1, "t", pre, "r", [5, 6], [3, 4], part=(1, 2, 0, 1), hold_until=far()) == {}
    check_slices(kv1, 1, {3: 5, 4: 6})
    wait_for(pre, "sending", "r")
    for d in (d0, d1):
        assert d.stats()["pulls"] == 1 and d.stats()["bytes_pulled"] == 2 * 2 * block_bytes(2), d.stats()
    assert pre.stats()["pushes"] == 2 and pre.stats()["released_served"] == 2, pre.stats()


def test_one_decode_rank_pulls_from_two_prefill_ranks_into_halves_of_its_heads(pair):
    """Decode TP 1 (4 heads) from prefill TP 2 (2 heads each): parts (0, 1, 0, 2) and (0, 1, 1, 2),
    the pull's swapped part (0, 2, 0, 1) / (1, 2, 0, 1); after a warm-up request each prefill
    rank's second request is read by the decode, every head lands where it belongs, and each
    prefill rank releases it on its ack."""
    p0, pkv0 = pair("p0", heads=2, hold_timeout=60)
    p1, pkv1 = pair("p1", heads=2, hold_timeout=60)
    dec, dkv = pair("d", heads=4)
    fill_heads(pkv0, lambda li, b, h: f"{li}/{b}/{h}")
    fill_heads(pkv1, lambda li, b, h: f"{li}/{b}/{h + 2}")
    for req, src, dst in (("w", [15], [9]), ("r", [5, 6], [1, 2])):
        for i, p in enumerate((p0, p1)):
            p.hold(req, src)
            assert fetch_and_wait(dec, f"{req}#{i}", p, req, src, dst, part=(0, 1, i, 2), hold_until=far()) == {}
    assert dec.stats()["pulls"] == 2 and p0.stats()["pushes"] == p1.stats()["pushes"] == 1, dec.stats()
    for dst, src in {1: 5, 2: 6, 9: 15}.items():
        assert heads_match(dkv, dst, lambda li, h: f"{li}/{src}/{h}"), dst
    for p in (p0, p1):
        wait_for(p, "sending", "r")


def test_two_decode_ranks_each_pull_a_replicated_head_whole_and_the_prefill_waits_for_both(pair):
    """1 KV head, decode at TP 2: both ranks read the prefill's blocks whole (part whole,
    readers=2 given); the first pull's ack alone does not release them."""
    pre, pkv = pair("p", heads=1, hold_timeout=60)
    d0, kv0 = pair("d0", heads=1)
    d1, kv1 = pair("d1", heads=1)
    fill_all(pkv)
    pre.hold("w", [15])
    for d in (d0, d1):
        assert fetch_and_wait(d, "tw", pre, "w", [15], [9], readers=2, hold_until=far()) == {}
    wait_for(pre, "sending", "w")
    pre.hold("r", [5, 6])
    assert fetch_and_wait(d0, "t", pre, "r", [5, 6], [1, 2], readers=2, hold_until=far()) == {}
    assert not_within(pre, "sending", "r", 0.5), "released after one of two readers"
    assert fetch_and_wait(d1, "t", pre, "r", [5, 6], [3, 4], readers=2, hold_until=far()) == {}
    wait_for(pre, "sending", "r")
    assert only_these_blocks(kv0, [{9: 15, 1: 5, 2: 6}] * 2) == []
    assert only_these_blocks(kv1, [{9: 15, 3: 5, 4: 6}] * 2) == []
    for d in (d0, d1):
        assert d.stats()["pulls"] == 1 and d.stats()["bytes_pulled"] == 2 * 2 * block_bytes(1), d.stats()
    assert pre.stats()["pushes"] == 2, pre.stats()


def test_an_ack_before_the_hold_counts_once_the_hold_comes(pair):
    """A decode rank reads a request the prefill wrote but has not hold()-ed yet (readers 2):
    its ack is kept; at the hold the blocks stay held for the second reader, and are released
    once that one read them too."""
    pre, d0, kv0, d1, kv1 = hetero(pair)
    d0.fetch("t", pre.metadata, "r2", [5, 6], [1, 2], part=(0, 2, 0, 1), readers=2, hold_until=far())
    assert wait_for(d0, "recving", "t") == {}
    check_slices(kv0, 0, {1: 5, 2: 6})
    wait_until(lambda: "r2" in pre._early_acks, "the prefill got the early ack")
    pre.hold("r2", [5, 6])
    assert not_within(pre, "sending", "r2", 1.0), "released at the hold with one of two readers' acks"
    assert "r2" in pre._held and not pre._early_acks
    d1.fetch("t", pre.metadata, "r2", [5, 6], [3, 4], part=(1, 2, 0, 1), readers=2, hold_until=far())
    assert wait_for(d1, "recving", "t") == {}
    check_slices(kv1, 1, {3: 5, 4: 6})
    wait_for(pre, "sending", "r2", timeout=10)
    assert not pre.busy()


def test_acks_of_every_reader_before_the_hold_release_it_at_the_hold(pair):
    """Both decode ranks read the request before the prefill's hold(): the hold releases it at
    once."""
    pre, d0, kv0, d1, kv1 = hetero(pair)
    for d, i in ((d0, 0), (d1, 1)):
        d.fetch("t", pre.metadata, "r2", [5, 6], [1, 2], part=(i, 2, 0, 1), readers=2, hold_until=far())
        assert wait_for(d, "recving", "t") == {}
    check_slices(kv0, 0, {1: 5, 2: 6})
    check_slices(kv1, 1, {1: 5, 2: 6})
    wait_until(lambda: pre._early_acks.get("r2", (set(),))[0] == {d0.name, d1.name}, "both early acks")
    pre.hold("r2", [5, 6])
    assert pre.poll(timeout=5).sending == {"r2"}
    assert not pre.busy() and not pre._early_acks


def test_a_single_reader_s_ack_before_the_hold_releases_it_at_the_hold(pair):
    """One decode (readers 1) reads a request before the prefill's hold(): the request is
    remembered as taken, and the hold releases it at once."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    fill_all(pkv)
    pre.hold("w", [15])
    assert fetch_and_wait(dec, "tw", pre, "w", [15], [9], hold_until=far()) == {}
    wait_for(pre, "sending", "w")
    assert fetch_and_wait(dec, "t", pre, "r2", [5, 6], [1, 2], hold_until=far()) == {}
    assert dec.stats()["pulls"] == 1
    assert only_these_blocks(dkv, [{9: 15, 1: 5, 2: 6}] * 2) == []
    wait_until(lambda: "r2" in pre._gone, "the prefill got the ack")
    assert not pre._early_acks
    pre.hold("r2", [5, 6])
    assert pre.poll(timeout=5).sending == {"r2"}
    assert not pre.busy()
    assert pre.stats()["released_served"] == 2, pre.stats()  # "w", and "r2" at its hold


# ---- what a pull carries, and where it cannot ---------------------------------------------

def test_two_kv_cache_groups_are_pulled_each_layer_by_its_groups_blocks(pair):
    """A hybrid model (layer 0 in group 0, layer 1 in group 1), pulled: each layer's blocks are
    read by its own group's ids, no other block of it is touched."""
    by_group = {LAYERS[0]: 0, LAYERS[1]: 1}
    pre, pkv = pair("p", layer_groups=by_group, hold_timeout=60)
    dec, dkv = pair("d", layer_groups=by_group)
    fill_all(pkv)
    pre.hold("w", [[0], [15]])
    assert fetch_and_wait(dec, "tw", pre, "w", [[0], [15]], [[0], [15]], hold_until=far()) == {}
    held = [[1, 2, 3, 4], [9, 10]]
    pre.hold("r", held)
    local = [[5, 6, 7], [12, 13]]  # the decode had group 0's first block in its prefix cache
    assert fetch_and_wait(dec, "t", pre, "r", held, local, hold_until=far()) == {}
    assert only_these_blocks(dkv, [{0: 0, 5: 2, 6: 3, 7: 4}, {15: 15, 12: 9, 13: 10}]) == []
    wait_for(pre, "sending", "r")
    assert dec.stats()["pulls"] == 1 and dec.stats()["bytes_pulled"] == (3 + 2) * block_bytes(2), dec.stats()
    assert pre.stats()["pushes"] == 1


def test_a_pull_into_a_kv_cache_that_does_not_fit_fails_with_its_blocks(pair):
    """A decode of 4 heads a block from a prefill of 2: the push is refused, and the pull (the
    prefill's layout known by then) fails at the decode, with its block ids, before any byte
    moves; the thread goes on."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d", heads=4)
    fill_all(pkv)
    pre.hold("r1", [3])
    assert fetch_and_wait(dec, "t1", pre, "r1", [3], [0], hold_until=far()) == {"t1": [0]}  # refused
    assert dec._peer_layouts
    pre.hold("r2", [4, 5])
    assert fetch_and_wait(dec, "t2", pre, "r2", [4, 5], [1, 2], hold_until=far()) == {"t2": [1, 2]}
    assert nonzero_blocks(dkv) == set()
    assert dec.alive() and pre.alive()
    ds = dec.stats()
    assert ds["pulls"] == 0 and ds["bytes_pulled"] == 0 and ds["fetches_failed"] == 2 and ds["fetches_done"] == 0, ds
    assert pre.stats()["refused"] == 1 and pre.stats()["pushes"] == 0, pre.stats()


def test_over_tcp_the_second_request_is_pushed(pair, monkeypatch):
    """FLAGCX_MESH_TRANSPORT=tcp: the path between the KV caches waits on a network (not in
    PULL_PATHS), so a request whose prefill layout is known and whose hold lasts is pushed."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    fill_all(pkv)
    for i in range(2):
        pre.hold(f"r{i}", [10 + i])
        assert fetch_and_wait(dec, f"t{i}", pre, f"r{i}", [10 + i], [i], hold_until=far()) == {}
        wait_for(pre, "sending", f"r{i}")
    assert dec._peer_layouts and list(dec._pull_path.values()) == [False]
    conn = dec.agent.connection(pre.name)
    assert conn.path_to(pre._regions[0].descriptor, dec._regions[0].descriptor) not in PULL_PATHS
    assert only_these_blocks(dkv, [{0: 10, 1: 11}] * 2) == []
    assert dec.stats()["pulls"] == 0 and pre.stats()["pushes"] == 2


def test_over_cma_the_path_is_one_to_pull_on():
    """The premise of the other tests: host memory of two agents of one process takes cma, a
    path in PULL_PATHS (tcp is not)."""
    assert "cma" in PULL_PATHS and "tcp" not in PULL_PATHS and "ucx" not in PULL_PATHS


# ---- the ack's readers --------------------------------------------------------------------

def test_protocol_ack_with_readers():
    """An A may carry readers (an integer >= 0); anything else there is a protocol violation."""
    assert protocol.decode(protocol.encode("A", req="r", readers=3)) == ("A", {"req": "r", "readers": 3})
    assert protocol.decode(protocol.encode("A", req="r")) == ("A", {"req": "r"})
    for bad in ("x", -1, True, [2], None):
        with pytest.raises(protocol.ProtocolViolation, match="'readers' is not an integer >= 0"):
            protocol.decode(protocol.encode("A", req="r", readers=bad))
    with pytest.raises(protocol.ProtocolViolation, match="not an integer"):
        protocol.decode(protocol.encode("A", req="r", readers=1.5))



# ---- a read in flight: the core's puller ----------------------------------------------

class Gate:
    """Holds the decode's pulls before the core's puller issues them: until ``open`` is set no
    byte moves and no ack goes, which is what the prefill and the caller see of a device read
    still copying. ``fail``: each read then names the decode's own regions as the prefill's, so
    the core refuses it (a read that fails for real: the core sends the prefill its C)."""

    def __init__(self, dec, fail=False):
        self.open, self.fail, self.reads = threading.Event(), fail, 0
        real, gate = dec._puller, self

        class Held:
            def submit(self, token, conn, local, remote, groups, on_landed=None, on_failed=None):
                gate.reads += 1
                args = (token, conn, local, local if gate.fail else remote, groups, on_landed, on_failed)
                threading.Thread(target=lambda: gate.open.wait(60) and real.submit(*args), daemon=True).start()

            def __getattr__(self, name):
                return getattr(real, name)

        dec._puller = Held()


def warm(pre, dec, pkv):
    """One pushed request, so that the decode knows the prefill's layout."""
    fill_all(pkv)
    pre.hold("w", [15])
    assert fetch_and_wait(dec, "tw", pre, "w", [15], [15], hold_until=far()) == {}
    wait_for(pre, "sending", "w")


def read_in_flight(pair, fail=False):
    """A pull of request r2 (prefill blocks 4, 5 into decode blocks 1, 2) issued, its read held
    by a Gate: (prefill, decode, the decode's KV caches, the gate)."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    warm(pre, dec, pkv)
    gate = Gate(dec, fail)
    pre.hold("r2", [4, 5])
    dec.fetch("t2", pre.metadata, "r2", [4, 5], [1, 2], hold_until=far())
    wait_until(lambda: gate.reads == 1, "the read was issued")
    return pre, dec, dkv, gate


def test_a_pull_runs_without_the_transfer_thread(pair, monkeypatch):
    """Once a prefill's layout and connection are known, fetch() starts the pull on its own
    thread and the core reads, acks and posts it: the request is read, reported by poll() and
    released at the prefill while the decode's transfer thread does nothing at all (as when a
    busy engine thread keeps the interpreter lock from it)."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    warm(pre, dec, pkv)
    with thread_held(dec, monkeypatch):
        pre.hold("r2", [4, 5])
        dec.fetch("t2", pre.metadata, "r2", [4, 5], [1, 2], hold_until=far())
        assert wait_for(dec, "recving", "t2", timeout=10) == {}
        wait_for(pre, "sending", "r2", timeout=10)
        assert dec.stats()["pulls"] == 1 and dec._commands.empty()
        assert only_these_blocks(dkv, [{15: 15, 1: 4, 2: 5}] * 2) == []


def test_a_push_runs_without_the_transfer_thread(pair, monkeypatch):
    """A fetch that is pushed (no hold given) to a prefill an earlier fetch connected to: fetch()
    sends the want itself and the core awaits the D (its exact bytes), sends the A and posts the
    outcome, so the request is pushed, reported by poll() and released at the prefill while the
    decode's transfer thread does nothing at all (as when a busy engine thread keeps the
    interpreter lock from it; before, that thread took the D)."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    warm(pre, dec, pkv)
    with thread_held(dec, monkeypatch):
        pre.hold("r2", [4, 5])
        dec.fetch("t2", pre.metadata, "r2", [4, 5], [1, 2])
        assert wait_for(dec, "recving", "t2", timeout=10) == {}
        wait_for(pre, "sending", "r2", timeout=10)
        assert pre.stats()["pushes_done"] == 2 and dec._commands.empty()
        assert only_these_blocks(dkv, [{15: 15, 1: 4, 2: 5}] * 2) == []
    assert dec.stats()["pulls"] == 0 and dec.stats()["fetches_done"] == 2


# ---- a push's D awaited by the core: a prefill of its own, played by a bare agent ------------

def want_of(fake, timeout=20.0):
    """(the decode agent's name, the W it sent the fake prefill), past its L."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for n in fake.notifications(timeout=0.2):
            kind, f = protocol.decode(n.data)
            if kind == "W":
                return n.peer, f
    raise AssertionError("no W came")


def polled_all(x, timeout=3.0):
    """Every request x reports within ``timeout``, polled now and then (a busy engine's steps)."""
    recving, failed, end = set(), {}, time.monotonic() + timeout
    while time.monotonic() < end:
        d = x.poll()
        recving |= set(d.recving)
        failed.update(d.failed)
        time.sleep(0.05)
    return recving, failed


@pytest.mark.parametrize("thread", ["running", "held"])
@pytest.mark.parametrize("late_poll", [0.0, 0.5])
def test_a_push_whose_done_came_is_received_though_the_prefill_left_before_the_poll(pair, monkeypatch,
                                                                                     thread, late_poll):
    """The prefill sends its D (every byte landed) and leaves at once; the engine polls later. The
    request is received: the D came before the connection's end (its A cannot go, and need not).
    Before the mend the transfer thread failed it for its connection gone before the poll took
    the core's outcome, and the core failed it for its ack that could not go."""
    from flagcx_mesh import Agent

    dec, _ = pair("d", fetch_timeout=60)
    fake = Agent("fake-prefill", SECRET, timeout=20)
    try:
        dec.fetch("t", fake.metadata(), "r", [3], [2])
        peer, w = want_of(fake)
    except BaseException:
        fake.close()
        raise
    with thread_held(dec, monkeypatch) if thread == "held" else contextlib.nullcontext():
        try:
            fake.connection(peer).notify(protocol.encode("D", tag=w["tag"], n=w["n"]))
        finally:
            fake.close()
        time.sleep(late_poll)
        assert polled_all(dec) == ({"t"}, {}), dec.stats()


def test_a_done_of_other_bytes_is_taken_by_the_thread_by_its_tag_and_nonce(pair):
    """A D whose bytes are not the ones the core awaits (its fields in another order, as another
    encoder may write them) reaches the transfer thread, which takes it by tag and nonce: received,
    its A sent, the core's wait taken back."""
    from flagcx_mesh import Agent

    dec, _ = pair("d", fetch_timeout=60)
    fake = Agent("fake-prefill", SECRET, timeout=20)
    try:
        dec.fetch("t", fake.metadata(), "r", [3], [2])
        peer, w = want_of(fake)
        fake.connection(peer).notify(protocol.MAGIC + b'D{"n":%d,"tag":"t"}' % w["n"])
        assert polled_all(dec) == ({"t"}, {})
        acks = [protocol.decode(n.data) for n in fake.notifications(timeout=1.0)]
        assert ("A", {"req": "r"}) in acks, acks
        assert not dec._pulling, dec._pulling
    finally:
        fake.close()


def test_a_cancelled_push_is_reported_at_its_done_and_a_refetch_of_its_id_waits_its_turn(pair):
    """A cancelled push is reported once its D came (bytes may land until then), with no A; the
    fetch of the same id asked meanwhile goes after it with a new nonce; a late copy of the first
    D is dropped; the second's D is received and acked."""
    from flagcx_mesh import Agent

    dec, _ = pair("d", fetch_timeout=60)
    fake = Agent("fake-prefill", SECRET, timeout=20)
    try:
        dec.fetch("t", fake.metadata(), "r1", [3], [2])
        peer, w1 = want_of(fake)
        conn = fake.connection(peer)
        dec.cancel("t")
        dec.fetch("t", fake.metadata(), "r2", [4], [5])
        time.sleep(0.5)
        assert dec.poll().recving == set()  # the cancelled push may still land
        conn.notify(protocol.encode("D", tag="t", n=w1["n"]))
        assert dec.poll(timeout=5).recving == {"t"}
        _, w2 = want_of(fake)
        assert w2["req"] == "r2" and w2["n"] != w1["n"]
        conn.notify(protocol.encode("D", tag="t", n=w1["n"]))  # a late copy of the first
        time.sleep(0.3)
        assert dec.poll().recving == set()
        conn.notify(protocol.encode("D", tag="t", n=w2["n"]))
        d = dec.poll(timeout=5)
        assert d.recving == {"t"} and d.failed == {}, d
        acks = [protocol.decode(n.data) for n in fake.notifications(timeout=1.0)]
        assert acks == [("A", {"req": "r2"})], acks  # none for the cancelled one
        assert not dec._pulling and not dec._fetches and dec.stats()["unexpected_answers"] == 1
    finally:
        fake.close()


def test_a_layout_dropped_while_fetch_decides_raises_nothing_into_the_caller(pair, monkeypatch):
    """The transfer thread may drop a prefill's layout (a newer incarnation's came, its connection
    ended) while fetch() decides on its own thread: fetch() used what it had read (a KeyError
    reached the caller before) and the request is read and reported."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    warm(pre, dec, pkv)
    real = dec._may_pull

    def then_the_layout_goes(f, key, layout):
        ok = real(f, key, layout)
        dec._peer_layouts.pop(key, None)  # as the thread may, right now
        return ok

    monkeypatch.setattr(dec, "_may_pull", then_the_layout_goes)
    pre.hold("r2", [4, 5])
    dec.fetch("t2", pre.metadata, "r2", [4, 5], [1, 2], hold_until=far())
    assert wait_for(dec, "recving", "t2", timeout=10) == {}
    assert only_these_blocks(dkv, [{15: 15, 1: 4, 2: 5}] * 2) == []


class _Dying:
    """A fetch's connection alive for fetch()'s check and gone right after; its W fails only once
    the transfer thread saw it gone (the prefill died while fetch() sent the want)."""

    def __init__(self, conn, dec, tag, seen):
        self._c, self._dec, self._tag, self._seen = conn, dec, tag, seen
        self._checks = 0

    def __getattr__(self, name):
        return getattr(self._c, name)

    def gone(self):
        self._checks += 1
        return "" if self._checks == 1 else "the peer died"

    def notify(self, msg):
        from flagcx_mesh.errors import PeerLost

        if protocol.decode(msg)[0] == "W":
            end = time.monotonic() + 10
            while self._tag in self._dec._fetches and time.monotonic() < end:
                time.sleep(0.001)
            # a poll meanwhile: the thread's failure is reported just after it drops the fetch
            self._seen.append(set(self._dec.poll(timeout=10).recving))
            raise PeerLost("the peer died")
        return self._c.notify(msg)


def test_a_want_failed_by_both_threads_is_reported_once(pair, monkeypatch):
    """fetch() sends a push's want while the transfer thread finds the connection gone: both fail
    the fetch; it is reported and counted once (twice before). (A push whose D the core awaits
    is failed by the core, not by that thread, when its connection ends: the core's wait is left
    out here, as where the puller could not take it.)"""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    warm(pre, dec, pkv)
    monkeypatch.setattr(dec, "_await_done", lambda f, conn, want: None)
    md = bytes(pre.metadata)
    real, seen = dec._conn_of[md], []
    proxy = _Dying(real, dec, "t2", seen)
    dec._conn_of[md] = proxy
    dec._layout_sent = {(real.peer_name, real.peer_incarnation): proxy}
    before = dec.stats()["fetches_failed"]
    dec.fetch("t2", md, "r2", [4, 5], [1, 2])  # pushed: the want goes from here
    again = dec.poll(timeout=2).recving
    assert seen == [{"t2"}] and "t2" not in again, (seen, again)
    assert dec.stats()["fetches_failed"] - before == 1


def test_a_pull_is_reported_only_once_its_read_is_over_and_the_thread_serves_on_meanwhile(pair):
    """While a pull's read is in flight the request is not reported and the prefill keeps its
    blocks (no ack yet); the transfer thread meanwhile serves another fetch (pushed: no hold
    given). Once the read is over the ack goes and the request is reported, its bytes right."""
    pre, dec, dkv, gate = read_in_flight(pair)
    pre.hold("r3", [6])
    assert fetch_and_wait(dec, "t3", pre, "r3", [6], [3]) == {}  # pushed while t2's read is held
    assert not_within(dec, "recving", "t2", 0.5) and not_within(pre, "sending", "r2", 0.2)
    gate.open.set()
    assert wait_for(dec, "recving", "t2") == {}
    wait_for(pre, "sending", "r2")
    assert only_these_blocks(dkv, [{15: 15, 1: 4, 2: 5, 3: 6}] * 2) == []
    assert dec.stats()["pulls"] == 1 and pre.stats()["pushes"] == 2


def test_a_failed_read_fails_its_request_once_over_and_the_prefill_is_told_to_release(pair):
    """A read that ends in an error: the request is reported failed (its local blocks), only
    once the read is over, and the prefill releases the blocks on the decode's C (no ack)."""
    pre, dec, _, gate = read_in_flight(pair, fail=True)
    assert not_within(dec, "recving", "t2", 0.5)
    gate.open.set()
    assert wait_for(dec, "recving", "t2") == {"t2": [1, 2]}
    wait_for(pre, "sending", "r2")
    assert pre.stats()["released_cancelled"] == 1 and dec.stats()["pulls"] == 0, (pre.stats(), dec.stats())


def test_a_request_cancelled_while_its_read_is_in_flight_is_reported_once_the_read_is_over(pair):
    """cancel() during a pull: the prefill is told at once (it releases), and the request is
    reported received (as cancelled, no failed blocks) only once no byte of the read can land."""
    pre, dec, _, gate = read_in_flight(pair)
    dec.cancel("t2")
    wait_for(pre, "sending", "r2")
    assert not_within(dec, "recving", "t2", 0.5)
    gate.open.set()
    assert wait_for(dec, "recving", "t2") == {}
    assert dec.stats()["pulls"] == 0


def test_a_request_fetched_again_while_its_cancelled_read_is_in_flight_is_reported_on_its_own(pair):
    """A request cancelled during its pull and fetched again (vLLM may reuse a request id; the
    second pushed here: no hold given): the first is reported (cancelled) once its read is over,
    and that report drops no other fetch than its own; the second is asked for then, served and
    reported on its own, its answer awaited (not an unexpected one)."""
    pre, dec, dkv, gate = read_in_flight(pair)
    dec.cancel("t2")
    dec.fetch("t2", pre.metadata, "r3", [6], [3])
    wait_for(pre, "sending", "r2")  # the first's C
    assert not_within(dec, "recving", "t2", 0.3)
    gate.open.set()
    assert wait_for(dec, "recving", "t2") == {}  # the first: cancelled, no failed blocks
    pre.hold("r3", [6])
    assert wait_for(dec, "recving", "t2", timeout=10) == {}  # the second: its blocks landed
    wait_for(pre, "sending", "r3")
    assert only_these_blocks(dkv, [{15: 15, 1: 4, 2: 5, 3: 6}] * 2) == []
    ds = dec.stats()
    assert ds["fetches_done"] == 2 and ds["fetches_failed"] == 1 and ds["unexpected_answers"] == 0, ds
    wait_until(lambda: not dec.busy(), "the decode has nothing left under way")


def test_a_second_fetch_of_a_request_cancelled_while_it_waits_for_the_first_is_reported_at_once(pair):
    """The second fetch of a request id waits for the first (cancelled, its read in flight); a
    cancel meanwhile reports it at once (it asked for nothing: no byte can land) and tells its
    prefill to release; the first is still reported only once its read is over."""
    pre, dec, dkv, gate = read_in_flight(pair)
    pre_msgs = count_messages(pre)
    dec.cancel("t2")
    pre.hold("r3", [6])
    dec.fetch("t2", pre.metadata, "r3", [6], [3])
    dec.cancel("t2")
    assert wait_for(dec, "recving", "t2") == {}  # the second, the first's read still held
    released = set()
    wait_until(lambda: released.update(pre.poll().sending) or released >= {"r2", "r3"}, "both released")
    assert pre.stats()["released_cancelled"] == 2 and pre.stats()["pushes"] == 1, pre.stats()  # (the warm-up's)
    assert "W" not in pre_msgs, pre_msgs  # the second never asked
    assert not_within(dec, "recving", "t2", 0.3)
    gate.open.set()
    assert wait_for(dec, "recving", "t2") == {}
    assert only_these_blocks(dkv, [{15: 15, 1: 4, 2: 5}] * 2) == []
    assert dec.stats()["fetches_done"] == 1 and dec.stats()["fetches_failed"] == 2, dec.stats()
    wait_until(lambda: not dec.busy(), "the decode has nothing left under way")


def test_a_decode_reads_a_prefill_s_request_once_a_second_ask_is_pushed(pair):
    """The same prefill request fetched again after it was read (and released by the read's
    ack): not read a second time (its blocks may hold another request's KV by now) but asked
    for, and the prefill refuses it: the fetch fails with its blocks, nothing lands."""
    pre, pkv = pair("p", hold_timeout=60)
    dec, dkv = pair("d")
    warm(pre, dec, pkv)
    pre.hold("r2", [4])
    assert fetch_and_wait(dec, "t2", pre, "r2", [4], [1], hold_until=far()) == {}
    wait_for(pre, "sending", "r2")
    assert fetch_and_wait(dec, "t2b", pre, "r2", [4], [2], hold_until=far()) == {"t2b": [2]}
    assert dec.stats()["pulls"] == 1 and pre.stats()["refused"] == 1, (dec.stats(), pre.stats())
    assert only_these_blocks(dkv, [{15: 15, 1: 4}] * 2) == []


def test_an_early_ack_then_a_cancel_leaves_nothing_behind(pair):
    """One of two readers acks a request before the prefill's hold, then a cancel for it comes:
    the kept ack goes with it, and the hold then releases the request at once (cancelled)."""
    pre, _ = pair("p", hold_timeout=60)
    dec, _ = pair("d")
    conn = dec.agent.connect(pre.metadata)
    conn.notify(protocol.encode("A", req="r9", readers=2))
    wait_until(lambda: "r9" in pre._early_acks, "the early ack was kept")
    conn.notify(protocol.encode("C", req="r9"))
    wait_until(lambda: "r9" in pre._gone, "the cancel came")
    assert "r9" not in pre._early_acks
    pre.hold("r9", [3])
    assert pre.poll(timeout=5).sending == {"r9"}
    assert pre.stats()["released_cancelled"] == 1 and pre.stats()["released_served"] == 0, pre.stats()
