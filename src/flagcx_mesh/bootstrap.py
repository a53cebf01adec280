"""Bootstraps: carry one mesh's unique id from rank 0 to every rank.

A mesh needs only one thing from the job around it: the 256-byte unique id made
by one rank (``get_unique_id()``, which also starts the rendezvous root in that
process) and a (rank, nranks) pair on every rank. This module carries the id
over whatever the job already has:

* MPI (mpi4py): a broadcast over a communicator           -> :func:`unique_id_from_mpi`
* any ``torch.distributed.Store``: rank 0 sets, others get -> :func:`unique_id_from_store`
* the environment a launcher left (flagcx_mesh.launch, torchrun, mpiexec, or plain
  RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)          -> :func:`unique_id_from_env`

mpi4py and torch are imported only by the paths that use them; :func:`detect_launch`
looks at environment variables only.

Ports: nothing here binds a port of its own choosing. Under torchrun the
launcher's agent already hosts a store on MASTER_PORT and every rank joins it as
a client. Only a plain environment (no launcher store) has rank 0 host the store
on the MASTER_PORT the user named, as ``torch.distributed``'s ``env://`` does
(multi-tenant, so a later ``init_process_group`` in the same process shares it);
a taken port is then reported at once as EADDRINUSE with what to do.
"""

from __future__ import annotations

import datetime
import errno
import os
import struct
import sys
import threading
import time
from typing import Any, Dict, Mapping, Optional, Tuple

from . import errors
from .launch import ENV_LAUNCHER, ranks_from_env

UNIQUE_ID_BYTES = 256
DEFAULT_PREFIX = "flagcx_mesh"

# The id travels as: tag "ok" | world size (u32) | the id, or tag "er" | rank 0's error text.
_HEAD = struct.Struct("<2sI")
_MPI_BUF = 1024  # fixed broadcast size: head + id, or head + error text (truncated)

# (variables that must all be set, name shown to the user); first match wins.
_MPI_ENVS = (
    (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), "Open MPI"),
    (("PMI_RANK", "PMI_SIZE"), "MPICH hydra (PMI)"),
    (("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"), "MVAPICH"),
    (("PMIX_RANK", "PMIX_NAMESPACE"), "PMIx"),
)
_TORCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_stores_lock = threading.Lock()
_stores: Dict[Tuple[str, int, bool], Any] = {}  # joined/hosted TCPStores, kept for reuse


# ----------------------------------------------------------------------------- helpers

def default_timeout() -> float:
    """Seconds a bootstrap waits when given ``timeout=None``: FLAGCX_MESH_TIMEOUT (60), as the core read it."""
    from . import _core

    return float(_core.default_timeout())


def _seconds(timeout: Optional[float]) -> float:
    """A bootstrap's deadline: None or 0 is FLAGCX_MESH_TIMEOUT, else a finite number > 0."""
    from ._timeouts import build_timeout

    return build_timeout(timeout, "bootstrap: timeout") or default_timeout()


def _pack(world: int, uid: Optional[bytes] = None, error: str = "") -> bytes:
    if uid is None:
        return _HEAD.pack(b"er", world) + error.encode("utf-8", "replace")
    return _HEAD.pack(b"ok", world) + bytes(uid)


def _unpack(raw: bytes, rank: int, world: int, where: str) -> bytes:
    """The unique id in ``raw``; raises what rank 0 reported, or a malformed/mismatch error."""
    if len(raw) < _HEAD.size:
        raise errors.ProtocolError(f"rank {rank}: malformed unique id message ({len(raw)} bytes) {where}")
    tag, root_world = _HEAD.unpack_from(raw)
    body = raw[_HEAD.size:]
    if tag == b"er":
        text = body.rstrip(b"\0").decode("utf-8", "replace")
        raise errors.PeerLost(f"rank {rank}: rank 0 could not make the unique id: {text}", peer=0)
    if tag != b"ok" or len(body) < UNIQUE_ID_BYTES:
        raise errors.ProtocolError(f"rank {rank}: malformed unique id message {where}")
    if root_world != world:
        raise errors.InvalidArgument(
            f"rank {rank}: world size mismatch {where}: rank 0 builds a mesh of {root_world} "
            f"ranks, this rank was told {world}")
    return bytes(body[:UNIQUE_ID_BYTES])


