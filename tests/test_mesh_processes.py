"""Ranks as processes: through the embedded launcher, and killed / frozen / missing ranks
(issue item 7) with plain subprocesses so that every survivor's error can be inspected."""

import json
import re
import signal
import subprocess
import time

import pytest

import flagcx_mesh
from meshutil import PY, RANK_PROG, REPO_ROOT, subprocess_env

pytestmark = pytest.mark.timeout(120)


def results_from(stdout):
    """The RESULT json objects printed by rank_prog (launcher prefixes allowed)."""
    found = []
    for line in stdout.splitlines():
        _, sep, rest = line.partition("RESULT ")
        if sep:
            found.append(json.loads(rest))
    return found


# ----------------------------------------------------------------------------- (a) the launcher

@pytest.mark.parametrize("n, contexts", [(2, 1), (4, 2), (8, 1)])
def test_launcher_job_exchanges_tagged_payloads(n, contexts):
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", str(n), "--timeout", "90", "--",
           PY, RANK_PROG, "--contexts", str(contexts), "--iterations", "3", "--size", "300",
           "--timeout", "60"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=subprocess_env(), cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=100)
    secs = time.monotonic() - t0
    assert p.returncode == 0, f"launcher exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    res = results_from(p.stdout)
    assert sorted(r["rank"] for r in res) == list(range(n)), p.stdout
    assert all(r["ok"] for r in res), res
    assert len({r["mesh_id"] for r in res}) == 1
    for r in res:
        assert (r["nranks"], r["contexts"]) == (n, contexts)
        assert f"[rank {r['rank']}] RESULT " in p.stdout
        assert r["stats"]["rejected_total"] == 0
        assert set(r["timings"]) == {"listen", "rendezvous", "connect", "wiring", "total"}
    assert secs < 60


def test_launcher_reports_a_failing_rank():
    """A rank that dies mid-build makes the launcher exit non-zero naming it."""
    # the launcher gives every rank the same argv: rank 1 picks --die-at from its environment
    wrapper = ("import os, sys, runpy; "
               "sys.argv = [%r] + sys.argv[1:] + "
               "(['--die-at', 'rendezvous'] if os.environ['FLAGCX_MESH_RANK'] == '1' else []); "
               "runpy.run_path(%r, run_name='__main__')" % (RANK_PROG, RANK_PROG))
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", "3", "--timeout", "60", "--grace", "1", "--",
           PY, "-c", wrapper, "--timeout", "30"]
    env = subprocess_env()
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)
    assert p.returncode == 128 + signal.SIGKILL, (p.returncode, p.stderr)
    assert "rank 1 failed: killed by signal SIGKILL" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 30


# ----------------------------------------------------------------------------- (b) faults

