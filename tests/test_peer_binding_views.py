"""Invariant 8, the cost side (csrc/agent/connection.cc, docs/agent.md): a connection keeps one
path per live registration of its peer, however many byte-variants of its descriptor it is handed,
and at most FLAGCX_MESH_AGENT_MAX_VIEWS of them; and a shm path is refused once the peer
deregistered the region (it wrote into an unlinked segment before, the data silently lost)."""

from __future__ import annotations

import numpy as np
import pytest

from descforge import Region
from flagcx_mesh import InvalidArgument, MeshError
from flagcx_mesh.agent import Agent

pytestmark = pytest.mark.timeout(120)
SECRET = "binding-views-secret"
N = 4096


def agents(monkeypatch, transport, **env):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", transport)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    b = Agent("target", SECRET, timeout=10)
    a = Agent("initiator", SECRET, timeout=10)
    return a, b, a.connect(b.metadata(), timeout=10)


def attempt(conn, local, remote, n):
    try:
        conn.write(local, remote, n).wait(10)
        return None
    except MeshError as e:
        return e


def mappings_of(shm_name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip("\n").endswith("/dev/shm" + shm_name))


def test_byte_variants_of_one_descriptor_do_not_map_the_segment_again(monkeypatch):
    """why_no_ipc / why_no_vmm and the IPC byte were outside the seal: each variant was a valid
    descriptor of its own, cached with a mapping of its own (300 variants: 300 more mappings)."""
    a, b, conn = agents(monkeypatch, "auto")
    with a, b:
        region = b.alloc(N)
        src = a.register(np.full(N, 0x11, np.uint8))
        conn.write(src, region, N).wait(10)
        assert conn.path_to(region) == "shm"
        r = Region.decode(region.descriptor)
        w = r.win()
        before = mappings_of(w.shm_name.decode())
        for i in range(300):
            field = ("why_no_ipc", "why_no_vmm")[i % 2]
            v = w.__class__(**{**w.__dict__, field: f"variant {i}".encode()})
            e = attempt(conn, src, r.with_win(v).encode(), N)
            assert e is None or (isinstance(e, InvalidArgument) and "agent target" in str(e)), e
        for ipc in range(2, 40):
            enc = bytearray(w.encode())
            enc[24 + 12 + len(w.host) + len(w.ns) + len(w.shm_name) + 20] = ipc  # the IPC byte
            e = attempt(conn, src, Region(**{**r.__dict__, "window": bytes(enc)}).encode(), N)
            assert e is None or (isinstance(e, InvalidArgument) and "agent target" in str(e)), e
        assert mappings_of(w.shm_name.decode()) <= before
        conn.write(src, region, N).wait(10)  # the real descriptor still works


def test_views_per_connection_are_capped(monkeypatch):
    """Descriptors naming a pid that is not the peer's take tcp; each was cached for good."""
    a, b, conn = agents(monkeypatch, "cma", FLAGCX_MESH_AGENT_MAX_VIEWS="16")
    with a, b:
        dst = np.zeros(N, np.uint8)
        region = b.register(dst)
        src = a.register(np.full(N, 0x22, np.uint8))
        r = Region.decode(region.descriptor)
        w = r.win()
        errors = []
        for i in range(40):
            v = w.__class__(**{**w.__dict__, "pid": 4_000_000 + i})  # no such process
            e = attempt(conn, src, r.with_win(v).encode(), N)
            if e is not None:
                assert isinstance(e, InvalidArgument) and "agent target" in str(e), e
                errors.append(str(e))
        assert errors and all("FLAGCX_MESH_AGENT_MAX_VIEWS" in e for e in errors), errors[:2]
        assert len(errors) >= 40 - 16


def test_shm_path_refused_once_the_peer_deregistered_the_region(monkeypatch):
    a, b, conn = agents(monkeypatch, "auto")
    with a, b:
        region = b.alloc(N)
        src = a.register(np.full(N, 0x33, np.uint8))
        conn.write(src, region, N).wait(10)
        assert conn.path_to(region) == "shm"
        desc = region.descriptor
        b.deregister(region)
        e = attempt(conn, src, desc, N)
        assert isinstance(e, InvalidArgument) and "deregistered" in str(e) and "agent target" in str(e), e