def _make_uid(world: int) -> Tuple[bytes, Optional[BaseException]]:
    """(message for the other ranks, error): rank 0 side; an error is sent, then raised."""
    from . import _core  # the id itself (mesh.get_unique_id); mesh.py imports this module

    try:
        return _pack(world, _core.get_unique_id(0)), None
    except Exception as e:  # noqa: BLE001 - forwarded to every rank, then re-raised
        return _pack(world, error=f"{type(e).__name__}: {e}"), e


def _check_rank(rank: int, world: int, who: str) -> None:
    if world < 1 or not 0 <= rank < world:
        raise errors.InvalidArgument(f"{who}: rank {rank} is not in [0, {world})")


# ----------------------------------------------------------------------------- MPI

def unique_id_from_mpi(comm: Any = None, timeout: Optional[float] = None) -> Tuple[int, int, bytes]:
    """(rank, nranks, unique_id) of ``comm`` (default COMM_WORLD); collective over ``comm``.

    Rank 0 of ``comm`` makes the id; it is broadcast over ``comm`` (non-blocking, so a
    rank that never arrives makes the others fail after ``timeout`` seconds).
    """
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"flagcx_mesh: MPI bootstrap needs mpi4py, built for the MPI that "
                          f"launches the job (pip install 'flagcx_mesh[mpi]'): {e}") from e
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Is_inter():
        raise errors.InvalidArgument("from_mpi: an intercommunicator has no rank 0; pass an intracommunicator")
    rank, world = comm.Get_rank(), comm.Get_size()
    seconds, buf, failure = _seconds(timeout), bytearray(_MPI_BUF), None
    if rank == 0:
        msg, failure = _make_uid(world)
        buf[:min(len(msg), _MPI_BUF)] = msg[:_MPI_BUF]
    _mpi_bcast(MPI, comm, buf, rank, seconds)
    if failure is not None:
        raise failure
    return rank, world, _unpack(bytes(buf), rank, world, "over MPI")


