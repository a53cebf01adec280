"""Two "hosts" for tests: network namespaces joined by a veth pair (needs root and `ip netns`).
`two_hosts(names, addresses)` is a generator for a pytest fixture: it yields
{"A": (netns, ifname, address), "B": ...} and removes them afterwards; without root or `ip netns`
it skips, or fails when FXM_REQUIRE_NETNS=1."""

from __future__ import annotations

import os
import subprocess

import pytest


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable(why):
    if os.environ.get("FXM_REQUIRE_NETNS") == "1":
        pytest.fail(f"network namespaces required (FXM_REQUIRE_NETNS=1) but {why}")
    pytest.skip(why)


def two_hosts(names: str, addresses: tuple):
    """names: 2 letters told apart from other files' namespaces ("fx", "fu"); addresses: A's and B's."""
    if os.geteuid() != 0:
        unavailable("not root")
    tag = str(os.getpid())[-5:]
    hosts = {"A": (f"{names}m{tag}a", f"{names}a{tag}", addresses[0]),
             "B": (f"{names}m{tag}b", f"{names}b{tag}", addresses[1])}
    try:
        for ns, _, _ in hosts.values():
            ip("netns", "add", ns)
        ip("link", "add", hosts["A"][1], "type", "veth", "peer", "name", hosts["B"][1])
        for ns, ifname, addr in hosts.values():
            ip("link", "set", ifname, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            ip("-n", ns, "link", "set", ifname, "up")
            ip("-n", ns, "link", "set", "lo", "up")
    except (OSError, subprocess.CalledProcessError) as e:
        for ns, _, _ in hosts.values():
            ip("netns", "del", ns, check=False)
        unavailable(f"cannot set up network namespaces: {getattr(e, 'stderr', e)}")
    yield hosts
    for ns, _, _ in hosts.values():
        ip("netns", "del", ns, check=False)
