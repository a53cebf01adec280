"""The Python face of a flagcx_mesh full mesh."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from . import _core

from ._mesh_messages import MeshMessages
from ._mesh_onesided import MeshOneSided
from ._timeouts import build_timeout
from .errors import InvalidArgument

UNIQUE_ID_SIZE = _core.UNIQUE_ID_SIZE


def get_unique_id(epoch: int = 0) -> bytes:
    """Make a new unique id (256 opaque bytes) for one mesh.

    The id holds a fresh secret key; joins and connections prove they know it
    without sending it (see docs/security.md), so treat the bytes as a
    credential. ``epoch`` (32 bits) is bound into the keys on the wire: a rank
    started with another epoch is refused.

    The calling process hosts the rendezvous root for that mesh (a background
    thread listening on an ephemeral port of the chosen interface) until every
    rank has joined and left, so it must stay alive while the mesh is built.
    Send the bytes to every rank by any channel (MPI, a store, a file, env).
    """
    return _core.get_unique_id(int(epoch))


def release_unique_id(unique_id: bytes) -> bool:
    """End the rendezvous root of an id this process made that no rank has joined.

    Its thread ends and its port closes before this returns ``True``. ``False`` when
    the id is not a live root of this process (already ended, made elsewhere) or a
    rank has joined it (that root lives on until its ranks leave). The id is plain
    bytes, so dropping it tells the library nothing: an id that is never used is
    ended by this call, or by itself after ``FLAGCX_MESH_ROOT_IDLE_TIMEOUT`` seconds
    (default 600) without a join.
    """
    try:
        raw = bytes(memoryview(unique_id))
    except TypeError:
        raise InvalidArgument(f"release_unique_id: unique_id must be bytes, got {type(unique_id).__name__}") from None
    return _core.release_unique_id(raw)


class Mesh(MeshMessages, MeshOneSided):
    """A full mesh of connections between ``nranks`` processes.

    ``Mesh(nranks, unique_id, rank)`` is collective: every rank calls it with
    the same ``unique_id`` and its own ``rank``; it returns once every rank
    holds a checked send and receive connection to every rank (itself
    included) for each of ``contexts`` contexts, or raises a
    :class:`~flagcx_mesh.errors.MeshError` on every rank naming what is
    missing. ``timeout`` (seconds) bounds the whole build; ``None`` uses
    ``FLAGCX_MESH_TIMEOUT`` (default 60). The GIL is released while it waits.
    ``max_unreceived`` bounds the bytes of messages waiting for :meth:`recv`
    per (peer, context); above it the mesh stops reading that connection
    (its one-sided completions wait too) until ``recv`` drains it.
    ``epoch`` is the unique id's when ``None``; a rank given another one is
    refused by the rendezvous root (see docs/security.md).

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
        max_unreceived: int = 1 << 30,
        epoch: Optional[int] = None,
        _on_phase: Optional[Callable[[str], None]] = None,
    ) -> None:
        self._core = _core.Mesh(
            int(nranks),
            bytes(unique_id),
            int(rank),
            contexts=int(contexts),
            timeout=build_timeout(timeout, "Mesh: timeout"),
            header_timeout=build_timeout(header_timeout, "Mesh: header_timeout") or 5.0,
            max_inflight=int(max_inflight),
            max_unreceived=int(max_unreceived),
            epoch=-1 if epoch is None else int(epoch),
            on_phase=_on_phase,
        )
        self._default_signal: Optional[int] = None

    @classmethod
    def from_launcher(cls, contexts: int = 1, timeout: Optional[float] = None, **kw) -> "Mesh":
        """Build the mesh of a job started by ``python -m flagcx_mesh.launch``."""
        from .launch import ranks_from_env

        found = ranks_from_env()
        if found is None:
            raise RuntimeError("not started by python -m flagcx_mesh.launch (FLAGCX_MESH_LAUNCHER unset)")
        rank, nranks, uid = found
        return cls(nranks, uid, rank, contexts=contexts, timeout=timeout, **kw)

    @classmethod
    def from_mpi(cls, comm=None, contexts: int = 1, timeout: Optional[float] = None, **kw) -> "Mesh":
        """Build the mesh of an MPI communicator (mpi4py; default ``COMM_WORLD``).

        Collective over ``comm``: its rank 0 makes the unique id, which is broadcast
        over ``comm``; mesh rank = rank in ``comm``. mpi4py is imported only here.
        """
        from .bootstrap import unique_id_from_mpi

        rank, nranks, uid = unique_id_from_mpi(comm, timeout)
        return cls(nranks, uid, rank, contexts=contexts, timeout=timeout, **kw)

    @classmethod
    def from_store(cls, store, rank: int, world_size: int, prefix: str = "flagcx_mesh",
                   contexts: int = 1, timeout: Optional[float] = None, **kw) -> "Mesh":
        """Build a mesh whose unique id goes through any ``torch.distributed.Store``.

        Rank 0 sets the id under a key derived from ``prefix`` and a per-rank call
        count kept in the store, so repeated calls never reuse a stale id; the others
        wait for it (``timeout``). Meshes built concurrently on one store need
        distinct prefixes.
        """
        from .bootstrap import unique_id_from_store

        uid = unique_id_from_store(store, rank, world_size, prefix, timeout)
        return cls(world_size, uid, rank, contexts=contexts, timeout=timeout, **kw)

    @classmethod
    def from_env(cls, contexts: int = 1, timeout: Optional[float] = None, **kw) -> "Mesh":
        """Build the mesh of whatever launcher started this process.

        ``python -m flagcx_mesh.launch``; an initialised torch.distributed default
        process group (its store); torchrun (joins the agent's store as a client,
        never binds MASTER_PORT); ``mpiexec`` of MPICH or Open MPI (mpi4py); or a
        plain RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT environment (rank 0
        hosts the store on MASTER_PORT).
        """
        from .bootstrap import unique_id_from_env

        rank, nranks, uid, _ = unique_id_from_env(timeout)
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
    def tcp_lanes(self) -> int:
        """TCP connections per (peer, context): the smallest ``FLAGCX_MESH_TCP_LANES`` of all ranks."""
        return self._core.tcp_lanes

    def tcp_lane_ports(self, peer: int, ctx: int = 0) -> List[int]:
        """Diagnostics: the local port of this rank's send connection to (peer, ctx) on each tcp
        lane, lane 0 first (the tests pick one lane's socket by it)."""
        return list(self._core.tcp_lane_ports(peer, ctx))

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

    # -- lifetime -----------------------------------------------------------
    def close(self) -> None:
        """Close every connection and leave the bootstrap. Idempotent."""
        self._core.close()

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
