"""What a waiter reads when its peer closes its mesh: never that the peer's process exited or was
killed (docs/python-api.md, one-sided operations). The peer here closes with more messages queued to this
rank than the connection takes, so its goodbye stays queued behind them past close's 1 s."""

import pytest

import flagcx_mesh
from flagcx_mesh import Mesh, PeerLost
from meshutil import run_threads

pytestmark = pytest.mark.timeout(90)


def test_a_peer_that_closed_with_frames_unsent_is_not_called_dead():
    uid = flagcx_mesh.get_unique_id()
    m0, m1 = run_threads(2, lambda r: Mesh(2, uid, r, timeout=30, max_unreceived=1 << 20), timeout=45)
    try:
        data = b"x" * (1 << 20)
        for _ in range(64):  # rank 1 reads 1 MiB, then pauses that connection
            m0.send(1, data, timeout=5)
        m0.close()  # waits for the queue, then gives up on it: the goodbye is never sent
        received = 0
        with pytest.raises(PeerLost) as err:
            while received < 64:
                assert m1.recv(0, timeout=10) == data
                received += 1
        text = str(err.value)
        assert "exited or was killed" not in text, text
        assert "peer 0" in text or "before its goodbye" in text, text
        assert received < 64, (received, text)  # frames were left unsent: the case at hand
    finally:
        m1.close()
        m0.close()
