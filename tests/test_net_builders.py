"""The builders for identity-less net adaptors (legacy = FlagCX's loop, ordered, tagged) over
the IB-like test adaptor, and the bootstrap's point-to-point relay they use. Ranks are threads
(net_trial releases the GIL) unless a process has to die."""

import re
import subprocess
import threading
import time

import pytest

import flagcx_mesh
from flagcx_mesh import InvalidArgument, MeshTimeout, PeerLost
from flagcx_mesh.errors import PROTOCOL, SYSTEM, TIMEOUT
from flagcx_mesh.netbuild import NetBootstrap, aggregate, build_trial
from meshutil import PY, REPO_ROOT, run_threads, subprocess_env

pytestmark = pytest.mark.timeout(60)


def with_boots(n, fn, timeout=40.0):
    """fn(boot) on n ranks as threads sharing one fresh rendezvous; results in rank order."""
    uid = flagcx_mesh.get_unique_id()

    def body(r):
        boot = NetBootstrap(n, uid, r, 20.0)
        try:
            return fn(boot)
        finally:
            boot.close()

    return run_threads(n, body, timeout=timeout)


def trials(n, builder, count, **kw):
    """`count` trials of `builder` on n thread ranks; per trial the list of rank results."""
    def fn(boot):
        out = []
        for t in range(count):
            boot.barrier(timeout=20)
            delay = kw.get("self_delay", {}).get(boot.rank, 0)
            opts = {k: v for k, v in kw.items() if k != "self_delay"}
            out.append(build_trial(boot, builder, seed=100 * t + boot.rank + 1, self_connect_delay_us=delay,
                                   tag_base=1000 + t * (n + 1), **opts))
        return out

    per_rank = with_boots(n, fn)
    return [[per_rank[r][t] for r in range(n)] for t in range(count)]


# ----------------------------------------------------------------------------- the relay

def test_relay_out_of_order_tags_self_and_stash_during_barrier():
    def fn(boot):
        r, n = boot.rank, boot.nranks
        for tag in (3, 1, 2):
            for p in range(n):
                boot.send(p, tag, b"%d->%d#%d" % (r, p, tag))
        boot.barrier(timeout=10)  # deliveries that arrive meanwhile must wait in the inbox
        got = {(p, tag): boot.recv(p, tag, timeout=10) for p in reversed(range(n)) for tag in (2, 1, 3)}
        return all(v == b"%d->%d#%d" % (p, r, tag) for (p, tag), v in got.items())

    assert with_boots(3, fn) == [True] * 3


def test_relay_limits_bad_peers_and_unbounded_timeouts():
    """Relayed messages are small control data (the root forwards them from one thread): a
    larger one is refused before anything is sent; a recv from a rank outside the bootstrap is
    refused at once; a timeout too large for the clock means no limit, not an instant timeout."""
    def fn(boot):
        other = 1 - boot.rank
        with pytest.raises(InvalidArgument, match="at most 65536"):
            boot.send(other, 5, b"x" * (64 * 1024 + 1))
        t0 = time.monotonic()
        with pytest.raises(InvalidArgument, match="peer outside"):
            boot.recv(7, 5, timeout=10)
        assert time.monotonic() - t0 < 1
        boot.send(other, 5, b"y" * (64 * 1024))
        return boot.recv(other, 5, timeout=1e300) == b"y" * (64 * 1024)

    assert with_boots(2, fn) == [True, True]


