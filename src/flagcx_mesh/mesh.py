"""The Python face of a flagcx_mesh full mesh."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from . import _core

UNIQUE_ID_SIZE = _core.UNIQUE_ID_SIZE


def get_unique_id() -> bytes:
    """Make a new unique id (256 opaque bytes) for one mesh.

    The calling process hosts the rendezvous root for that mesh (a background
    thread listening on an ephemeral port of the chosen interface) until every
    rank has joined and left, so it must stay alive while the mesh is built.
    Send the bytes to every rank by any channel (MPI, a store, a file, env).
    """
    return _core.get_unique_id()


def _timeout_arg(timeout: Optional[float]) -> float:
    if timeout is None:
        return 0.0  # no limit for operations; FLAGCX_MESH_TIMEOUT for the build
    if timeout <= 0:
        raise ValueError(f"timeout must be positive or None, got {timeout!r}")
    return float(timeout)


class Mesh:
    """A full mesh of connections between ``nranks`` processes.

    ``Mesh(nranks, unique_id, rank)`` is collective: every rank calls it with
    the same ``unique_id`` and its own ``rank``; it returns once every rank
    holds a checked send and receive connection to every rank (itself
    included) for each of ``contexts`` contexts, or raises a
    :class:`~flagcx_mesh.errors.MeshError` on every rank naming what is
    missing. ``timeout`` (seconds) bounds the whole build; ``None`` uses
    ``FLAGCX_MESH_TIMEOUT`` (default 60). The GIL is released while it waits.

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        nranks: int,
        unique_id: bytes,
        rank: int,
        contexts: int = 1,
        timeout: Optional[float] = None,
        *,
        header_timeout: float = 5.0,
        max_inflight: int = 64,
        epoch: int = 0,
        _on_phase: Optional[Callable[[str], None]] = None,
    ) -> None:
        self._core = _core.Mesh(
            int(nranks),
            bytes(unique_id),
            int(rank),
            contexts=int(contexts),
            timeout=_timeout_arg(timeout),
            header_timeout=float(header_timeout),
            max_inflight=int(max_inflight),
            epoch=int(epoch),
            on_phase=_on_phase,
        )

    @classmethod
    def from_launcher(cls, contexts: int = 1, timeout: Optional[float] = None, **kw) -> "Mesh":
        """Build the mesh of a job started by ``python -m flagcx_mesh.launch``."""
        from .launch import ranks_from_env

        found = ranks_from_env()
        if found is None:
            raise RuntimeError("not started by python -m flagcx_mesh.launch (FLAGCX_MESH_LAUNCHER unset)")
        rank, nranks, uid = found
        return cls(nranks, uid, rank, contexts=contexts, timeout=timeout, **kw)

    # -- identity -----------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def nranks(self) -> int:
        return self._core.nranks

    @property
    def contexts(self) -> int:
        return self._core.contexts

    @property
    def mesh_id(self) -> str:
        """The random 128-bit id of this mesh, as hex."""
        return self._core.mesh_id

    @property
    def closed(self) -> bool:
        return self._core.closed

    def timings(self) -> Dict[str, float]:
        """Seconds spent in each build phase: listen, rendezvous, connect, wiring, total."""
        return self._core.timings()

    def stats(self) -> dict:
        """Build statistics: foreign connections rejected (by reason) and connect retries."""
        return self._core.stats()

    def describe(self) -> str:
        """One line: rank, size, contexts, interface, build time, rejections."""
        return self._core.describe()

    def __repr__(self) -> str:
        return self.describe()

    # -- two-sided messages -------------------------------------------------
    def send(self, peer: int, data, context: int = 0, timeout: Optional[float] = None) -> None:
        """Send one message (any contiguous buffer) to ``peer`` on ``context``.

        Blocks until the bytes are handed to the kernel. Messages on one
        (peer, context) arrive in order. A large message to oneself needs a
        receiver in another thread.
        """
        self._core.send(peer, data, context, _timeout_arg(timeout))

    def recv(self, peer: int, context: int = 0, timeout: Optional[float] = None) -> bytes:
        """Receive the next message from ``peer`` on ``context``."""
        return self._core.recv(peer, context, _timeout_arg(timeout))

    # -- collectives over the bootstrap -------------------------------------
    def allgather(self, data: bytes, timeout: Optional[float] = None) -> List[bytes]:
        """Every rank's ``data``, indexed by rank (small payloads; via the root)."""
        return self._core.allgather(bytes(data), _timeout_arg(timeout))

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Wait until every rank has reached the barrier."""
        self._core.barrier(_timeout_arg(timeout))

    # -- lifetime -----------------------------------------------------------
    def close(self) -> None:
        """Close every connection and leave the bootstrap. Idempotent."""
        self._core.close()

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
