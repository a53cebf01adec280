"""Mesh builds between two "hosts" (network namespaces joined by a veth pair) through a lossy
or briefly dead link, made with nft in each namespace: every build must succeed, or fail
within its deadline naming a peer it could not reach.

Used by tests/test_netns_faults.py, and as a script that prints figures (root, nft, ip):

    python tests/netns_faults.py [--trials 20] [--loss 30] [--blackhole 2] [--timeout 20]

Per trial: ranks 0, 1 on host A and 2, 3 on host B (rank 0 hosts the root); --loss percent
of the packets arriving on each veth are dropped (nft numgen random), and --blackhole
seconds after rank 0's root is up every packet on the veth is dropped for that long.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from meshutil import subprocess_env  # noqa: E402

RANK_PROG = os.path.join(HERE, "rank_prog.py")
Host = Tuple[str, str, str]  # netns, veth name, address
ITERATIONS = 2  # builds per rank process and trial (each within its own deadline)


def missing_tools() -> Optional[str]:
    """Why this cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "nft", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (nft: apt-get install nftables)"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=20, check=check)


def make_hosts() -> Dict[str, Host]:
    tag = str(os.getpid())[-5:]
    hosts = {"A": (f"fxq{tag}a", f"fqa{tag}", "198.51.100.1"), "B": (f"fxq{tag}b", f"fqb{tag}", "198.51.100.2")}
    try:
        for ns, _, _ in hosts.values():
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", hosts["A"][1], "type", "veth", "peer", "name", hosts["B"][1])
        for ns, ifname, addr in hosts.values():
            _run("ip", "link", "set", ifname, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _run("ip", "-n", ns, "link", "set", ifname, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "fxm")
            _run("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "fxm", "in",
                 "{ type filter hook input priority 0; }")
    except (OSError, subprocess.CalledProcessError) as e:
        remove_hosts(hosts)
        raise RuntimeError(f"cannot set up the namespaces: {getattr(e, 'stderr', e)}") from e
    return hosts


def hosts_or_skip() -> Dict[str, Host]:
    """make_hosts() for a test, or the test skipped saying what is missing (failed instead where
    FXM_REQUIRE_NFT=1, as in CI)."""
    import pytest

    why = missing_tools()
    if why:
        if os.environ.get("FXM_REQUIRE_NFT") == "1":
            pytest.fail(f"nft fault tests required (FXM_REQUIRE_NFT=1) but {why}")
        pytest.skip(why)
    try:
        return make_hosts()
    except RuntimeError as e:
        pytest.skip(str(e))


def remove_hosts(hosts: Dict[str, Host]) -> None:
    for ns, _, _ in hosts.values():
        _run("ip", "netns", "del", ns, check=False)


def set_drop(hosts: Dict[str, Host], percent: int) -> None:
    """Drops `percent` % of the packets arriving on each host's veth (0: none, 100: all)."""
    for ns, ifname, _ in hosts.values():
        _run("ip", "netns", "exec", ns, "nft", "flush", "chain", "inet", "fxm", "in")
        if percent >= 100:
            _run("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "fxm", "in", "iifname", ifname, "drop")
        elif percent > 0:
            _run("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "fxm", "in", "iifname", ifname,
                 "numgen", "random", "mod", "100", "<", str(percent), "drop")


def one_build(hosts: Dict[str, Host], loss: int, blackhole: float, timeout: float) -> List[dict]:
    """Ranks 0, 1 on A, 2, 3 on B; returns every rank's RESULT (plus "wall")."""
    set_drop(hosts, loss)
    placement = [hosts["A"], hosts["A"], hosts["B"], hosts["B"]]
    with tempfile.TemporaryDirectory() as tmp:
        uid_file = os.path.join(tmp, "uid")
        procs, t0 = [], time.monotonic()
        for rank, (ns, ifname, _) in enumerate(placement):
            cmd = ["ip", "netns", "exec", ns, sys.executable, RANK_PROG, "--rank", str(rank), "--nranks", "4",
                   "--uid-file", uid_file, "--timeout", str(timeout), "--iterations", str(ITERATIONS)]
            if rank == 0:
                cmd.append("--make-uid")
            procs.append(subprocess.Popen(cmd, env=subprocess_env({"FLAGCX_MESH_IFNAME": ifname}), text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        # the root is up and rank 0 is in the build: the link dies for a while. A rank is "hung"
        # only past the build's deadline plus the root's exit wait, also up to `timeout`
        # (bootstrap/exit_wait.cc: rank 0's process hosts the root and, at exit, waits for the
        # ranks still connected to it); at timeout + 30 a root whose build ended near its
        # deadline was killed mid-wait and called hung.
        return _blackhole_and_collect(hosts, procs, uid_file, t0, loss, blackhole, 0.0, 2 * timeout + 30)


def _blackhole_and_collect(hosts, procs, uid_file, t0, loss, blackhole, settle, bound) -> List[dict]:
    """Once the uid file exists (and `settle` s more), every packet dropped for `blackhole` s,
    then `loss` % again; then every process's RESULT (one killed at `bound` s says "hung")."""
    while not os.path.exists(uid_file) and time.monotonic() - t0 < 20:
        time.sleep(0.005)
    if blackhole > 0:
        time.sleep(settle)
        set_drop(hosts, 100)
        time.sleep(blackhole)
        set_drop(hosts, loss)
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            results.append({"ok": False, "hung": True, "message": err[-500:]})
            continue
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT "):]) if lines else {"ok": False, "message": err[-500:]})
    for res in results:
        res["wall"] = time.monotonic() - t0
    return results


def listening_ports(ns: str) -> set:
    """The TCP ports listened on in namespace `ns`."""
    out = _run("ip", "netns", "exec", ns, "ss", "-ltnH").stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def drop_counted(ns: str) -> int:
    """Packets dropped so far by the counted rule of namespace `ns`'s input chain."""
    out = _run("ip", "netns", "exec", ns, "nft", "list", "chain", "inet", "fxm", "in").stdout
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))


def one_late_proof_build(hosts: Dict[str, Host], header_timeout: float, timeout: float) -> Tuple[List[dict], int]:
    """Rank 0 on A (header_timeout), rank 1 on B, started 3 s later. Once rank 0's mesh listener
    is up, A drops the segments of rank 1's key proof to it (a 32-byte payload: IP length 84 with
    TCP timestamps, 72 without) until header_timeout + 1.5 s after the first one dropped, so that
    every proof of that time lands (resent by TCP) after rank 0's header timeout. Returns every
    rank's RESULT and the proofs dropped."""
    set_drop(hosts, 0)
    (ns_a, if_a, _), (ns_b, if_b, _) = hosts["A"], hosts["B"]
    with tempfile.TemporaryDirectory() as tmp:
        uid_file = os.path.join(tmp, "uid")
        procs, t0 = [], time.monotonic()
        # rank 0 listens 1 s after its root (so that the new port is the mesh listener), rank 1 comes later
        for rank, (ns, ifname, delay) in enumerate([(ns_a, if_a, 1.0), (ns_b, if_b, 4.0)]):
            cmd = ["ip", "netns", "exec", ns, sys.executable, RANK_PROG, "--rank", str(rank), "--nranks", "2",
                   "--uid-file", uid_file, "--timeout", str(timeout), "--header-timeout", str(header_timeout),
                   "--delay", str(delay)]
            if rank == 0:
                cmd.append("--make-uid")
            procs.append(subprocess.Popen(cmd, env=subprocess_env({"FLAGCX_MESH_IFNAME": ifname}), text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        dropped = 0
        try:
            dropped = _drop_first_proofs(ns_a, if_a, uid_file, t0, header_timeout + 1.5)
        except BaseException:
            for p in procs:
                p.kill()
                p.communicate()
            raise
        finally:
            set_drop(hosts, 0)
        return _blackhole_and_collect(hosts, procs, uid_file, t0, 0, 0.0, 0.0, 2 * timeout + 30), dropped


def _drop_first_proofs(ns: str, ifname: str, uid_file: str, t0: float, hold: float) -> int:
    from flagcx_mesh import _core

    while not os.path.exists(uid_file) and time.monotonic() - t0 < 20:
        time.sleep(0.005)
    time.sleep(0.05)  # (written whole: rank_prog renames it into place)
    with open(uid_file) as f:
        root_port = int(_core._unique_id_info(bytes.fromhex(f.read().strip()))["root"].rsplit(":", 1)[1])
    mesh_port = None  # rank 0's listeners: its root's, then its mesh listener's
    while mesh_port is None and time.monotonic() - t0 < 20:
        new = listening_ports(ns) - {root_port}
        mesh_port = min(new) if new else None
        time.sleep(0.01)
    if mesh_port is None:
        return 0
    _run("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "fxm", "in", "iifname", ifname, "tcp", "dport",
         str(mesh_port), "ip", "length", "{ 72, 84 }", "counter", "drop")
    while drop_counted(ns) == 0 and time.monotonic() - t0 < 30:
        time.sleep(0.005)
    time.sleep(hold)
    return drop_counted(ns)


LANES_PROG = os.path.join(HERE, "lanes_prog.py")


RTO_MAX_MS = 5000  # TCP's retransmission timeout cap in the namespaces, where the kernel has one (>= 6.15)


def set_rto_max(hosts: Dict[str, Host], ms: int) -> Optional[int]:
    """Sets TCP's retransmission timeout cap to `ms` in both namespaces (their own
    net.ipv4.tcp_rto_max_ms, Linux >= 6.15; 120000 by default) and returns the value it had, or
    None where the kernel has no such knob (then nothing is changed)."""
    ns = hosts["A"][0]
    r = _run("ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/tcp_rto_max_ms", check=False)
    if r.returncode != 0 or not r.stdout.strip().isdigit():
        return None
    for ns, _, _ in hosts.values():
        _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_rto_max_ms={ms}")
    return int(r.stdout.strip())


def one_transfer(hosts: Dict[str, Host], loss: int, blackhole: float, timeout: float, lanes: int = 4,
                 size: int = 4 << 20, count: int = 3) -> List[dict]:
    """Rank 0 on A, rank 1 on B (tests/lanes_prog.py): `count` striped put_signals of `size`
    bytes over `lanes` tcp lanes, each checked byte for byte, then a get back; `loss` % of the
    packets dropped all along (the build too). Returns both ranks' RESULT (plus "wall").

    With blackhole > 0 the link dies (every packet dropped) for that long once both ranks are
    built with every lane connected, and the transfer starts inside it (lanes_prog --go-file):
    the blackhole always hits the striped puts, and never the lanes' connection setup. (It used
    to start 0.5 s after the uid file appeared, on a loaded 2-core VM often mid-build: a lane
    whose SYN crossed the blackhole measured an RTT of ~2.5 s and started with an RTO of ~9 s,
    which one or two retransmissions lost to the 10 % loss turned into a stall of the striped
    put past the 30 s op timeout, a MeshTimeout naming no peer.)

    TCP's backoff is bounded too. A connection that sent into a 2 s blackhole has doubled its
    RTO 3 times (0.2 .. 1.6 s) and retries at +3.0, 6.2, 12.6, 25.4, 51 s...; with 10 % of the
    packets (and of their acks) dropped each retry fails with p ~ 0.19, so 3 failed in a row
    (~0.7 % a lane, of 4 lanes sending) outlast a 30 s op timeout. So the RTO is capped at 5 s in
    the namespaces for the transfer (set_rto_max): 30 s then needs 6 failed retries in a row.
    Where the kernel has no cap, ops get 90 s instead (5 in a row, ~0.1 % a run).

    Loss alone needs the cap as much: uncapped, a segment whose retries fail 7 times in a row
    (p ~ 0.19^7, of the thousands of segments 10 % loss drops in a run) waits 0.2 + 0.4 + ... +
    12.8 = 25 s before the next, and the run failed in CI that way (both ranks' round 0 past the
    30 s op timeout; on the loaded VM, 2 of 10 runs took 18 and 32 s, with the cap none of 10 over 11 s)."""
    set_drop(hosts, loss)
    old = set_rto_max(hosts, RTO_MAX_MS)
    op_timeout = timeout if old is not None else max(timeout, 90.0)
    try:
        return _transfer(hosts, loss, blackhole, timeout, op_timeout, lanes, size, count)
    finally:
        if old is not None:
            set_rto_max(hosts, old)  # the builds share the namespaces


def _transfer(hosts, loss, blackhole, timeout, op_timeout, lanes, size, count) -> List[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        uid_file, go_file = os.path.join(tmp, "uid"), os.path.join(tmp, "go")
        procs, t0 = [], time.monotonic()
        for rank, (ns, ifname, _) in enumerate((hosts["A"], hosts["B"])):
            cmd = ["ip", "netns", "exec", ns, sys.executable, LANES_PROG, "--rank", str(rank), "--uid-file", uid_file,
                   "--lanes", str(lanes), "--size", str(size), "--count", str(count), "--timeout", str(timeout),
                   "--op-timeout", str(op_timeout), "--go-file", go_file]
            if rank == 0:
                cmd.append("--make-uid")
            env = subprocess_env({"FLAGCX_MESH_IFNAME": ifname, "FLAGCX_MESH_TRANSPORT": "tcp",
                                  "FLAGCX_MESH_TCP_LANES": str(lanes)})
            procs.append(subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        # Both built (or one exited: its RESULT says why), bounded by the build deadline.
        built = [f"{go_file}.built{rank}" for rank in range(2)]
        while (not all(os.path.exists(b) for b in built) and all(p.poll() is None for p in procs)
               and time.monotonic() - t0 < timeout + op_timeout + 10):
            time.sleep(0.005)
        if blackhole > 0:
            set_drop(hosts, 100)
        with open(go_file, "w"):
            pass
        if blackhole > 0:
            time.sleep(blackhole)
            set_drop(hosts, loss)
        # the blackhole is over: the RESULTs (one op times out, then its peer is lost at once)
        return _blackhole_and_collect(hosts, procs, uid_file, t0, loss, 0.0, 0.0, timeout + 2 * op_timeout + 30)


def verdict(results: List[dict], timeout: float) -> str:
    """'built', 'failed-named' (every failing rank names a peer, or the bootstrap root it could
    not hear from; one that failed inside the build did so within its deadline), or what is
    wrong ('hung', 'late', 'unnamed')."""
    if any(r.get("hung") for r in results):
        return "hung"
    if all(r["ok"] for r in results):
        return "built"
    for r in results:
        if r["ok"]:
            continue
        # A rank that failed inside the build must have failed by its deadline; one that
        # built and failed afterwards (the exchange, bounded by its own timeouts) has
        # elapsed_build set.
        if "elapsed_build" not in r and r.get("elapsed", 1e9) > timeout + 10:
            return "late"
        message = r.get("message", "")
        if not (r.get("peer") is not None and r["peer"] >= 0 or "peer " in message or "bootstrap root at" in message):
            return "unnamed"
    return "failed-named"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--loss", type=int, default=30, help="percent of packets dropped on each veth")
    p.add_argument("--blackhole", type=float, default=2.0, help="seconds of 100 %% drop after the root is up")
    p.add_argument("--timeout", type=float, default=20.0, help="build deadline, seconds")
    p.add_argument("--json", default=None, help="append every trial's results to this file (JSON lines)")
    args = p.parse_args(argv)
    why = missing_tools()
    if why:
        print(f"netns_faults: cannot run: {why}")
        return 2
    hosts = make_hosts()
    counts: Dict[str, int] = {}
    walls, builds, failures = [], [], []
    try:
        for _ in range(args.trials):
            results = one_build(hosts, args.loss, args.blackhole, args.timeout)
            v = verdict(results, args.timeout)
            counts[v] = counts.get(v, 0) + 1
            walls.append(max(r["wall"] for r in results))
            builds.append(max(r.get("elapsed_build", r.get("elapsed", 0.0)) for r in results))
            failures += [("after the build: " if "elapsed_build" in r else "in the build: ") + r.get("message", "")[:200]
                         for r in results if not r["ok"]]
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"verdict": v, "results": results}) + "\n")
    finally:
        remove_hosts(hosts)
    print(f"netns_faults: {args.trials} builds of 4 ranks on 2 hosts, {args.loss} % loss, "
          f"{args.blackhole:g} s blackhole, deadline {args.timeout:g} s: {counts}")
    print(f"  build (slowest rank): median {statistics.median(builds):.2f} s, max {max(builds):.2f} s; "
          f"wall per trial (processes started to all exited): median {statistics.median(walls):.2f} s, "
          f"max {max(walls):.2f} s")
    print(f"  failures: {sum(m.startswith('in the build') for m in failures)} ranks in the build, "
          f"{sum(m.startswith('after the build') for m in failures)} after it (the exchange)")
    for m in failures[:12]:
        print(f"  failure: {m}")
    bad = sum(v for k, v in counts.items() if k not in ("built", "failed-named"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
