"""Two "hosts" (network namespaces and a veth pair) through a bad link made with nft: 30 %
of the packets dropped, and a 2 s blackhole once rank 0's root is up. The mesh builds, or
fails within its deadline on every rank naming a peer; and striped puts over 4 tcp lanes
land whole (or fail naming a peer) through 10 % loss and a blackhole; a key proof held back past
the acceptor's header timeout is connected again. Needs root, `ip netns`, `ss` and `nft`;
skipped (with the reason) where one is missing, unless FXM_REQUIRE_NFT=1 makes that a
failure. The script mode with figures: python tests/netns_faults.py --trials 20."""


import json

import pytest

import netns_faults

pytestmark = pytest.mark.timeout(240)

DEADLINE = 30.0


@pytest.fixture(scope="module")
def hosts():
    h = netns_faults.hosts_or_skip()
    yield h
    netns_faults.remove_hosts(h)


def check(results):
    v = netns_faults.verdict(results, DEADLINE)
    shown = json.dumps(results, default=str)  # a str message is shown whole (a dict's repr is cut at 240 characters)
    assert v in ("built", "failed-named"), (v, shown)
    for r in results:  # a rank that failed inside the build did so by its deadline
        assert "elapsed_build" in r or r.get("elapsed", 0) <= DEADLINE + 10, shown


@pytest.mark.parametrize("loss, blackhole", [(30, 0.0), (0, 2.0), (30, 2.0)],
                         ids=["loss30", "blackhole2s", "loss30+blackhole2s"])
def test_mesh_builds_or_names_the_peer_through_a_bad_link(hosts, loss, blackhole):
    check(netns_faults.one_build(hosts, loss, blackhole, DEADLINE))


def test_a_key_proof_later_than_the_acceptors_header_timeout_is_connected_again(hosts):
    """The acceptor closes a connection whose key proof is not in within its header timeout (a
    proof whose segments were lost and resent); its connector must then connect again. Before
    wire version 7 the connector counted the connection made once it had sent the proof: the
    acceptor's slot stayed empty and its build waited out the deadline (seen under 10 % loss).
    Here rank 1's proofs to rank 0 are held back (netns_faults.one_late_proof_build) past rank 0's
    1 s header timeout: both ranks build and exchange, rank 0 having closed at least one
    connection as silent."""
    results, dropped = netns_faults.one_late_proof_build(hosts, header_timeout=1.0, timeout=DEADLINE)
    shown = json.dumps(results, default=str)
    assert dropped >= 1, ("no proof was held back: the test did not run its case", shown)
    assert all(r["ok"] for r in results), shown
    silent = results[0]["stats"]["rejected"].get("silent (no header before deadline)", 0)
    assert silent >= 1, shown
    assert all(r["elapsed_build"] < DEADLINE for r in results), shown


def check_transfer(results):
    """Both ranks checked every byte of every striped put and the get back; or, where the
    link kept the mesh from building, each failed naming a peer (a Mismatch never passes)."""
    shown = json.dumps(results, default=str)  # a str message is shown whole (a dict's repr is cut at 240 characters)
    assert not any(r.get("hung") for r in results), shown
    assert not any(r.get("type") == "Mismatch" for r in results), shown
    if all(r["ok"] for r in results):
        assert [r["lanes"] for r in results] == [4, 4], shown
        return
    for r in results:
        assert r["ok"] or (r.get("peer") is not None and r["peer"] >= 0) or "peer " in r.get("message", ""), shown


@pytest.mark.timeout(400)  # ops get 90 s where the kernel cannot cap TCP's RTO (netns_faults.one_transfer)
@pytest.mark.parametrize("loss, blackhole", [(10, 0.0), (10, 2.0)], ids=["loss10", "loss10+blackhole2s"])
def test_striped_puts_over_four_lanes_land_whole_through_a_bad_link(hosts, loss, blackhole):
    """tests/lanes_prog.py between the two hosts: 3 put_signals of 4 MiB striped over 4 lanes,
    each checked byte for byte by the target, then a get back, with 10 % of the packets dropped
    (each lane loses and retransmits on its own, so stripes arrive in any order against lane 0),
    and a 2 s blackhole under the transfer.

    The blackhole starts once both ranks are built with every lane up, and the transfer inside
    it (netns_faults.one_transfer). Started at a fixed time instead, it often hit the lanes'
    connection setup on a loaded VM: a lane whose SYN crossed it measured an RTT of ~2.5 s (RTO
    ~9 s), and a lost retransmission or two under the 10 % loss then stalled that lane (and with
    it the striped put, whose head waits for every stripe) past the 30 s op timeout: TCP's
    backoff, which no op deadline of the library can promise to beat. For the same reason TCP's
    RTO is capped at 5 s in the namespaces where the kernel allows it (else ops get 90 s): a
    2 s outage then costs at most a few retries, each within 5 s of the last."""
    check_transfer(netns_faults.one_transfer(hosts, loss, blackhole, DEADLINE, lanes=4))
