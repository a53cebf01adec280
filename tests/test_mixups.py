"""Mix-ups between ranks or calls that must fail loudly, naming what was mixed up: collectives
of different kinds, registrations of different kinds, a unique id used twice or whose root is
gone, signal comparisons, a bad signal op. Ranks as threads in this process unless a test says
otherwise."""

from __future__ import annotations

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import InvalidArgument, Mesh, MeshError
from meshutil import run_threads

pytestmark = pytest.mark.timeout(120)


def thread_meshes(n=2):
    uid = flagcx_mesh.get_unique_id()
    return run_threads(n, lambda r: Mesh(n, uid, r, timeout=30), timeout=45)


def close_all(meshes):
    for m in meshes:
        m.close()


def test_bad_signal_op_raises_invalid_argument():
    """Regression test (issue 17, item 12): put_signal(op="xor") raised a plain ValueError,
    not the library's InvalidArgument (a MeshError)."""
    meshes = thread_meshes(2)
    try:
        def body(r):
            m = meshes[r]
            u = m.register_window(np.zeros(64, np.uint8))
            m.signal_window(1)
            for call in (lambda: m.put_signal(1 - r, u, 0, u, 0, 8, 0, op="xor"),
                         lambda: m.signal(1 - r, 0, op="xor")):
                with pytest.raises(InvalidArgument, match="'xor'") as e:
                    call()
                assert isinstance(e.value, MeshError) and f"rank {r}" in str(e.value)
            m.barrier(timeout=10)
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)
