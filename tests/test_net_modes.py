"""Every builder (legacy = FlagCX's loop, ordered, tagged) over the test adaptor's modes that behave
like FlagCX's real adaptors, at 2, 4 and 8 ranks:

* ib-strict -- IB's contract: a connect completes once the peer accepted it, isend returns a NULL
  request until the peer posted its irecv, irecv returns NULL once per message, and unregistered
  buffers are refused;
* socket    -- FlagCX's socket adaptor: a connect completes in the kernel backlog before the peer
  accepts; with 2 sockets per connection accept takes them one at a time, so connections that
  arrive together get mixed (TAGGED's precondition broken).

And a rank killed mid-build over a bootstrap shaped like FlagCX's (recv without a deadline)."""

import json
import re
import subprocess
import time

import pytest

import flagcx_mesh
from flagcx_mesh.errors import TIMEOUT
from flagcx_mesh.netbuild import NetBootstrap, aggregate, build_trial
from meshutil import PY, REPO_ROOT, run_threads, subprocess_env

pytestmark = pytest.mark.timeout(120)

MODES = {"ib-strict": dict(mode="ib-strict"), "socket": dict(mode="socket"),
         "socket-2": dict(mode="socket", socks_per_conn=2)}
PRECONDITION = "accept delivers one whole connection"


def trials(n, builder, count, **kw):
    """`count` trials of `builder` on n thread ranks; per trial the list of rank results."""
    uid = flagcx_mesh.get_unique_id()

    def body(r):
        boot = NetBootstrap(n, uid, r, 30.0)
        out = []
        try:
            for t in range(count):
                boot.barrier(timeout=30)
                out.append(build_trial(boot, builder, seed=1000 * t + r + 1, tag_base=5000 + t * (n + 1), **kw))
        finally:
            boot.close()
        return out

    per_rank = run_threads(n, body, timeout=110)
    return [[per_rank[r][t] for r in range(n)] for t in range(count)]


def clean(res):
    """Nothing the build or the check opened or registered was left behind or released twice."""
    return res["bad_closes"] == 0 and res["left_open"] == 0 and res["mr_left"] == 0 and res["bad_deregs"] == 0


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_ordered_completes_in_every_mode(mode, n):
    """ORDERED never has two connections in flight to one listener: it completes over IB's
    contract and over the socket adaptor (mixing accept included), every slot proved."""
    for t, ranks in enumerate(trials(n, "ordered", 3, jitter_us=2000, timeout=20.0, **MODES[mode])):
        for r, res in enumerate(ranks):
            assert res["outcome"] == "completed" and res["verified"], (t, r, res)
            assert clean(res), (t, r, res)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("mode", ["ib-strict", "socket"])
def test_tagged_completes_over_ib_contract_and_single_socket(mode, n):
    """TAGGED over NULL requests and required registration (regression: it took a NULL request
    for a failure and sent from unregistered memory, so over IB it could not run)."""
    for t, ranks in enumerate(trials(n, "tagged", 3, jitter_us=2000, timeout=20.0, **MODES[mode])):
        for r, res in enumerate(ranks):
            assert res["outcome"] == "completed" and res["verified"], (t, r, res)
            assert clean(res), (t, r, res)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_tagged_over_a_mixing_accept_fails_saying_why_and_never_miswires(n):
    """Two sockets per connection, accepted one at a time: TAGGED's precondition does not hold.
    A build either completes with every slot proved, or fails (ranks that only wait for a failed
    one fail at their deadline); a failure names the precondition on at least one rank. It never
    hands out a miswired mesh."""
    said = 0
    for t, ranks in enumerate(trials(n, "tagged", 3, jitter_us=2000, timeout=10.0, **MODES["socket-2"])):
        outcome = aggregate(res["outcome"] for res in ranks)
        assert outcome in ("completed", "failed", "hung"), (t, ranks)
        for res in ranks:
            assert res["outcome"] != "miswired" and res["outputs_untouched"] or res["outcome"] == "completed", res
            assert res["outcome"] != "completed" or res["verified"], res
        if outcome != "completed":
            assert any(PRECONDITION in res["error"] for res in ranks), [res["error"] for res in ranks]
            said += 1
    if n >= 4:
        assert said, "4+ ranks connecting at once over a mixing accept never broke the precondition"


@pytest.mark.parametrize("n", [2, 4, 8])
def test_legacy_over_ib_strict_hangs_or_miswires_but_is_reported(n):
    for ranks in trials(n, "legacy", 2, jitter_us=2000, timeout=1.5, **MODES["ib-strict"]):
        outcome = aggregate(res["outcome"] for res in ranks)
        assert outcome in ("completed", "hung", "miswired"), ranks
        assert all(clean(res) for res in ranks), ranks


@pytest.mark.parametrize("n", [2, 4, 8])
def test_legacy_over_the_socket_adaptor_miswires_instead_of_hanging(n):
    """FlagCX's loop over a socket adaptor: connects complete in the backlog, so it never hangs;
    accept takes whatever came first, so from 4 ranks on it miswires (the wiring check says so)."""
    outcomes = []
    # Whether a trial miswires is a race: at 4 ranks on a loaded machine 3 trials all completed
    # once, so from 4 ranks on 20 trials are run (each takes milliseconds).
    for ranks in trials(n, "legacy", 20 if n >= 4 else 3, jitter_us=2000, timeout=5.0, **MODES["socket"]):
        outcomes.append(aggregate(res["outcome"] for res in ranks))
        assert all(res["outcome"] != "hung" for res in ranks), ranks
        assert all(clean(res) for res in ranks), ranks
    assert set(outcomes) <= {"completed", "miswired"}, outcomes
    if n >= 4:
        assert "miswired" in outcomes, outcomes


