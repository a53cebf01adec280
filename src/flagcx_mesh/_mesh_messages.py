"""The mesh's messages: two-sided send / recv per (peer, context), and allgather / barrier over
the bootstrap. A part of :class:`flagcx_mesh.Mesh` (a mixin over its core)."""

from __future__ import annotations

from typing import List, Optional

from ._args import _bytes_like, _names_bad_ints
from ._timeouts import call_timeout


class MeshMessages:
    """Messages between the ranks of a mesh (``self._core``: the built mesh)."""

    # -- two-sided messages -------------------------------------------------
    @_names_bad_ints("peer", "context")
    def send(self, peer: int, data, context: int = 0, timeout: Optional[float] = None) -> None:
        """Send one message (any contiguous buffer) to ``peer`` on ``context``.

        The bytes are copied into the progress engine's queue and the call
        returns; messages on one (peer, context) arrive in order. ``timeout``
        bounds the wait when 64 MiB of messages are already queued for that
        pair (back-pressure). Delivery failures surface in later calls (a lost
        peer raises ``PeerLost``).
        """
        seconds = call_timeout(timeout, "send: timeout")
        self._core.send(peer, _bytes_like(data, "send: data"), context, seconds)

    @_names_bad_ints("peer", "context")
    def recv(self, peer: int, context: int = 0, timeout: Optional[float] = None) -> bytes:
        """Receive the next message from ``peer`` on ``context``."""
        return self._core.recv(peer, context, call_timeout(timeout, "recv: timeout"))

    # -- collectives over the bootstrap -------------------------------------
    def allgather(self, data: bytes, timeout: Optional[float] = None) -> List[bytes]:
        """Every rank's ``data``, indexed by rank (small payloads; via the root)."""
        seconds = call_timeout(timeout, "allgather: timeout")
        return self._core.allgather(_bytes_like(data, "allgather: data").tobytes(), seconds)

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Wait until every rank has reached the barrier."""
        self._core.barrier(call_timeout(timeout, "barrier: timeout"))
