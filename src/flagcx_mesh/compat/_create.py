"""Making a communicator: the unique id, comm_init_rank, comm_init_from_env."""

from __future__ import annotations

from typing import Optional

from ..mesh import Mesh
from ..mesh import get_unique_id as _mesh_unique_id
from ._comm import Comm
from ._errors import UNIQUE_ID_BYTES, Result, _raise, _translate


def get_unique_id() -> bytes:
    """256 opaque bytes naming one new communicator. The calling process hosts its
    rendezvous root until every rank has joined, so it must stay alive meanwhile;
    carry the bytes to every rank by any channel (ZMQ, MPI, a store, a file)."""
    try:
        return _mesh_unique_id()
    except Exception as e:  # noqa: BLE001 - every failure becomes a FlagcxError
        _translate(None, e, "get_unique_id")


def comm_init_rank(nranks: int, unique_id: bytes, rank: int, timeout: Optional[float] = None) -> "Comm":
    """Collective: join the communicator of ``unique_id`` as ``rank`` of ``nranks``.

    Blocks (GIL released) until every rank holds a checked connection to every rank,
    or raises on every rank naming what is missing (``RemoteError`` when a rank did not
    arrive within ``timeout`` seconds; default ``FLAGCX_MESH_TIMEOUT``, 60). Callable
    from any thread; several communicators in one process are independent.
    """
    what = f"comm_init_rank(nranks={nranks})"
    try:
        uid = memoryview(unique_id).tobytes()  # bytes, bytearray, a ctypes struct, a numpy array
    except TypeError:
        _raise(None, Result.InvalidArgument, f"rank {rank}: {what}: unique_id must be bytes, got {type(unique_id).__name__}")
    if len(uid) != UNIQUE_ID_BYTES:
        _raise(None, Result.InvalidArgument,
               f"rank {rank}: {what}: unique_id has {len(uid)} bytes, expected {UNIQUE_ID_BYTES} (from get_unique_id())")
    try:
        return Comm(Mesh(nranks, uid, rank, timeout=timeout), timeout)
    except Exception as e:  # noqa: BLE001
        _translate(None, e, what, timeout_code=Result.RemoteError, rank=rank)


def comm_init_from_env(timeout: Optional[float] = None) -> "Comm":
    """Collective: the communicator of the job that started this process (``python -m
    flagcx_mesh.launch``, ``mpiexec`` of MPICH / Open MPI via mpi4py, torchrun, an
    initialised torch.distributed group, or RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).
    See :meth:`flagcx_mesh.Mesh.from_env`."""
    try:
        return Comm(Mesh.from_env(timeout=timeout), timeout)
    except Exception as e:  # noqa: BLE001
        _translate(None, e, "comm_init_from_env", timeout_code=Result.RemoteError)