class Job:
    """N rank processes started directly (not through the launcher)."""

    def __init__(self, n, argv_for, timeout=60):
        self.n = n
        self.procs = {}
        self.timeout = timeout
        self.t0 = time.monotonic()
        for r in range(n):
            argv = argv_for(r)
            if argv is None:
                continue  # this rank never starts
            self.procs[r] = subprocess.Popen([PY, RANK_PROG] + argv, env=subprocess_env(),
                                             cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)

    def wait(self, ranks=None):
        """Waits for `ranks` (default all started); returns {rank: (rc, result, stderr, secs)}."""
        out = {}
        deadline = self.t0 + self.timeout
        for r in (self.procs if ranks is None else ranks):
            p = self.procs[r]
            try:
                so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"rank {r} still running after {self.timeout} s (hang)")
            res = results_from(so)
            out[r] = (p.returncode, res[0] if res else None, se, time.monotonic() - self.t0)
        return out

    def kill(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def rank_args(r, n, uid_hex, timeout, extra=()):
    return ["--rank", str(r), "--nranks", str(n), "--uid-hex", uid_hex,
            "--timeout", str(timeout), *extra]


@pytest.mark.parametrize("phase", [
    "rendezvous",
    "connect",
])
def test_killed_rank_is_named_by_every_survivor(phase):
    """Rank 2 is SIGKILLed after publishing its address (rendezvous: connects in flight;
    connect: its connections exist, the wiring check is under way). Every survivor fails
    well within its 30 s deadline with PeerLost naming rank 2, and exits."""
    n, dead, timeout = 4, 2, 30
    uid = flagcx_mesh.get_unique_id().hex()
    with Job(n, lambda r: rank_args(r, n, uid, timeout,
                                    ["--die-at", phase] if r == dead else [])) as job:
        out = job.wait()
    rc, res, _, _ = out[dead]
    assert rc == -signal.SIGKILL and res is None
    for r in set(range(n)) - {dead}:
        rc, res, err, _ = out[r]
        assert rc == 3, (r, rc, res, err)
        assert res["type"] == "PeerLost", res
        assert re.search(r"\b(rank|peer) 2\b", res["message"]), res
        assert res["message"].startswith(f"rank {r}: "), res
        assert res["elapsed"] < 15, res
        # .peer is the dead rank, unless this rank heard of the failure through another
        # survivor's abort, which the root forwards as "rank K: ..." with peer K (see
        # test_frozen_rank_every_survivor_raises_timeout_naming_it)
        k = res["peer"]
        assert k == dead or (k in set(range(n)) - {dead, r}
                             and f"rank {r}: rank {k}: " in res["message"]), res


def test_killed_rank_hosting_the_root(tmp_path):
    """Rank 0 made the unique id (so it hosts the rendezvous root) and is killed after the
    rendezvous: the survivors lose the root and say so."""
    n, timeout = 4, 30
    uid_file = str(tmp_path / "uid")

    def argv(r):
        a = ["--rank", str(r), "--nranks", str(n), "--uid-file", uid_file,
             "--timeout", str(timeout)]
        return a + ["--make-uid", "--die-at", "rendezvous"] if r == 0 else a

    with Job(n, argv) as job:
        out = job.wait()
    assert out[0][0] == -signal.SIGKILL
    for r in range(1, n):
        rc, res, err, _ = out[r]
        assert rc == 3, (r, rc, res, err)
        assert res["type"] == "PeerLost", res
        assert "bootstrap root" in res["message"], res
        assert res["elapsed"] < 15, res


def test_missing_rank_is_named_by_every_rank_before_its_deadline():
    """Rank 3 never starts: every other rank fails with MeshTimeout naming rank 3, no later
    than its own deadline (the root gives up a little before the ranks do), and exits."""
    n, missing, timeout = 4, 3, 3.0
    uid = flagcx_mesh.get_unique_id().hex()
    with Job(n, lambda r: None if r == missing else rank_args(r, n, uid, timeout)) as job:
        out = job.wait()
    for r in range(n - 1):
        rc, res, err, _ = out[r]
        assert rc == 3, (r, rc, res, err)
        assert res["type"] == "MeshTimeout", res
        assert res["peer"] == missing, res
        assert re.search(r"ranks \[3\] .*never joined", res["message"]), res
        assert timeout / 2 <= res["elapsed"] <= timeout + 0.5, res


def test_frozen_rank_fails_every_survivor_by_the_deadline():
    """Rank 1 is SIGSTOPped after the rendezvous (its sockets stay open, it answers nothing):
    every survivor fails by its build deadline with an error that names rank 1."""
    n, frozen, timeout = 3, 1, 3.0
    uid = flagcx_mesh.get_unique_id().hex()
    with Job(n, lambda r: rank_args(r, n, uid, timeout,
                                    ["--stop-at", "rendezvous"] if r == frozen else [])) as job:
        out = job.wait([r for r in range(n) if r != frozen])
        frozen_proc = job.procs[frozen]
        assert frozen_proc.poll() is None  # still stopped, not exited
    assert frozen_proc.poll() == -signal.SIGKILL  # the Job killed it on the way out
    for r, (rc, res, err, _) in out.items():
        assert rc == 3, (r, rc, res, err)
        assert res["type"] in ("MeshTimeout", "PeerLost"), res
        assert "peers not connected: [1]" in res["message"], res
        assert res["elapsed"] < timeout + 5, res


def test_frozen_rank_every_survivor_raises_timeout_naming_it():
    n, frozen, timeout = 4, 1, 3.0
    uid = flagcx_mesh.get_unique_id().hex()

    def argv(r):
        extra = ["--stop-at", "rendezvous"] if r == frozen else []
        if r >= 2:
            extra += ["--delay", "0.5"]  # rank 0's deadline expires first
        return rank_args(r, n, uid, timeout, extra)

    with Job(n, argv) as job:
        out = job.wait([r for r in range(n) if r != frozen])
    for r, (rc, res, err, _) in out.items():
        assert rc == 3, (r, rc, res, err)
        assert res["type"] == "MeshTimeout" and res["peer"] == frozen, res
        assert "peers not connected: [1]" in res["message"], res
