"""Invariant 8 for agents on host memory (issue 34, items 1 and 3): a descriptor opens only what
the peer at the other end of the connection registered (csrc/transport/binding.h).

- shm: a peer's descriptor "of its own region" naming another file in /dev/shm (a decoy: another
  job's segment) is refused, with the region's real seal and with a seal the peer forged for
  it; the decoy is neither read nor written. Before the fix the initiator mapped the file.
- cma: one changed byte of a descriptor's address, or a changed region index, is refused naming
  the peer; no byte outside the region is touched. Before the fix the write landed beside the
  region (or in region #0 past its end) with no error.
- every byte of a descriptor flipped, over shm, cma and tcp: each op either succeeds inside the
  region or is refused naming the peer (or the descriptor); the guard bytes around the region
  and a decoy file never change.
All in one process (the agents share its pid: the peer's process is proven through the socket
table as for any peer on this host).
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

from descforge import Region, SealCell
from flagcx_mesh import InvalidArgument, MeshError
from flagcx_mesh.agent import Agent

pytestmark = pytest.mark.timeout(120)
SECRET = "binding-secret"
N = 4096
GUARD = 4096


@pytest.fixture
def decoy():
    """A file in /dev/shm that no agent registered, full of 0xD0."""
    name = f"fxm-test-decoy-{os.getpid()}-{time.monotonic_ns()}"
    path = "/dev/shm/" + name
    with open(path, "wb") as f:
        f.write(b"\xd0" * (4 * N))
    yield "/" + name, path
    os.unlink(path)


def decoy_intact(path) -> bool:
    with open(path, "rb") as f:
        return f.read() == b"\xd0" * (4 * N)


def agents(monkeypatch, transport):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", transport)
    b = Agent("target", SECRET, timeout=10)
    a = Agent("initiator", SECRET, timeout=10)
    return a, b, a.connect(b.metadata(), timeout=10)


def attempt(conn, local, remote, n, read):
    """None when the op went through, else its error (which must be a refusal naming the peer)."""
    try:
        h = (conn.read if read else conn.write)(local, remote, n)
        h.wait(10)
        return None
    except MeshError as e:
        return e


def test_shm_descriptor_naming_a_file_the_peer_does_not_map_is_refused(monkeypatch, decoy):
    name, path = decoy
    a, b, conn = agents(monkeypatch, "auto")
    with a, b:
        real = b.alloc(N)
        src = a.register(np.full(N, 0x11, np.uint8))
        dst = np.zeros(N, np.uint8)
        back = a.register(dst)
        r = Region.decode(real.descriptor)
        w = r.win()
        assert w.kind == 2 and w.shm_name, w
        forged = r.with_win(w.__class__(**{**w.__dict__, "shm_name": name.encode()})).encode()
        for read in (False, True):
            e = attempt(conn, back if read else src, forged, N, read)
            assert isinstance(e, InvalidArgument) and "agent target" in str(e), e
            assert "not what the peer agent registered" in str(e), e
        # The peer seals the forged description in its own memory (another region of it): the
        # file must still be the one its process maps at the described address.
        r = Region.decode(b.alloc(N).descriptor)
        w = r.win()
        cell = SealCell()
        sealed = cell.publish(w.__class__(**{**w.__dict__, "shm_name": name.encode()}), r.index)
        forged = r.with_win(sealed).encode()
        for read in (False, True):
            attempt(conn, back if read else src, forged, N, read)  # the peer's own memory, never the file
            assert conn.path_to(forged) != "shm", conn.path_to(forged)
        assert decoy_intact(path)
        assert not (dst == 0xD0).any()


def guarded(agent, fill=0):
    """A region of N bytes between two guards of GUARD bytes (0xEE), in one array."""
    whole = np.full(GUARD + N + GUARD, 0xEE, np.uint8)
    whole[GUARD:GUARD + N] = fill
    return whole, agent.register(whole[GUARD:GUARD + N])


def guards_intact(whole) -> bool:
    return bool((whole[:GUARD] == 0xEE).all() and (whole[GUARD + N:] == 0xEE).all())


def test_cma_descriptor_with_a_changed_address_or_index_is_refused(monkeypatch):
    a, b, conn = agents(monkeypatch, "cma")
    with a, b:
        small = np.zeros(64, np.uint8)
        r0 = b.register(small)  # region #0: 64 bytes
        whole, r1 = guarded(b)
        src = a.register(np.full(N, 0x42, np.uint8))
        conn.write(src, r0, 64).wait(10)  # region #0's path is chosen and cached
        assert conn.path_to(r0) == "cma"
        small[:] = 0
        reg = Region.decode(r1.descriptor)
        w = reg.win()
        for delta in (GUARD, -GUARD, 1 << 12, 1):
            moved = reg.with_win(w.__class__(**{**w.__dict__, "addr": w.addr + delta})).encode()
            e = attempt(conn, src, moved, N if delta > 0 else 64, False)
            assert isinstance(e, InvalidArgument) and "agent target" in str(e), e
        as0 = reg.with_win(w, index=r0.index).encode()  # region #1's descriptor, index of #0
        e = attempt(conn, src, as0, N, False)
        assert isinstance(e, InvalidArgument) and "agent target" in str(e) and "region #0" in str(e), e
        assert guards_intact(whole) and not whole[GUARD:GUARD + N].any() and not small.any()
        conn.write(src, r1, N).wait(10)  # the real descriptor still works
        assert (whole[GUARD:GUARD + N] == 0x42).all() and guards_intact(whole)


def fresh_region(b, transport):
    """(guarded array or None, the region's own bytes, Region): N bytes of 0x55 at the target."""
    if transport == "shm":
        region = b.alloc(N)
        mine = np.frombuffer(region.view, np.uint8)
        whole = None  # (a segment has no guard of its own: the decoy file stands for what lies outside)
    else:
        whole, region = guarded(b, fill=0x55)
        mine = whole[GUARD:GUARD + N]
    mine[:] = 0x55
    return whole, mine, region


@pytest.mark.parametrize("transport", ["cma", "shm", "tcp"])
def test_every_byte_of_a_descriptor_flipped_touches_nothing_outside(monkeypatch, transport, decoy):
    """Each flip on a fresh region of its own (a path is chosen for it afresh): a write of 0x55 and
    a read; guards, the decoy and the initiator's bytes beyond its region never change."""
    _, decoy_path = decoy
    a, b, conn = agents(monkeypatch, "auto" if transport == "shm" else transport)
    with a, b:
        src = a.register(np.full(N, 0x55, np.uint8))  # writes keep the region's bytes as they were
        back_arr = np.full(N + GUARD, 0xEE, np.uint8)
        back = a.register(back_arr[:N])
        _, _, first = fresh_region(b, transport)
        conn.write(src, first, N).wait(10)
        assert conn.path_to(first) == transport
        started, refused, regions = time.monotonic(), 0, []
        for i in range(len(first.descriptor)):
            whole, mine, region = fresh_region(b, transport)
            regions.append((whole, mine))
            bad = bytearray(region.descriptor)
            bad[i] ^= 0xFF if i % 2 else 0x01
            for read in (False, True):
                e = attempt(conn, back if read else src, bytes(bad), N, read)
                if e is not None:
                    refused += 1
                    assert isinstance(e, InvalidArgument), (i, str(e))
                    assert "agent target" in str(e) or "region descriptor" in str(e), (i, str(e))
            assert whole is None or guards_intact(whole), f"byte {i}: a guard byte changed"
            assert decoy_intact(decoy_path), f"byte {i}: the decoy file changed"
            assert (back_arr[N:] == 0xEE).all(), f"byte {i}: a read ran past the local region"
            assert set(np.unique(back_arr[:N])) <= {0x55, 0xEE}, f"byte {i}: a read brought outside bytes"
        print(f"FUZZ {transport}: {len(regions)} bytes flipped, {refused} of {2 * len(regions)} ops refused")
        assert refused > 0
        assert all((mine == 0x55).all() and (whole is None or guards_intact(whole)) for whole, mine in regions)
        assert time.monotonic() - started < 60
        conn.write(src, first, N).wait(10)  # the connection still works


def test_map_of_a_decoy_in_this_process_is_not_enough_without_the_address(monkeypatch, decoy):
    """The segment must be mapped by the peer's process at the described address, not anywhere."""
    name, path = decoy
    a, b, conn = agents(monkeypatch, "auto")
    with a, b:
        fd = os.open(path, os.O_RDWR)
        m = mmap.mmap(fd, 4 * N)  # this process (the peer's too) maps the decoy somewhere
        os.close(fd)
        real = b.alloc(N)
        r = Region.decode(real.descriptor)
        w = r.win()
        cell = SealCell()
        forged = r.with_win(cell.publish(w.__class__(**{**w.__dict__, "shm_name": name.encode()}), r.index)).encode()
        src = a.register(np.full(N, 0x11, np.uint8))
        attempt(conn, src, forged, N, False)
        assert conn.path_to(forged) != "shm"
        m.close()
        assert decoy_intact(path)


@pytest.mark.parametrize("sealed", [False, True])
def test_compat_p2p_table_naming_a_dev_shm_file_writes_nothing_there(monkeypatch, decoy, sealed):
    """compat.p2p takes a peer's regions from the table the peer serves: a liar's table whose
    range is "its own" shm region naming the decoy file. Before the fix the write mapped the file."""
    import threading

    from flagcx_mesh.compat import FlagcxError
    from flagcx_mesh.compat import _p2p_table as table
    from flagcx_mesh.compat import p2p

    name, path = decoy
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "auto")
    writer = p2p.engine_create(secret=SECRET, timeout=10)
    stop = threading.Event()
    cell = SealCell()
    with Agent("liar", SECRET) as liar:
        r = Region.decode(liar.alloc(N).descriptor)
        w = r.win().__class__(**{**r.win().__dict__, "shm_name": name.encode()})
        forged = r.with_win(cell.publish(w, r.index) if sealed else w).encode()
        base = 1 << 40

        def answer():
            while not stop.is_set():
                for n in liar.notifications(0.1):
                    kind, rid, _ = table.parse(n.data)
                    liar.connection(n.peer).notify(table.encode_table(rid, [table.Span(base, N, forged)]))

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        try:
            src = np.full(N, 0x11, np.uint8)
            writer.register(src)
            conn = writer.get_conn(liar.address)
            try:
                conn.batch_write_sync([src.ctypes.data], [base], [N])
            except FlagcxError as e:
                assert "agent liar" in str(e), e
            assert decoy_intact(path)
        finally:
            stop.set()
            t.join(5)
            writer.destroy()


