"""Bootstrap allgather sizes: a part whose result cannot fit the root's reply limit is
refused before it is sent, on every rank, and the bootstrap stream stays usable.

Regression: 2 x 40 MiB made the root build an 80 MiB reply the clients refused to read; the
unread bytes stayed on the stream and every later collective (window registration
included) failed."""

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import Mesh
from flagcx_mesh.errors import InvalidArgument

from meshutil import run_threads

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
LIMIT = 64 * MiB  # csrc/bootstrap/proto.h kMaxPayload


def meshes_of(n):
    uid = flagcx_mesh.get_unique_id()
    return run_threads(n, lambda r: Mesh(n, uid, r, timeout=30), timeout=45)


def after_refusal_everything_works(m, r, n):
    """A normal allgather, a barrier and a window registration on every rank."""
    assert m.allgather(b"ok%d" % r, timeout=20) == [b"ok%d" % i for i in range(n)]
    m.barrier(timeout=20)
    w = m.alloc_window(4096)
    u = m.register_window(np.zeros(64, np.uint8))
    assert (w.index, u.index) == (0, 1)
    m.barrier(timeout=20)
    return True


@pytest.mark.parametrize("sizes", [(40 * MiB, 40 * MiB), (40 * MiB, 8)], ids=["both", "one"])
def test_oversized_allgather_fails_cleanly_then_the_stream_works(sizes):
    n = len(sizes)
    meshes = meshes_of(n)

    def body(r):
        m = meshes[r]
        with pytest.raises(InvalidArgument) as e:
            m.allgather(bytes(sizes[r]), timeout=30)
        text = str(e.value)
        assert "limit" in text and str(LIMIT // n - 8) in text, text
        assert "rank 0" in text, text  # names a rank whose part was too large
        return after_refusal_everything_works(m, r, n)

    try:
        assert run_threads(n, body, timeout=90) == [True] * n
    finally:
        for m in meshes:
            m.close()


def test_per_rank_limit_scales_with_nranks():
    """With 4 ranks a 20 MiB part is refused (4 x 20 MiB > 64 MiB) though it is below the
    64 MiB message limit; a part just at the limit goes through."""
    n = 4
    meshes = meshes_of(n)
    per_rank = LIMIT // n - 8

    def body(r):
        m = meshes[r]
        with pytest.raises(InvalidArgument, match="limit"):
            m.allgather(bytes(20 * MiB), timeout=30)
        parts = m.allgather(bytes([r]) * per_rank, timeout=60)
        assert [len(p) for p in parts] == [per_rank] * n and parts[n - 1][0] == n - 1
        return after_refusal_everything_works(m, r, n)

    try:
        assert run_threads(n, body, timeout=110) == [True] * n
    finally:
        for m in meshes:
            m.close()


def test_bootstrap_relay_and_allgather_refused_then_the_stream_works():
    """The bootstrap the net builders use (NetBootstrap): a relayed message above 64 KiB and
    an allgather part above the per-rank limit are refused before anything is sent; then a
    relay, an allgather and a barrier work on both ranks."""
    from flagcx_mesh.netbuild import NetBootstrap

    uid = flagcx_mesh.get_unique_id()

    def body(r):
        boot = NetBootstrap(2, uid, r, 20.0)
        try:
            with pytest.raises(InvalidArgument, match="at most 65536"):
                boot.send(1 - r, 5, bytes((64 << 10) + 1))
            with pytest.raises(InvalidArgument, match="limit"):
                boot.allgather(bytes(40 * MiB), 30.0)
            boot.send(1 - r, 5, b"small %d" % r)
            assert boot.recv(1 - r, 5, 20.0) == b"small %d" % (1 - r)
            assert boot.allgather(b"%d" % r, 20.0) == [b"0", b"1"]
            boot.barrier(20.0)
            return True
        finally:
            boot.close()

    assert run_threads(2, body, timeout=90) == [True, True]
