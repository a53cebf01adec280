"""Unique ids handed from mesh to mesh (the selftest, bench mesh): sealed, never in clear.

docs/security.md: the secret never goes on the wire. Tools that build mesh after mesh hand the
next id out over the current one; they seal it under the current mesh's secret.
"""

import pytest

import flagcx_mesh
from flagcx_mesh import Mesh, ProtocolError, _core
from meshutil import raise_nofile_limit, run_threads
from test_auth import RecordingProxy, root_and_mesh_id, via_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True, scope="module")
def _nofile():
    raise_nofile_limit()


def test_selftest_hands_out_the_next_unique_id_without_its_secret_on_the_wire():
    """`python -m flagcx_mesh.selftest --iterations N` (and `bench mesh`) handed every
    next unique id to the ranks with `mesh.allgather`, i.e. in clear over the bootstrap
    TCP connections through the root. docs/security.md: "The secret never goes on the
    wire" -- a reader of the network (inside the threat model) learns the key of every
    later mesh and can join it. Rank 1 reaches the root through a proxy that records
    both directions; the next id's 32 secret bytes must not be among them."""
    from flagcx_mesh import selftest

    uid = flagcx_mesh.get_unique_id()
    root, _ = root_and_mesh_id(uid)
    proxy = RecordingProxy(root[0], root, both_ways=True)
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