@pytest.mark.parametrize("n", [2, 4, 8])
def test_legacy_over_a_mixing_accept_never_hangs_and_never_passes_a_mixed_mesh(n):
    """Two sockets per connection: FlagCX's loop still never hangs; a mixed connection shows up
    as a miswire or as an adaptor error in the wiring check (a socket slot the accept left empty),
    never as a completed build whose slots were not proved."""
    for ranks in trials(n, "legacy", 3, jitter_us=2000, timeout=5.0, **MODES["socket-2"]):
        assert aggregate(res["outcome"] for res in ranks) in ("completed", "miswired", "failed"), ranks
        assert all(res["outcome"] != "hung" and clean(res) for res in ranks), ranks
        assert all(res["verified"] for res in ranks if res["outcome"] == "completed"), ranks


# ----------------------------------------------------------------------------- a rank dies

def run_with_a_dead_rank(n, bootstrap, wait):
    """n rank processes build with ORDERED over IB-strict and `bootstrap`; rank 2 exits at its
    first connect (round 0, before any readiness token). Returns {rank: result or None (still
    running after `wait` s, then killed)} and rank 2's exit code."""
    uid = flagcx_mesh.get_unique_id()  # the rendezvous root lives in this process
    procs = [subprocess.Popen([PY, "tests/net_rank_prog.py", uid.hex(), str(r), str(n), "ordered", bootstrap, "2",
                               "2.0"], env=subprocess_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
             for r in range(n)]
    results, t0 = {}, time.monotonic()
    try:
        for r, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(0.1, wait - (time.monotonic() - t0)))
                results[r] = json.loads(out) if r != 2 else p.returncode
            except subprocess.TimeoutExpired:
                results[r] = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def test_killed_rank_with_the_abort_hook_every_survivor_fails_by_its_deadline():
    """The bootstrap has no deadline (FlagCX's bootstrapRecv): rank 1 waits in it for the token
    of the dead rank 2. At the build deadline the watchdog calls the abort hook, and rank 1 fails
    naming rank 2; rank 3 (waiting to accept from 2) names rank 2; rank 0 (connecting to rank 1,
    which announced its accept but is stuck) names rank 1 and says it is stuck further on."""
    res = run_with_a_dead_rank(4, "flagcx", wait=60)
    assert res[2] == 86  # died inside the build
    for r in (0, 1, 3):
        assert res[r] is not None, f"rank {r} still blocked: the abort hook did not get it out"
        assert clean(res[r]) and res[r]["outputs_untouched"], res[r]
        if r == 0 and _reset_by_rank_1(res[0]):
            continue  # rank 1's abort, at its own deadline, closed the socket rank 0 was connecting on first
        assert res[r]["outcome"] == "hung" and res[r]["code"] == TIMEOUT, res[r]
    assert res[1]["boot_aborted"] and res[1]["peer"] == 2, res[1]
    assert "waiting for the readiness token of rank 2" in res[1]["error"] and "abort hook" in res[1]["error"]
    assert res[3]["peer"] == 2 and "accept from rank 2 not done" in res[3]["error"], res[3]
    assert res[0]["peer"] == 1 and ("stuck further on" in res[0]["error"] or _reset_by_rank_1(res[0])), res[0]


def _reset_by_rank_1(res):
    """Rank 0's connect to rank 1 reset (ECONNRESET, 104): under load rank 1's deadline can come
    first, and its abort closes what rank 0 connects to. It still names rank 1, before its deadline."""
    return res["outcome"] == "failed" and res["peer"] == 1 and "adaptor connect (peer rank 1) returned 104" in res["error"]


def test_killed_rank_without_the_abort_hook_blocks_in_the_bootstrap_for_ever():
    """What the docs say happens without the hook (0.2 ops, or a bootstrap that offers none):
    the ranks that do not wait in the bootstrap still fail at the deadline, but rank 1, inside a
    recv that has no deadline, never returns (it is killed here after 2 s + 8 s)."""
    res = run_with_a_dead_rank(4, "flagcx-noabort", wait=10)
    assert res[2] == 86
    assert res[1] is None, res[1]
    for r in (0, 3):
        assert res[r] is not None and res[r]["outcome"] == "hung", res[r]


def test_bench_race_reports_the_socket_mode():
    """The race bench's socket mode: FlagCX's loop miswires (it does not hang), ORDERED completes.
    (24 trials: an idle machine miswires 50-75 % of them, a loaded one fewer; 4 once all completed.)"""
    p = subprocess.run([PY, "-m", "flagcx_mesh.bench", "race", "--trials", "24", "-n", "4", "--builders",
                        "legacy,ordered", "--modes", "socket", "--timeout", "5"], env=subprocess_env(),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "adaptor mode socket: socket-like" in p.stdout, p.stdout
    rows = {m.group(1): [int(x) for x in m.groups()[1:]]
            for m in re.finditer(r"^\s+(legacy|ordered)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s", p.stdout, re.M)}
    assert rows["ordered"] == [24, 24, 0, 0, 0], p.stdout
    trials, completed, hung, miswired, failed = rows["legacy"]
    assert hung == 0 and miswired >= 1 and failed == 0, p.stdout