def test_root_is_not_held_up_by_a_rank_that_is_not_reading():
    """Rank 0 relays 16 MiB to rank 2, which is busy and reads nothing for a while: the root
    queues it instead of blocking on the write, so ranks 0 and 1 keep talking through it; rank 2
    then gets every message, in order. (With blocking writes the root stalled for its 10 s write
    timeout and then dropped rank 2.)"""
    chunk, count = b"z" * (64 * 1024), 256
    exchanged = threading.Event()

    def fn(boot):
        if boot.rank == 0:
            for i in range(count):
                boot.send(2, 9, chunk[:-4] + i.to_bytes(4, "little"))
            t0 = time.monotonic()
            boot.send(1, 1, b"ping")
            assert boot.recv(1, 2, timeout=30) == b"pong"
            took = time.monotonic() - t0
            exchanged.set()
            return took
        if boot.rank == 1:
            assert boot.recv(0, 1, timeout=30) == b"ping"
            boot.send(0, 2, b"pong")
            return 0.0
        exchanged.wait(30)  # rank 2 reads nothing until ranks 0 and 1 are done
        got = [boot.recv(0, 9, timeout=30) for _ in range(count)]
        assert [int.from_bytes(g[-4:], "little") for g in got] == list(range(count))
        return 0.0

    took = with_boots(3, fn, timeout=60)[0]
    assert took < 5.0, f"ranks 0 and 1 waited {took:.1f} s behind rank 2's queue"


def test_relay_recv_times_out_without_losing_later_messages():
    def fn(boot):
        if boot.rank == 0:
            t0 = time.monotonic()
            with pytest.raises(MeshTimeout) as e:
                boot.recv(1, 7, timeout=0.3)
            assert time.monotonic() - t0 < 3 and "rank 1" in str(e.value) and e.value.peer == 1
            boot.barrier(timeout=10)
            return boot.recv(1, 7, timeout=10)
        boot.barrier(timeout=10)
        boot.send(0, 7, b"late")
        return None

    assert with_boots(2, fn)[0] == b"late"


def test_relay_rejects_bad_peer():
    def fn(boot):
        with pytest.raises(InvalidArgument):
            boot.send(5, 1, b"x")
        with pytest.raises(InvalidArgument):
            boot.send(-1, 1, b"x")
        return True

    assert with_boots(2, fn) == [True, True]


def test_relay_recv_fails_when_the_peer_is_lost():
    """A rank whose process dies (no goodbye) makes a recv from it fail with PeerLost, fast."""
    uid = flagcx_mesh.get_unique_id()
    boot = NetBootstrap(2, uid, 0, 20.0)
    code = ("import os, sys, time; from flagcx_mesh.netbuild import NetBootstrap; "
            "b = NetBootstrap(2, bytes.fromhex(sys.argv[1]), 1, 20.0); time.sleep(0.3); os._exit(3)")
    child = subprocess.Popen([PY, "-c", code, uid.hex()], env=subprocess_env(), cwd=REPO_ROOT)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerLost) as e:
            boot.recv(1, 5, timeout=30)
        assert time.monotonic() - t0 < 15
        assert e.value.peer == 1 and "rank 1" in str(e.value)
    finally:
        child.wait(timeout=20)
        boot.close()


# ----------------------------------------------------------------------------- builders that work