def _mpi_bcast(MPI: Any, comm: Any, buf: bytearray, rank: int, timeout: float) -> None:
    try:
        req = comm.Ibcast([buf, MPI.BYTE], root=0)
    except NotImplementedError:  # MPI-2 library: blocking broadcast, no deadline
        comm.Bcast([buf, MPI.BYTE], root=0)
        return
    deadline, pause = time.monotonic() + timeout, 0.0002
    while not req.Test():
        if time.monotonic() >= deadline:
            raise errors.MeshTimeout(
                f"rank {rank}: the unique id broadcast over MPI did not complete within "
                f"{timeout:g} s (rank 0 or another rank of the communicator has not called "
                f"from_mpi)", peer=0)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def mpi_launch_name(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Which MPI launcher started this process (from its variables only), or None."""
    env = os.environ if environ is None else environ
    for names, label in _MPI_ENVS:
        if all(env.get(n) for n in names):
            return label
    return None


def mpi_library_name() -> str:
    """The MPI library mpi4py runs on, first line of MPI_Get_library_version()."""
    from mpi4py import MPI

    text = MPI.Get_library_version().strip()
    return " ".join(text.splitlines()[0].split()) if text else "unknown MPI"


# ----------------------------------------------------------------------------- torch stores

def unique_id_from_store(store: Any, rank: int, world_size: int, prefix: str = DEFAULT_PREFIX,
                         timeout: Optional[float] = None) -> bytes:
    """The unique id of this call's mesh, handed out through a torch.distributed Store.

    Every rank calls it; rank 0 makes the id and sets it under
    ``{prefix}/{n}/unique_id``, the others wait for that key. ``n`` counts this rank's
    calls with this prefix in the store itself (``{prefix}/rank{r}/calls``), so every
    rank's n-th call finds the n-th id, never a stale one, even through new store
    clients of the same server. Meshes built at the same time on one store need
    distinct prefixes.
    """
    _check_rank(rank, world_size, "from_store")
    seconds = _seconds(timeout)
    counter = f"{prefix}/rank{rank}/calls"
    n = int(_store_op(rank, f"add to key {counter!r}", lambda: store.add(counter, 1)))
    key = f"{prefix}/{n}/unique_id"
    if rank == 0:
        msg, failure = _make_uid(world_size)
        _store_op(rank, f"set key {key!r}", lambda: store.set(key, msg))
        if failure is not None:
            raise failure
        return _unpack(msg, rank, world_size, f"(store key {key!r})")
    _store_wait(store, key, rank, seconds)
    raw = _store_op(rank, f"get key {key!r}", lambda: store.get(key))
    return _unpack(bytes(raw), rank, world_size, f"(store key {key!r})")


def _store_op(rank: int, what: str, fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - torch's store errors, named
        raise errors.PeerLost(f"rank {rank}: the bootstrap store failed to {what}: {e}") from e


def _store_wait(store: Any, key: str, rank: int, seconds: float) -> None:
    try:
        store.wait([key], datetime.timedelta(seconds=seconds))
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError/RuntimeError
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise errors.MeshTimeout(
                f"rank {rank}: rank 0 did not publish the unique id under store key {key!r} "
                f"within {seconds:g} s (is rank 0 running, and calling with the same prefix "
                f"and as many times as this rank?)", peer=0) from e
        raise errors.PeerLost(f"rank {rank}: the store failed while waiting for key {key!r}: {e}",
                              peer=0) from e


# ----------------------------------------------------------------------------- environment

def detect_launch(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Which launcher started this process, judged from the environment; imports nothing.

    One of "flagcx_mesh.launch", "torch.distributed" (a default process group is
    initialised), "torchrun", an MPI label (see ``mpi_launch_name``), "env" (plain
    RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), or None.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV_LAUNCHER) == "1":
        return "flagcx_mesh.launch"
    if environ is None and _torch_pg_initialised():
        return "torch.distributed"
    if env.get("TORCHELASTIC_RUN_ID") and all(env.get(n) for n in _TORCH_ENV):
        return "torchrun"
    mpi = mpi_launch_name(env)
    if mpi is not None:
        return mpi
    if all(env.get(n) for n in _TORCH_ENV):
        return "env"
    return None


def _torch_pg_initialised() -> bool:
    dist = sys.modules.get("torch.distributed")  # never imports torch
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported torch is not a process group
        return False


def unique_id_from_env(timeout: Optional[float] = None) -> Tuple[int, int, bytes, str]:
    """(rank, nranks, unique_id, launcher description) for the launcher that started us."""
    kind = detect_launch()
    if kind is None:
        raise RuntimeError(
            "flagcx_mesh: no launcher found in the environment: expected flagcx_mesh.launch "
            "(FLAGCX_MESH_LAUNCHER), torchrun (TORCHELASTIC_RUN_ID, RANK, WORLD_SIZE, MASTER_ADDR, "
            "MASTER_PORT), mpiexec (OMPI_COMM_WORLD_* or PMI_RANK/PMI_SIZE) or RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT")
    if kind == "flagcx_mesh.launch":
        found = ranks_from_env()
        if found is None:
            raise RuntimeError(f"{ENV_LAUNCHER}=1 but FLAGCX_MESH_RANK/NRANKS/UNIQUE_ID are incomplete")
        return (*found, kind)
    if kind == "torch.distributed":
        import torch.distributed as dist

        from torch.distributed.distributed_c10d import _get_default_store
        rank, world = dist.get_rank(), dist.get_world_size()
        uid = unique_id_from_store(_get_default_store(), rank, world, DEFAULT_PREFIX, timeout)
        return rank, world, uid, "torch.distributed default process group store"
    if kind in ("torchrun", "env"):
        return _from_torch_env(kind, timeout)
    rank, world, uid = unique_id_from_mpi(None, timeout)
    return rank, world, uid, f"mpiexec ({kind}; {mpi_library_name()})"


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise errors.InvalidArgument(f"{name}={value!r}: not an integer") from None


def _from_torch_env(kind: str, timeout: Optional[float]) -> Tuple[int, int, bytes, str]:
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    host, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT")
    _check_rank(rank, world, "from_env")
    seconds = _seconds(timeout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = env_store(host, port, rank, host_it=(rank == 0 and not agent), timeout=seconds)
    prefix = DEFAULT_PREFIX
    if os.environ.get("TORCHELASTIC_RESTART_COUNT"):
        prefix += f"/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    uid = unique_id_from_store(store, rank, world, prefix, seconds)
    how = "joined the launcher's store" if agent else ("hosts" if rank == 0 else "joined") + " the store"
    return rank, world, uid, f"{kind} (rank {rank} {how} at {host}:{port})"


def env_store(host: str, port: int, rank: int, host_it: bool, timeout: float) -> Any:
    """The TCPStore at host:port: joined as a client, or hosted when ``host_it`` (plain env rank 0).

    Kept for the life of the process and reused by later calls, so a port is bound at
    most once per process.
    """
    key = (host, port, host_it)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _host_store(host, port, timeout) if host_it else _join_store(host, port, rank, timeout)
            _stores[key] = store
    return store


def _host_store(host: str, port: int, timeout: float) -> Any:
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout),
                        wait_for_workers=False, multi_tenant=True)
    except Exception as e:  # noqa: BLE001 - torch's DistNetworkError
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise errors.SystemCallError(
                f"rank 0: MASTER_PORT={port} is already in use by another process (EADDRINUSE), "
                f"so rank 0 cannot host the bootstrap store there. Pick a free port "
                f"(e.g. MASTER_PORT={_free_port_hint()}) for every rank, or start the job with "
                f"torchrun, whose agent hosts the store and picks the port itself",
                errno=errno.EADDRINUSE) from e
        raise errors.SystemCallError(f"rank 0: cannot host the bootstrap store on port {port}: {e}") from e


def _free_port_hint() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _join_store(host: str, port: int, rank: int, timeout: float) -> Any:
    """A TCPStore client of host:port.

    First a plain TCP connect, retried until the deadline (the host may start later);
    then torch's client, in a helper thread with a deadline, because torch's client
    never times out when something that is not a store accepts and stays silent.
    """
    where = f"rank {rank}: cannot join the bootstrap store at MASTER_ADDR:MASTER_PORT = {host}:{port}"
    deadline = time.monotonic() + timeout
    _wait_listening(host, port, deadline, where, timeout, probe=lambda s: _refuse_a_talker(s, port, where))
    box = _in_thread(lambda: _tcp_client(host, port, max(1.0, deadline - time.monotonic())),
                     f"flagcx_mesh store client {host}:{port}", max(1.0, deadline - time.monotonic()) + 5.0)
    if "value" in box:
        return box["value"]
    if "error" not in box:
        raise errors.MeshTimeout(
            f"{where}: something accepted the connection but did not answer as a "
            f"torch.distributed store within {timeout:g} s. Port {port} is probably held by "
            f"another program (a rank 0 hosting there fails with EADDRINUSE); pick a free MASTER_PORT")
    text = str(box["error"]).splitlines()[0]
    raise errors.PeerLost(
        f"{where}: something accepted the connection but it is not a torch.distributed store "
        f"({text}). If another program holds port {port}, pick a free MASTER_PORT") from box["error"]


# A TCPStore server never speaks first and never hangs up on a new client: what does either
# within this time of a connect is not a store (torch's own client, given one that hangs up,
# retries past its timeout, so it cannot be left to say so).
_TALKER_PROBE_S = 0.1


def _refuse_a_talker(s, port: int, where: str) -> None:
    """Raises PeerLost when what accepted `s` hangs up at once or speaks first."""
    import socket

    s.settimeout(_TALKER_PROBE_S)
    try:
        data = s.recv(16)
    except socket.timeout:
        return  # silent and still connected, as a store is
    except ConnectionError as e:
        data, what = None, f"it reset the connection ({e})"
    except OSError:
        return  # torch's client says what it finds
    if data is not None:
        what = f"it sent {data!r} first" if data else "it closed the connection without a word"
    raise errors.PeerLost(
        f"{where}: something accepted the connection but it is not a torch.distributed store "
        f"({what}). If another program holds port {port}, pick a free MASTER_PORT")


def _tcp_client(host: str, port: int, seconds: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(host, port, None, False, datetime.timedelta(seconds=seconds))


def _in_thread(fn: Any, name: str, seconds: float) -> Dict[str, Any]:
    """Runs fn in a daemon thread for at most `seconds`: {"value": ...}, {"error": e} or {}."""
    box: Dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    t.join(seconds)
    return box


def _wait_listening(host: str, port: int, deadline: float, where: str, timeout: float, probe=None) -> None:
    """Returns once a TCP connect to host:port succeeds (after `probe(socket)` on that
    connection, when given); retries refusals until `deadline`."""
    import socket

    pause, last = 0.01, None
    while True:
        try:
            s = socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        except OSError as e:
            last = e
        else:
            with s:  # the probe's refusal (an OSError too) is not a refused connect to retry
                if probe is not None:
                    probe(s)
            return
        if time.monotonic() >= deadline:
            raise errors.MeshTimeout(
                f"{where}: nothing accepted a connection there within {timeout:g} s (last error: "
                f"{last}); is rank 0 (or the launcher's agent) running, and is {host}:{port} "
                f"reachable from this host?", errno=getattr(last, "errno", 0) or 0)
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
