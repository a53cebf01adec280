"""Ranks on two "hosts": two network namespaces joined by a veth pair (198.51.100.0/24),
so ranks reach each other only over distinct addresses on a real interface, never
through a shared loopback. Needs root and `ip netns`; FXM_REQUIRE_NETNS=1 (set by
scripts/test.sh) turns a missing capability into a failure instead of a skip."""

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

import netns_hosts

from meshutil import subprocess_env

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_PROG = os.path.join(HERE, "rank_prog.py")


@pytest.fixture
def two_hosts():
    """{"A": (netns, ifname, address), "B": ...}; removed afterwards."""
    yield from netns_hosts.two_hosts("fx", ("198.51.100.1", "198.51.100.2"))


def _run_ranks(placement, extra_args=(), env_of=lambda host: {}, timeout=60):
    """placement: host name per rank. Rank 0 makes the unique id (its process hosts the
    root). Returns the parsed RESULT line of every rank."""
    with tempfile.TemporaryDirectory() as tmp:
        uid_file = os.path.join(tmp, "uid")
        procs = []
        for rank, (ns, host) in enumerate(placement):
            cmd = ["ip", "netns", "exec", ns, sys.executable, RANK_PROG, "--rank", str(rank),
                   "--nranks", str(len(placement)), "--uid-file", uid_file, *extra_args]
            if rank == 0:
                cmd.append("--make-uid")
            procs.append(subprocess.Popen(cmd, env=subprocess_env(env_of(host)), text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            if rank == 0:
                deadline = time.monotonic() + 20
                while not os.path.exists(uid_file) and time.monotonic() < deadline:
                    time.sleep(0.01)
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
            assert lines, (p.returncode, out, err)
            results.append(json.loads(lines[-1][len("RESULT "):]))
        return results


def test_mesh_across_two_hosts_with_the_automatic_interface(two_hosts):
    """Ranks 0, 1 on host A and 2, 3 on host B; nothing names an interface: the automatic
    choice must publish the veth address (not loopback) for the mesh to build."""
    a, b = two_hosts["A"], two_hosts["B"]
    placement = [(a[0], "A"), (a[0], "A"), (b[0], "B"), (b[0], "B")]
    results = _run_ranks(placement, ["--contexts", "2", "--iterations", "3", "--size", "4096"],
                         env_of=lambda host: {"FLAGCX_MESH_LOG": "warn"})
    for res in results:
        assert res["ok"], res
        assert res["nranks"] == 4 and res["contexts"] == 2


def test_mesh_across_two_hosts_with_ifname_set(two_hosts):
    a, b = two_hosts["A"], two_hosts["B"]
    placement = [(a[0], "A"), (b[0], "B")]
    results = _run_ranks(placement, ["--iterations", "2"],
                         env_of=lambda host: {"FLAGCX_MESH_IFNAME": two_hosts[host][1]})
    assert all(res["ok"] for res in results), results


def test_a_rank_publishing_loopback_is_named_by_the_other_host(two_hosts):
    """A classic misconfiguration: rank 1 on host B listens on loopback, so host A cannot
    reach it. Every rank fails within the deadline; rank 0's error names peer 1 and what
    went wrong (its connects to the published address were refused)."""
    a, b = two_hosts["A"], two_hosts["B"]
    placement = [(a[0], "A"), (b[0], "B")]
    env = {"A": {"FLAGCX_MESH_IFNAME": a[1]}, "B": {"FLAGCX_MESH_IFNAME": "lo"}}
    t0 = time.monotonic()
    results = _run_ranks(placement, ["--timeout", "4"], env_of=lambda host: env[host])
    assert time.monotonic() - t0 < 4 + 15
    assert not any(res["ok"] for res in results), results
    r0 = results[0]
    assert r0["type"] in ("MeshTimeout", "PeerLost"), r0
    assert r0["peer"] == 1, r0
    assert "peer 1" in r0["message"], r0