def _deep_dir(base: str, length: int) -> str:
    """A directory under `base` whose path is about `length` characters (components of 200)."""
    d = base
    while len(d) < length - 201:
        d = os.path.join(d, "n" * 200)
    d = os.path.join(d, "n" * max(1, length - len(d) - 1))
    os.makedirs(d, exist_ok=True)
    return d


def assert_sealed_claim_of_segment_refused(monkeypatch, name, path, addr):
    """The peer publishes its region under the decoy's segment name at `addr`, with a seal that
    matches: the shm path must still not be taken, and the decoy stays as it was."""
    a, b, conn = agents(monkeypatch, "auto")
    with a, b:
        r = Region.decode(b.alloc(N).descriptor)
        w = r.win()
        cell = SealCell()
        forged = r.with_win(cell.publish(w.__class__(**{**w.__dict__, "shm_name": name.encode(), "addr": addr}),
                                         r.index)).encode()
        src = a.register(np.full(N, 0x11, np.uint8))
        attempt(conn, src, forged, N, False)
        assert conn.path_to(forged) != "shm", conn.path_to(forged)
        assert decoy_intact(path)


def test_shm_maps_line_split_by_a_long_path_is_not_a_line_of_its_own(monkeypatch, decoy, tmp_path):
    """The peer maps a file whose path runs past 1023 characters, its tail written as a maps line
    "X-Y rw-s 0 dev ino" naming the decoy at an address X of its choice, and describes its region
    as the decoy at X (sealed). A reader of 1024-byte chunks took the tail as a line of its own and
    mapped the decoy; whole lines are read now."""
    name, path = decoy
    st = os.stat(path)
    fake_addr = 0x3F5A00000000
    fake = f"{fake_addr:x}-{fake_addr + 4 * N:x} rw-s 00000000 {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino}"
    d = _deep_dir(str(tmp_path), 850)
    first = os.path.join(d, "x")
    with open(first, "wb") as f:
        f.write(bytes(4 * N))
    fd = os.open(first, os.O_RDWR)
    m = mmap.mmap(fd, 4 * N)
    os.close(fd)
    try:
        with open("/proc/self/maps") as f:
            line = next(x for x in f if x.rstrip("\n").endswith(first))
        prefix = len(line) - len(first) - 1  # where the path starts in its maps line
        pad = 1023 - prefix - len(d) - 1  # the tail starts at the 1024th character
        assert 0 < pad and pad + len(fake) < 255, (prefix, len(d))
        os.rename(first, os.path.join(d, "p" * pad + fake))  # the maps line shows the new path
        assert_sealed_claim_of_segment_refused(monkeypatch, name, path, fake_addr)
    finally:
        m.close()


def test_shm_private_mapping_of_the_file_does_not_bind_it(monkeypatch, decoy):
    """The peer maps the decoy privately (copy-on-write, "rw-p") and describes that address as its
    region's segment: only a shared writable mapping ("rw?s") is the peer's segment."""
    import ctypes

    name, path = decoy
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 4 * N, access=mmap.ACCESS_COPY)
    os.close(fd)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    try:
        assert_sealed_claim_of_segment_refused(monkeypatch, name, path, addr)
    finally:
        del addr
        import gc

        gc.collect()
        try:
            m.close()
        except BufferError:
            pass
