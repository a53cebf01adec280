"""Descriptors: bad ones (out of range, another agent's, a deregistered
region, malformed bytes) are refused with a clear error and nothing is
written; a batch is checked whole before any byte moves; notifications follow
their data in order; regions come and go while a peer transfers elsewhere."""

import time

import numpy as np
import pytest

from flagcx_mesh import InvalidArgument
from flagcx_mesh.agent import Agent, region_info

pytestmark = pytest.mark.timeout(120)
SECRET = "descriptor-secret"


@pytest.fixture(params=["tcp", "cma"])
def pair(request, monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", request.param)
    with Agent("target", SECRET, timeout=20) as b, Agent("initiator", SECRET, timeout=20) as a:
        yield a, b, a.connect(b.metadata(), timeout=10), request.param


def test_descriptor_round_trip_and_malformed_bytes(pair):
    a, b, conn, _ = pair
    r = b.register(np.zeros(100, np.uint8))
    info = region_info(r.descriptor)
    assert info == {"agent": "target", "incarnation": b.incarnation, "index": r.index, "size": 100, "kind": "user"}
    for bad in (b"", b"junk", r.descriptor[:-1], r.descriptor + b"x"):
        with pytest.raises(InvalidArgument, match="region descriptor"):
            region_info(bad)
    with pytest.raises(InvalidArgument):
        conn.write(a.register(np.zeros(8, np.uint8)), b"junk" * 10, 8)


def test_out_of_range_is_refused_and_nothing_written(pair):
    a, b, conn, _ = pair
    dst = np.zeros(1000, np.uint8)
    remote = b.register(dst)
    src = np.full(1000, 7, np.uint8)
    local = a.register(src)
    with pytest.raises(InvalidArgument, match="out of range of its region"):
        conn.write(local, remote, 100, remote_offset=950)
    with pytest.raises(InvalidArgument, match="out of range of local region"):
        conn.write(local, remote, 100, local_offset=901)
    with pytest.raises(InvalidArgument, match="out of range"):
        conn.write(local, remote, 2**64 - 1, remote_offset=1)
    with pytest.raises(InvalidArgument, match="out of range"):
        conn.batch_write([(local, 0, remote, 0, 10), (local, 0, remote, 999, 10)])
    conn.write(local, remote, 1, remote_offset=999).wait(10)  # the connection still works
    assert dst[:999].sum() == 0 and dst[999] == 7


def test_another_agents_descriptors_are_refused(pair, monkeypatch):
    a, b, conn, _ = pair
    with Agent("third", SECRET) as c:
        third_buf = np.zeros(100, np.uint8)
        theirs = c.register(third_buf)
        local = a.register(np.ones(100, np.uint8))
        with pytest.raises(InvalidArgument, match="region of agent third, not of this connection's peer"):
            conn.write(local, theirs, 10)
        with pytest.raises(InvalidArgument, match="not this agent's"):
            conn.write(theirs, b.register(np.zeros(100, np.uint8)), 10)
        assert third_buf.sum() == 0


def test_deregistered_region_is_refused_by_the_target(pair):
    a, b, conn, _ = pair
    dst = np.zeros(4096, np.uint8)
    gone = b.register(dst)
    keep_buf = np.zeros(4096, np.uint8)
    keep = b.register(keep_buf)
    local = a.register(np.full(4096, 3, np.uint8))
    back = a.register(np.zeros(4096, np.uint8))
    gone.deregister()
    with pytest.raises(InvalidArgument, match="deregistered"):
        conn.write(local, gone, 4096).wait(10)
    with pytest.raises(InvalidArgument, match="deregistered"):
        conn.read(back, gone, 4096).wait(10)
    assert dst.sum() == 0
    conn.write(local, keep, 4096).wait(10)  # refused ops leave the connection usable
    assert (keep_buf == 3).all()
    with pytest.raises(InvalidArgument, match="deregistered"):
        b.deregister(gone)


def test_region_deregistered_after_its_path_was_chosen(pair):
    a, b, conn, transport = pair
    dst = np.zeros(4096, np.uint8)
    remote = b.register(dst)
    local = a.register(np.full(4096, 5, np.uint8))
    conn.write(local, remote, 16).wait(10)
    assert conn.path_to(remote) == transport
    remote.deregister()
    dst[:] = 0
    with pytest.raises(InvalidArgument, match="deregistered"):
        conn.write(local, remote, 4096).wait(10)
    assert dst.sum() == 0


def test_local_region_deregistered_is_refused(pair):
    a, b, conn, _ = pair
    remote = b.register(np.zeros(64, np.uint8))
    local = a.register(np.ones(64, np.uint8))
    local.deregister()
    with pytest.raises(InvalidArgument, match="local region #0 was deregistered"):
        conn.write(local, remote, 64)


def test_notifications_follow_their_data_in_order(pair):
    a, b, conn, _ = pair
    n = 50
    dst = np.zeros(n * 1024, np.uint8)
    remote = b.register(dst)
    src = np.zeros(n * 1024, np.uint8)
    local = a.register(src)
    for i in range(n):
        src[i * 1024:(i + 1) * 1024] = i + 1
        conn.write(local, remote, 1024, local_offset=i * 1024, remote_offset=i * 1024,
                   notification=str(i).encode())
    seen = []
    while len(seen) < n:
        got = b.notifications(timeout=10)
        assert got, f"only {len(seen)} of {n} notifications arrived"
        for note in got:
            i = int(note.data)
            assert note.peer == "initiator"
            assert (dst[i * 1024:(i + 1) * 1024] == i + 1).all(), f"notification {i} came before its data"
            seen.append(i)
    assert seen == list(range(n))


def _patterned_pair(a, b, modulus):
    """64 KiB: a zeroed target region at b, a source at a holding i % modulus; (dst, remote, src, local)."""
    dst = np.zeros(1 << 16, np.uint8)
    src = (np.arange(1 << 16) % modulus).astype(np.uint8)
    return dst, b.register(dst), src, a.register(src)


def test_batch_write_and_read(pair):
    a, b, conn, transport = pair
    dst, remote, src, local = _patterned_pair(a, b, 253)
    ops = [(local, i * 4096, remote, (15 - i) * 4096, 4096) for i in range(16)]
    h = conn.batch_write(ops, notification=b"batch")
    h.wait(10)
    assert h.done()
    for i in range(16):
        assert (dst[(15 - i) * 4096:(16 - i) * 4096] == src[i * 4096:(i + 1) * 4096]).all()
    assert [x.data for x in b.notifications(timeout=10)] == [b"batch"]
    back = np.zeros(1 << 16, np.uint8)
    lb = a.register(back)
    conn.batch_read([(lb, i * 4096, remote, i * 4096, 4096) for i in range(16)]).wait(10)
    assert (back == dst).all()
    assert conn.path_to(remote) == transport


def test_register_and_deregister_while_a_peer_transfers(pair):
    a, b, conn, _ = pair
    busy = np.zeros(1 << 20, np.uint8)
    remote = b.register(busy)
    local = a.register(np.full(1 << 20, 9, np.uint8))
    handles = []
    for i in range(20):
        handles.append(conn.write(local, remote, 1 << 20))
        extra = b.register(np.zeros(4096, np.uint8))  # registration while writes are in flight
        extra.deregister()
    for h in handles:
        h.wait(20)
    assert (busy == 9).all()


def test_write_sync_and_read_sync(pair):
    a, b, conn, _ = pair
    dst, remote, src, local = _patterned_pair(a, b, 251)
    assert conn.write_sync(local, remote, 4096, local_offset=4096, remote_offset=8192,
                           notification=b"sync", timeout=10) is None
    assert (dst[8192:12288] == src[4096:8192]).all() and dst[:8192].sum() == 0 and dst[12288:].sum() == 0
    assert [x.data for x in b.notifications(timeout=10)] == [b"sync"]
    back = np.zeros(4096, np.uint8)
    conn.read_sync(a.register(back), remote, 4096, remote_offset=8192)
    assert (back == src[4096:8192]).all()
    with pytest.raises(InvalidArgument, match="out of range of its region"):
        conn.write_sync(local, remote, 100, remote_offset=(1 << 16) - 99)
    with pytest.raises(InvalidArgument, match="local_offset must be a non-negative int"):
        conn.write_sync(local, remote, 1, local_offset=-1)
    assert dst[(1 << 16) - 99:].sum() == 0  # nothing of the refused calls was written


def test_a_handle_keeps_its_connection_and_agent_alive(monkeypatch):
    import gc

    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    with Agent("target", SECRET, timeout=20) as b:
        dst = np.zeros(1 << 20, np.uint8)
        remote = b.register(dst)
        a = Agent("initiator", SECRET, timeout=20)
        conn = a.connect(b.metadata(), timeout=10)
        h = conn.write(a.register(np.full(1 << 20, 3, np.uint8)), remote, 1 << 20)
        del a, conn
        gc.collect()
        h.wait()  # 0: the initiator agent's own timeout, read from the agent the handle keeps
        assert h.done() and "agent target" in h.call
        assert (dst == 3).all()
        time.sleep(0.5)  # were the initiator closed, the target would see its goodbye by now
        assert [p[0] for p in b.peers()] == ["initiator"]
        del h
        gc.collect()
        deadline = time.monotonic() + 10
        while b.peers() and time.monotonic() < deadline:  # the last handle gone, the agent closes
            time.sleep(0.05)
        assert b.peers() == []


@pytest.mark.parametrize("call", ["write", "read", "write_sync", "read_sync"])
def test_a_calls_arguments_are_checked_and_nothing_moves(pair, call):
    a, b, conn, _ = pair
    dst = np.zeros(4096, np.uint8)
    remote = b.register(dst)
    src = np.full(4096, 9, np.uint8)
    local = a.register(src)
    f = getattr(conn, call)
    for kw, bad in (("local_offset", -1), ("remote_offset", True), ("size", 2**64), ("size", 1.0),
                    ("local_offset", "0")):
        args = {"local_offset": 0, "remote_offset": 0, "size": 16, kw: bad}
        with pytest.raises(InvalidArgument, match=f"{kw} must be a non-negative int below 2\\*\\*64, got {bad!r}"):
            f(local, remote, args.pop("size"), **args)
    for bad in (None, 12, "descriptor", np.zeros(3)):
        with pytest.raises(InvalidArgument, match=r"remote must be a Region or descriptor bytes \(bytes, bytearray"):
            f(local, bad, 16)
    released = memoryview(remote.descriptor)
    released.release()
    with pytest.raises(ValueError):  # what bytes() of it raises, not a SystemError
        f(local, released, 16)

    class Broken:
        @property
        def descriptor(self):
            raise KeyError("from the property")

    with pytest.raises(KeyError, match="from the property"):  # its own error, not "not a Region"
        f(Broken(), remote, 16)
    assert dst.sum() == 0 and (src == 9).all()
    done = f(local.descriptor, bytearray(remote.descriptor), 16)  # bytes and bytes-like name regions too
    if done is not None:
        done.wait(10)
    assert (dst[:16] == 9).all() if call.startswith("write") else (src[:16] == 0).all()


def test_a_batchs_ops_are_checked_by_position_and_nothing_moves(pair):
    a, b, conn, _ = pair
    dst = np.zeros(4096, np.uint8)
    remote = b.register(dst)
    local = a.register(np.full(4096, 5, np.uint8))
    good = (local, 0, remote, 0, 16)
    for bad, words in (((local, 0, remote, 0, 2**64), r"op 1: size must be a non-negative int below 2\*\*64"),
                       ((local, -1, remote, 0, 16), "op 1: local_offset must be a non-negative int"),
                       ((local, 0, remote, False, 16), "op 1: remote_offset must be a non-negative int"),
                       ((local, 0, "x", 0, 16), "op 1: remote must be a Region or descriptor bytes"),
                       ((local, 0, remote), r"op 1: a transfer is \(local, local_offset, remote, remote_offset, size\)")):
        with pytest.raises(InvalidArgument, match=words):
            conn.batch_write([good, bad])
    assert dst.sum() == 0
    conn.batch_write(iter([list(good), (local.descriptor, 16, bytearray(remote.descriptor), 16, 16)])).wait(10)
    assert (dst[:32] == 5).all() and dst[32:].sum() == 0
