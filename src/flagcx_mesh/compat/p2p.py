"""FlagCX's P2P engine calls (``flagcx_p2p.h``'s C facade, ``flagcxP2pRpc*``) on flagcx_mesh.

FlagCX's vLLM connector makes one engine per worker process, registers its KV cache storages,
reads the engine's port, starts the server on the decode side, and on the prefill side gets a
connection by "host:port" and writes blocks by absolute addresses. The same sequence here::

    from flagcx_mesh.compat import p2p

    engine = p2p.engine_create()                  # an Agent (FLAGCX_MESH_AGENT_SECRET)
    mr = engine.register(kv.data_ptr(), nbytes)   # or engine.register(tensor); register_host
    port = engine.get_rpc_port()
    engine.start_rpc_server()                     # the side that is written to
    conn = engine.get_conn(f"{host}:{port}")      # the writer, "host:port" of the peer engine
    conn.batch_write_sync(src_vas, dst_vas, sizes)  # returns once every byte landed
    engine.destroy()

:class:`P2pLibrary` has the method names of FlagCX's Python wrapper (``FLAGCXLibrary``) for these
calls, so the connector's own code runs on it unchanged::

    from flagcx_mesh.compat.p2p import P2pLibrary as FLAGCXLibrary

Failures raise :class:`flagcx_mesh.compat.FlagcxError` (a RuntimeError, as the wrapper raises)
with a ``code``. What maps and what does not: docs/compat.md, "The P2P engine form".
"""

from __future__ import annotations

from typing import Optional, Sequence

from ._errors import Result, _raise
from ._p2p_engine import P2pConn, P2pEngine

__all__ = ["engine_create", "P2pEngine", "P2pConn", "P2pLibrary"]


def engine_create(name: Optional[str] = None, secret=None, timeout: Optional[float] = None) -> P2pEngine:
    """``flagcxP2pRpcEngineCreate``: a new engine (one agent, listening at once). ``secret``
    (default ``FLAGCX_MESH_AGENT_SECRET``) is what every peer must prove; ``timeout`` bounds
    connects, table requests and writes (default ``FLAGCX_MESH_TIMEOUT``, 60 s)."""
    return P2pEngine(name, secret, timeout)


def _engine(obj, what: str) -> P2pEngine:
    if not isinstance(obj, P2pEngine):
        _raise(None, Result.InvalidArgument, f"p2p {what}: {obj!r} is not an engine from flagcxP2pEngineCreate")
    return obj


class P2pLibrary:
    """The P2P engine methods of FlagCX's ``FLAGCXLibrary`` (plugin/interservice/flagcx_wrapper.py),
    same names and arguments, on flagcx_mesh. ``so_file`` is accepted and unused (no libflagcx is
    loaded); ``secret``, ``name`` and ``timeout`` go to every engine it creates."""

    def __init__(self, so_file: Optional[str] = None, *, secret=None, name: Optional[str] = None,
                 timeout: Optional[float] = None):
        self._secret, self._name, self._timeout = secret, name, timeout

    def flagcxP2pEngineCreate(self) -> P2pEngine:
        return engine_create(self._name, self._secret, self._timeout)

    def flagcxP2pEngineDestroy(self, engine: P2pEngine) -> None:
        _engine(engine, "flagcxP2pEngineDestroy").destroy()

    def flagcxP2pGetRpcPort(self, engine: P2pEngine) -> int:
        return _engine(engine, "flagcxP2pGetRpcPort").get_rpc_port()

    def flagcxP2pStartRpcServer(self, engine: P2pEngine) -> None:
        _engine(engine, "flagcxP2pStartRpcServer").start_rpc_server()

    def flagcxP2pRegister(self, engine: P2pEngine, addr: int, size: int) -> int:
        return _engine(engine, "flagcxP2pRegister").register(addr, size)

    def flagcxP2pRegisterHost(self, engine: P2pEngine, addr: int, size: int) -> int:
        return _engine(engine, "flagcxP2pRegisterHost").register_host(addr, size)

    def flagcxP2pGetConn(self, engine: P2pEngine, session: str) -> P2pConn:
        return _engine(engine, "flagcxP2pGetConn").get_conn(session)

    def flagcxP2pBatchWriteSync(self, conn: P2pConn, src_vas: Sequence[int], dst_vas: Sequence[int],
                                sizes: Sequence[int]) -> None:
        if not isinstance(conn, P2pConn):
            _raise(None, Result.InvalidArgument,
                   f"p2p flagcxP2pBatchWriteSync: {conn!r} is not a connection from flagcxP2pGetConn")
        conn.batch_write_sync(src_vas, dst_vas, sizes)
