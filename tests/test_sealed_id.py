"""Unique ids handed from mesh to mesh (the selftest, bench mesh): sealed, never in clear.

docs/security.md: the secret never goes on the wire. Tools that build mesh after mesh hand the
next id out over the current one; they seal it under the current mesh's secret.
"""

import socket
import threading

import pytest

import flagcx_mesh
from flagcx_mesh import Mesh, ProtocolError, _core
from meshutil import raise_nofile_limit, run_threads
from test_auth import root_and_mesh_id, via_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True, scope="module")
def _nofile():
    raise_nofile_limit()


class BothWaysProxy:
    """Forwards one connection to `target` and records the bytes of both directions."""

    def __init__(self, host, target):
        self.srv = socket.create_server((host, 0))
        self.port = self.srv.getsockname()[1]
        self.target = target
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _pump(self, a, b):
        try:
            while True:
                chunk = a.recv(65536)
                if not chunk:
                    break
                with self.lock:
                    self.seen += chunk
                b.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _serve(self):
        client, _ = self.srv.accept()
        upstream = socket.create_connection(self.target)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def recorded(self):
        with self.lock:
            return bytes(self.seen)


def test_selftest_hands_out_the_next_unique_id_without_its_secret_on_the_wire():
    """`python -m flagcx_mesh.selftest --iterations N` (and `bench mesh`) hands every
    next unique id to the ranks with `mesh.allgather`, i.e. in clear over the bootstrap
    TCP connections through the root. docs/security.md: "The secret never goes on the
    wire" -- a reader of the network (inside the threat model) learns the key of every
    later mesh and can join it. Rank 1 reaches the root through a proxy that records
    both directions; the next id's 32 secret bytes must not be among them."""
    from flagcx_mesh import selftest

    uid = flagcx_mesh.get_unique_id()
    root, _ = root_and_mesh_id(uid)
    proxy = BothWaysProxy(root[0], root)
    uids = [uid, via_port(uid, proxy.port)]

    def rank(r):
        with Mesh(2, uids[r], r, timeout=20) as m:
            return selftest._next_uid(m, uids[r])

    nxt = run_threads(2, rank, timeout=60)
    assert nxt[0] == nxt[1]
    secret = nxt[0][52:84]
    assert secret != bytes(32)
    leaked = secret in proxy.recorded()
    assert not leaked, (
        "the next mesh's secret key crossed the network in clear (selftest._next_uid)")


def test_a_sealed_id_opens_only_with_the_shared_secret():
    a, b, nxt = flagcx_mesh.get_unique_id(), flagcx_mesh.get_unique_id(), flagcx_mesh.get_unique_id()
    sealed = _core.seal_unique_id(a, nxt)
    assert nxt[52:84] not in sealed and _core.unseal_unique_id(a, sealed) == nxt
    with pytest.raises(ProtocolError, match="not sealed under this mesh's secret"):
        _core.unseal_unique_id(b, sealed)
    forged = bytearray(sealed)
    forged[40] ^= 1
    with pytest.raises(ProtocolError):
        _core.unseal_unique_id(a, bytes(forged))