@pytest.mark.parametrize("builder", ["ordered", "tagged"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_fixed_builders_complete_with_correct_wiring_under_jitter(builder, n):
    for t, ranks in enumerate(trials(n, builder, 4, jitter_us=2000, timeout=10.0)):
        for r, res in enumerate(ranks):
            assert res["outcome"] == "completed", (t, r, res)
            assert res["verified"], (t, r, res)  # slot p proved to hold rank p's connection


def test_ordered_without_bytes_builds_and_skips_the_wiring_check():
    for ranks in trials(4, "ordered", 3, jitter_us=1000, timeout=10.0, carry_bytes=False):
        assert [res["outcome"] for res in ranks] == ["completed"] * 4, ranks
        assert not any(res["verified"] for res in ranks)


def test_tagged_without_bytes_is_an_invalid_argument():
    def fn(boot):
        with pytest.raises(InvalidArgument, match="isend/irecv/test"):
            build_trial(boot, "tagged", carry_bytes=False, timeout=5.0)
        return True

    assert with_boots(2, fn) == [True, True]


# ----------------------------------------------------------------------------- the legacy loop

def test_legacy_hang_reproduced_deterministically_at_two_ranks():
    """Rank 1 delays its self-connect, so rank 0's round-1 connection is first in rank 1's accept
    queue: rank 1 files it as its self connection and its own self-connect is never accepted
    (the interleaving of the field report). The deadline reports it on both ranks."""
    (ranks,) = trials(2, "legacy", 1, timeout=1.5, self_delay={1: 300_000})
    r0, r1 = ranks
    assert [r0["outcome"], r1["outcome"]] == ["hung", "hung"], ranks
    assert r0["code"] == r1["code"] == TIMEOUT
    assert "hung in round 0 (connectPeer 1, acceptPeer 1)" in r1["error"]
    assert "sendComm (connect to rank 1) is still NULL" in r1["error"] and r1["peer"] == 1
    assert "hung in round 1 (connectPeer 1, acceptPeer 1)" in r0["error"]
    assert "recvComm (accept from rank 1) is still NULL" in r0["error"] and r0["peer"] == 1
    assert "rank 1 (legacy build" in r1["error"] and "deadline" in r1["error"]
    assert r0["outputs_untouched"] and r1["outputs_untouched"]
    for res in ranks:
        assert res["bad_closes"] == 0 and res["left_open"] == 0, res


TRIALS = 60


def test_legacy_hangs_under_random_jitter():
    """No forced order: with random connect/accept jitter at 4 ranks the loop hangs within a few
    trials (each hung trial costs its 1 s deadline; the others take milliseconds, so up to 60 are
    tried: once, 25 trials on a loaded machine gave 23 completed and 2 miswired builds)."""
    n, outcomes = 4, []
    uid = flagcx_mesh.get_unique_id()

    def fn(r):
        boot = NetBootstrap(n, uid, r, 20.0)
        try:
            for t in range(TRIALS):
                res = build_trial(boot, "legacy", jitter_us=2000, seed=7 * t + r + 1, timeout=1.0,
                                  tag_base=1000 + t * (n + 1))
                seen = [p.decode() for p in boot.allgather(res["outcome"].encode(), timeout=20)]
                if r == 0:
                    outcomes.append(aggregate(seen))
                if "hung" in seen:
                    return t
            return None
        finally:
            boot.close()

    stopped = run_threads(n, fn, timeout=50)
    assert stopped[0] is not None, f"no hang in {TRIALS} trials: {outcomes}"
    assert outcomes[-1] == "hung"


# ----------------------------------------------------------------------------- failures reported

@pytest.mark.parametrize("call, peer_text", [("connect", "adaptor connect (peer rank 1)"),
                                             ("accept", "adaptor accept"),
                                             ("isend", "adaptor isend (wiring check) (peer rank 0)"),
                                             ("listen", "adaptor listen")])
def test_adaptor_call_failure_names_call_and_peer_and_leaves_outputs(call, peer_text):
    """Rank 1's adaptor fails one call: rank 1 reports that call (and the peer) and writes no
    output; rank 0 does not complete either (it waits for rank 1 until its deadline)."""
    def fn(boot):
        fail = call if boot.rank == 1 else ""
        return build_trial(boot, "ordered", timeout=2.0, fail_call=fail, fail_after=0)

    r0, r1 = with_boots(2, fn)
    assert r1["outcome"] == "failed" and r1["code"] == SYSTEM, r1
    assert peer_text in r1["error"] and "returned 42" in r1["error"] and "rank 1 (ordered build" in r1["error"]
    assert r1["outputs_untouched"]
    assert r0["outcome"] != "completed" and r0["outputs_untouched"], r0
    for res in (r0, r1):  # every comm the failed build opened was closed, and only once
        assert res["bad_closes"] == 0 and res["left_open"] == 0, res


@pytest.mark.parametrize("stranger", ["garbage", "silent"])
def test_tagged_closes_strangers_connections_and_completes(stranger, capfd):
    """Each rank first opens one more connection to a peer's listener (its first connect goes
    to rank 0) that sends 64 bytes of garbage, or nothing, as a stranger's socket would. The
    tagged builder files connections by their header: it refuses garbage by name, and a silent
    one does not hold up the mesh; every stranger is closed (left_open == 0). Regression: a
    stranger still unread when the mesh was complete was never closed."""
    for ranks in trials(3, "tagged", 2, jitter_us=500, timeout=10.0, stranger=stranger):
        assert [res["outcome"] for res in ranks] == ["completed"] * 3, ranks
        assert all(res["verified"] and res["bad_closes"] == 0 and res["left_open"] == 0 for res in ranks), ranks
    if stranger == "garbage":
        assert "refused a connection: bad magic" in capfd.readouterr().err


def test_tagged_refuses_a_copied_identity_header_without_the_build_key(capfd):
    """Each rank's stranger connection copies the identity header the rank sends to that
    peer (the build id, source and destination are right, as read off the wire) but cannot
    make its MAC under the build key: refused as bad authentication, the build completes.
    Before the MAC the header alone was the identity: such a copy was filed (or the real one
    refused as a duplicate)."""
    for ranks in trials(3, "tagged", 2, jitter_us=500, timeout=10.0, stranger="forged"):
        assert [res["outcome"] for res in ranks] == ["completed"] * 3, ranks
        assert all(res["left_open"] == 0 for res in ranks), ranks
    err = capfd.readouterr().err
    assert "refused a connection: bad authentication" in err, err[-2000:]
    assert "duplicate" not in err, err[-2000:]


def test_wiring_check_names_a_miswired_slot():
    """Legacy at 8 ranks miswires (or hangs) quickly; a miswire is a ProtocolError naming the slot."""
    found = None
    for ranks in trials(8, "legacy", 12, jitter_us=2000, timeout=1.0):
        for res in ranks:
            if res["outcome"] == "miswired":
                found = res
        if found:
            break
    if found is None:
        pytest.skip("no miswire in 12 trials (all hung); the hang tests cover the loop")
    assert found["code"] == PROTOCOL
    assert re.search(r"miswired: recv slot \d+ holds rank \d+'s connection", found["error"])


@pytest.mark.parametrize("kw, match", [
    (dict(builder="bogus"), "unknown builder"),
    (dict(builder=7), "config->builder 7"),
    (dict(builder="ordered", timeout=-1.0), "timeout_s"),
    (dict(builder="ordered", tag_base=-5), "tag_base"),
    (dict(builder="ordered", jitter_us=20_000_000), "jitter_us"),
])
def test_bad_arguments_are_invalid(kw, match):
    def fn(boot):
        with pytest.raises(InvalidArgument, match=match):
            build_trial(boot, **kw)
        return True

    assert with_boots(1, fn) == [True]


def test_single_rank_builds_every_builder():
    for builder in ("legacy", "ordered", "tagged"):
        (res,) = with_boots(1, lambda boot: build_trial(boot, builder, timeout=5.0))
        assert res["outcome"] == "completed" and res["verified"], (builder, res)


# ----------------------------------------------------------------------------- command line

def run_cli(args, timeout):
    return subprocess.run([PY, "-m", *args], env=subprocess_env(), cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_selftest_builder_ordered_passes_and_legacy_reproduces_the_hang():
    p = run_cli(["flagcx_mesh.selftest", "--builder", "ordered", "-n", "3", "--iterations", "2",
                 "--jitter-us", "1000"], 60)
    assert p.returncode == 0 and "PASS: 2 mesh(es) built with the ordered builder" in p.stdout, p.stdout + p.stderr
    p = run_cli(["flagcx_mesh.selftest", "--builder", "legacy", "-n", "2", "--timeout", "1"], 60)
    assert p.returncode != 0, p.stdout
    assert "reproduced the known full-mesh hang" in p.stdout and "hung in round 0" in p.stdout, p.stdout


def test_bench_race_prints_a_table():
    p = run_cli(["flagcx_mesh.bench", "race", "--trials", "3", "-n", "2", "--builders", "ordered,tagged",
                 "--timeout", "5"], 90)
    assert p.returncode == 0, p.stdout + p.stderr
    for b in ("ordered", "tagged"):
        assert re.search(rf"^\s+{b}\s+3\s+3\s+0\s+0\s+0\s", p.stdout, re.M), p.stdout
