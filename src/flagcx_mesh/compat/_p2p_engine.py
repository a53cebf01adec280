"""FlagCX's P2P engine (``flagcxP2pRpc*`` in ``flagcx_p2p.h``) over one :class:`flagcx_mesh.Agent`.

An engine is one agent: its listener is the engine's RPC port, its regions the engine's
registrations, its connections the engine's sessions ("host:port"). What FlagCX's handshake
carries (each side's table of registered ranges) is asked for here over the new connection, as
control messages in the agent's notifications: the engine's dispatcher thread answers a peer's
request with this engine's table once :meth:`P2pEngine.start_rpc_server` was called (a refusal
naming why before), and hands replies to the :meth:`P2pEngine.get_conn` that waits for them.
See docs/compat.md, "The P2P engine form".
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

from .. import errors
from .._timeouts import call_timeout
from ..agent import Agent, AgentConnection
from .._args import _as_int
from . import _p2p_table as table
from ._checks import _is_int
from ._errors import Result, _raise, _translate
from ._p2p_memory import resolve

log = logging.getLogger("flagcx_mesh.compat.p2p")

_U64 = 1 << 64
_TABLE_MIN = 16  # entries from which batch_write_sync reads its batch with numpy (write_blocks)
_POLL_S = 0.2  # the dispatcher's wait per round (a destroy waits at most this for it)
NOT_SERVING = "its engine has not started its RPC server (flagcxP2pStartRpcServer / start_rpc_server)"


# Engines not destroyed yet. At exit they are destroyed before the interpreter finalizes: a
# dispatcher thread coming back from the agent's wait during finalization would abort the process.
_LIVE: "weakref.WeakSet[P2pEngine]" = weakref.WeakSet()


@atexit.register
def _destroy_live_engines() -> None:
    for engine in list(_LIVE):
        engine.destroy()


def default_name() -> str:
    """host-pid-random: FlagCX's engines have no name; an agent needs one."""
    return f"flagcx-p2p-{socket.gethostname()[:64]}-{os.getpid()}-{os.urandom(3).hex()}"


def interface_from_env(environ=os.environ) -> Optional[str]:
    """What ``FLAGCX_MESH_IFNAME`` should say for an engine whose address FlagCX's code advertises,
    when it is unset: ``VLLM_HOST_IP`` (the address vLLM's ``get_ip()`` advertises), else FlagCX's
    ``FLAGCX_SOCKET_IFNAME`` (its first interface name or prefix; ``=`` exact matches taken as names;
    a ``^`` exclusion list is not mapped). None: keep the mesh's own choice."""
    if environ.get("FLAGCX_MESH_IFNAME"):
        return None
    ip = environ.get("VLLM_HOST_IP", "").strip()
    if ip:
        return ip
    ifname = environ.get("FLAGCX_SOCKET_IFNAME", "").strip()
    if ifname and not ifname.startswith("^"):
        return ifname.lstrip("=").split(",")[0] or None
    return None


def listen_where_advertised() -> None:
    """Sets ``FLAGCX_MESH_IFNAME`` from ``interface_from_env`` (read by the core at its first use
    in the process: an engine made first listens there)."""
    want = interface_from_env()
    if want:
        os.environ["FLAGCX_MESH_IFNAME"] = want


def check_secret(secret) -> None:
    """One line that names the variable and says why, where no secret is given."""
    if not secret and not os.environ.get("FLAGCX_MESH_AGENT_SECRET"):
        _raise(None, Result.InvalidArgument,
               "p2p engine_create: no secret: set FLAGCX_MESH_AGENT_SECRET to the same value in every process "
               "(FlagCX's engines need none, but a flagcx_mesh engine lets a peer write into its registered "
               "memory only once the peer proved that secret)")


class _Reply:
    """What one table request waits for: the peer it was sent to, then its answer."""

    def __init__(self, peer: str, incarnation: str):
        self.peer, self.incarnation = peer, incarnation
        self.done = threading.Event()
        self.spans: Optional[List[table.Span]] = None
        self.error: Optional[Tuple[Result, str]] = None


class P2pEngine:
    """One process's P2P engine (``flagcxP2pRpcEngineCreate``): an agent named ``name`` (default
    host-pid-random) proving ``secret`` (default ``FLAGCX_MESH_AGENT_SECRET``; FlagCX has none),
    with ``timeout`` seconds for connects, table requests and writes (default
    ``FLAGCX_MESH_TIMEOUT``, 60). Thread-safe."""

    def __init__(self, name: Optional[str] = None, secret=None, timeout: Optional[float] = None):
        what = "engine_create"
        check_secret(secret)
        listen_where_advertised()
        try:
            self._agent = Agent(name or default_name(), secret, timeout=timeout or 0.0)
        except Exception as e:  # noqa: BLE001
            _translate(None, e, f"p2p {what}")
        self._warn_if_not_where_advertised()
        self.name: str = self._agent.name
        self._timeout = timeout
        self._lock = threading.Lock()          # tables, sessions, replies
        self._connect_lock = threading.Lock()  # one get_conn handshake at a time
        self._local = table.AddressTable()
        self._sessions: Dict[str, "P2pConn"] = {}
        self._replies: Dict[bytes, _Reply] = {}
        self._serving = False
        self._closed = False
        self.ignored_messages = 0  # notifications that were no control message of this engine
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"p2p-{self.name}", daemon=True)
        self._dispatcher.start()
        _LIVE.add(self)

    # -- identity, server -----------------------------------------------------------
    @property
    def agent(self) -> Agent:
        """The agent underneath. Its notifications are the engine's control channel: reading
        them elsewhere takes table requests and replies away from the engine."""
        return self._agent

    @property
    def host(self) -> str:
        """The address the engine listens on (the host part of a session for it)."""
        return self._agent.address.rsplit(":", 1)[0]

    def _warn_if_not_where_advertised(self) -> None:
        ip = os.environ.get("VLLM_HOST_IP", "").strip()
        if ip and self.host != ip:
            log.warning("p2p engine %s listens on %s, but VLLM_HOST_IP=%s is the address vLLM advertises for it "
                        "(FLAGCX_MESH_IFNAME=%s was read before this engine): peers will not reach it there",
                        self.name, self.host, ip, os.environ.get("FLAGCX_MESH_IFNAME", ""))

    def get_rpc_port(self) -> int:
        """``flagcxP2pRpcGetPort``: the port peers name in "host:port" (the agent's listener)."""
        self._check_live("get_rpc_port")
        return int(self._agent.address.rsplit(":", 1)[1])

    def start_rpc_server(self) -> None:
        """``flagcxP2pRpcStartServer``: from now on peers' table requests are answered (before,
        they are refused naming why). The listener itself accepts from creation. Idempotent."""
        self._check_live("start_rpc_server")
        self._serving = True

    # -- registration -----------------------------------------------------------------
    def register(self, data, size: Optional[int] = None) -> int:
        """``flagcxP2pRpcRegister``: registers [data, data + size) (an address) or a buffer (numpy,
        bytearray, torch tensor on the CPU or a CUDA device); returns its memory registration id.
        Device memory goes to ``Agent.register`` as such (refused there until the agent takes
        device memory). Ranges of one engine may not overlap."""
        return self._register("register", data, size, host_only=False)

    def register_host(self, data, size: Optional[int] = None) -> int:
        """``flagcxP2pRpcRegisterHost``: as :meth:`register` for host memory; device memory is
        refused (InvalidArgument) instead of being read as host memory."""
        return self._register("register_host", data, size, host_only=True)

    def _register(self, what: str, data, size, host_only: bool) -> int:
        self._check_live(what)
        try:
            mem = resolve(data, size)
        except ValueError as e:
            self._fail(Result.InvalidArgument, what, str(e))
        rng = f"[{mem.addr:#x}, +{mem.size})"
        if host_only and mem.on_device:
            self._fail(Result.InvalidArgument, what, f"{rng} is device memory: register_host takes host memory")
        with self._lock:
            clash = self._local.overlapping(mem.addr, mem.size)
            if clash is not None:
                self._fail(Result.InvalidArgument, what, f"{rng} overlaps registration {clash.mr_id} "
                           f"[{clash.base:#x}, +{clash.size})")
            try:
                region = self._agent.register(mem.buffer)
            except Exception as e:  # noqa: BLE001
                _translate(None, e, f"p2p engine {self.name}: {what} {rng}")
            self._local.add(table.Span(mem.addr, mem.size, region.descriptor, region.index, region))
        return region.index

    def registrations(self) -> List[Tuple[int, int, int]]:
        """(mr id, base address, size) of every registration, in address order."""
        with self._lock:
            return [(s.mr_id, s.base, s.size) for s in self._local.spans()]

    # -- sessions -----------------------------------------------------------------------
    def get_conn(self, session: str) -> "P2pConn":
        """``flagcxP2pRpcGetConn``: the connection to the engine at "host:port", made on first use
        (both sides prove the secret, then the peer's table of registered ranges is asked for)
        and cached."""
        what = f"get_conn({session!r})"
        self._check_live(what)
        address = self._session_address(what, session)
        with self._connect_lock:
            with self._lock:
                known = self._sessions.get(session)
            if known is not None:
                return known
            try:
                agent_conn = self._agent.connect(address)
            except Exception as e:  # noqa: BLE001
                _translate(None, e, f"p2p engine {self.name}: {what}", Result.RemoteError)
            conn = P2pConn(self, session, agent_conn)
            conn._remote = table.AddressTable(self._ask_table(what, agent_conn))
            with self._lock:
                self._sessions[session] = conn
            return conn

    def _session_address(self, what: str, session) -> str:
        if not isinstance(session, str) or session.rfind(":") <= 0:
            self._fail(Result.InvalidArgument, what, "a session is \"host:port\"")
        host, _, port = session.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            self._fail(Result.InvalidArgument, what, f"port {port!r} is not a port number")
        return f"{host.strip('[]')}:{int(port)}"

    def _ask_table(self, what: str, agent_conn: AgentConnection) -> List[table.Span]:
        """The peer's registered ranges, asked for over ``agent_conn``."""
        rid = os.urandom(table.RID_BYTES)
        reply = _Reply(agent_conn.peer_name, agent_conn.peer_incarnation)
        with self._lock:
            self._replies[rid] = reply
        try:
            agent_conn.notify(table.encode_request(rid))
            timeout = self._timeout or self._agent._core.timeout
            if not reply.done.wait(timeout):
                self._fail(Result.RemoteError, what, f"agent {reply.peer} did not answer the region-table "
                           f"request within {timeout:g} s (no flagcx_mesh P2P engine there, or it is stuck)")
        except errors.MeshError as e:
            _translate(None, e, f"p2p engine {self.name}: {what}", Result.RemoteError)
        finally:
            with self._lock:
                self._replies.pop(rid, None)
        if reply.error is not None:
            self._fail(reply.error[0], what, reply.error[1])
        return reply.spans

    # -- the dispatcher: control messages in the agent's notifications --------------------
    def _dispatch(self) -> None:
        while not self._closed:
            try:
                notes = self._agent.notifications(_POLL_S)
            except errors.MeshError:
                if self._closed:
                    return
                time.sleep(_POLL_S)
                continue
            for note in notes:
                self._on_message(note)

    def _on_message(self, note) -> None:
        msg = table.parse(note.data)
        if msg is None:
            self.ignored_messages += 1
            return
        kind, rid, payload = msg
        if kind == table.REQUEST:
            self._answer(note.peer, rid)
            return
        with self._lock:
            reply = self._replies.get(rid)
        if reply is None or (note.peer, note.incarnation) != (reply.peer, reply.incarnation):
            self.ignored_messages += 1
            return
        if kind == table.REFUSAL:
            reply.error = (Result.RemoteError, f"agent {note.peer} refused the region-table request: "
                           f"{payload.decode('utf-8', 'replace')}")
        else:
            try:
                reply.spans = table.decode_table(payload)
            except ValueError as e:
                reply.error = (Result.RemoteError, f"agent {note.peer} sent a malformed region table: {e}")
        reply.done.set()

    def _answer(self, peer: str, rid: bytes) -> None:
        conn = self._agent.connection(peer)
        if conn is None:
            return
        if self._serving:
            with self._lock:
                message = table.encode_table(rid, self._local.spans())
        else:
            message = table.encode_refusal(rid, NOT_SERVING)
        try:
            conn.notify(message)
        except errors.MeshError:
            pass  # the asker is gone; its get_conn fails on its own

    # -- lifetime -----------------------------------------------------------------------
    def destroy(self) -> None:
        """``flagcxP2pRpcEngineDestroy``: closes the agent (every session, registration and the
        listener); later calls raise InvalidUsage. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._agent.close()
        if self._dispatcher is not threading.current_thread():
            self._dispatcher.join(2 * _POLL_S + 1)
        with self._lock:
            for reply in self._replies.values():
                reply.error = (Result.InvalidUsage, "the engine was destroyed")
                reply.done.set()
            self._sessions.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "P2pEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._closed else f"{self._agent.address}, {len(self._local)} registration(s)"
        return f"<flagcx_mesh.compat.p2p.P2pEngine {self.name}: {state}>"

    # -- helpers ------------------------------------------------------------------------
    def _check_live(self, what: str) -> None:
        if self._closed:
            self._fail(Result.InvalidUsage, what, "the engine was destroyed")

    def _fail(self, code: Result, what: str, text: str):
        _raise(None, code, f"p2p engine {self.name}: {what}: {text}")


class P2pConn:
    """A session to a peer engine (``flagcxP2pConn_t``), from :meth:`P2pEngine.get_conn`; it knows
    the peer's registered ranges as the peer described them."""

    def __init__(self, engine: P2pEngine, session: str, agent_conn: AgentConnection):
        self._engine = engine
        self.session = session
        self._agent_conn = agent_conn
        self._remote = table.AddressTable()
        self._refresh_lock = threading.Lock()

    @property
    def peer_name(self) -> str:
        return self._agent_conn.peer_name

    def remote_ranges(self) -> List[Tuple[int, int]]:
        """(base, size) of the peer's registered ranges this session knows."""
        return [(s.base, s.size) for s in self._remote.spans()]

    def batch_write_sync(self, src_vas: Sequence[int], dst_vas: Sequence[int], sizes: Sequence[int],
                         timeout: Optional[float] = None) -> None:
        """``flagcxP2pRpcBatchWriteSync``: writes ``sizes[i]`` bytes from this process's address
        ``src_vas[i]`` to the peer's address ``dst_vas[i]``, for every i, and returns once all of
        them landed in the peer's memory. Every address range must lie in registered memory
        (this engine's for the sources, the peer's for the destinations); entries of size 0 are
        skipped. All entries are checked before any byte moves: one that lies outside every
        registered range fails the whole call with InvalidArgument, and nothing is written."""
        engine = self._engine
        what = f"batch_write_sync(session {self.session})"
        engine._check_live(what)
        try:
            wait = call_timeout(timeout, f"{what}: timeout")  # 0: the agent's, which is the engine's
        except errors.InvalidArgument as e:
            _translate(None, e, f"p2p engine {engine.name}: {what}")
        blocks = self._blocks(src_vas, dst_vas, sizes)
        if blocks is not None:
            count = len(blocks[2])
        else:
            ops, count = self._ops(what, src_vas, dst_vas, sizes)
            if not ops:
                return
        try:
            if blocks is not None:
                self._agent_conn.write_blocks(*blocks).wait(wait)
            else:
                self._agent_conn.batch_write(ops).wait(wait)
        except Exception as e:  # noqa: BLE001
            _translate(None, e, f"p2p engine {engine.name}: {what} of {count} range(s) "
                                f"to agent {self.peer_name}")

    def _blocks(self, src_vas, dst_vas, sizes):
        """The batch as ``write_blocks`` arguments (local descriptors, remote descriptors, an (n, 5)
        table), read by numpy without a Python object per entry, when it has at least
        ``_TABLE_MIN`` entries of plain integers, each inside one registration on either side.
        None otherwise: ``_ops`` then checks every entry (and refuses, splits or asks the peer's
        table again) one at a time."""
        try:
            if len(src_vas) < _TABLE_MIN:
                return None
            import numpy as np
            columns = [np.asarray(v) for v in (src_vas, dst_vas, sizes)]
        except Exception:  # noqa: BLE001 (no numpy, no len, ragged: the per-entry path says why)
            return None
        if any(c.ndim != 1 or c.dtype.kind not in "iu" or len(c) != len(columns[0]) for c in columns):
            return None
        if any(c.dtype.kind == "i" and len(c) and c.min() < 0 for c in columns):
            return None
        src, dst, nbytes = (c.astype(np.uint64) for c in columns)
        keep = nbytes > 0
        if not keep.all():
            src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
        if len(nbytes) == 0:
            return None
        local = self._engine._local.locate_all(src, nbytes)
        remote = self._remote.locate_all(dst, nbytes)
        if local is None or remote is None:
            return None
        rows = np.stack([local[1], local[2], remote[1], remote[2], nbytes.astype(np.int64)], axis=1)
        local_regions = [s.descriptor if s.region is None else s.region for s in local[0]]
        return local_regions, [s.descriptor for s in remote[0]], rows

    def _ops(self, what: str, src_vas, dst_vas, sizes) -> Tuple[list, int]:
        """The agent ops of a batch and its number of non-empty entries; every entry checked."""
        try:
            src, dst, nbytes = list(src_vas), list(dst_vas), list(sizes)
        except TypeError as e:
            self._engine._fail(Result.InvalidArgument, what, f"src_vas, dst_vas and sizes must be sequences: {e}")
        if not len(src) == len(dst) == len(nbytes):
            self._engine._fail(Result.InvalidArgument, what, f"argument lengths do not match (src_vas {len(src)}, "
                               f"dst_vas {len(dst)}, sizes {len(nbytes)})")
        local, ops, count = self._engine._local, [], 0
        for i, s, d, n in zip(range(len(src)), src, dst, nbytes):
            if not (type(s) is int and type(d) is int and type(n) is int and 0 <= s < _U64 and 0 <= d < _U64
                    and 0 <= n < _U64):
                s, d, n = self._checked_ints(what, i, s, d, n)
            if n == 0:
                continue  # skipped whatever its addresses, as FlagCX skips an all-empty batch
            count += 1
            a, b = local.locate(s, n), self._remote.locate(d, n)
            if a is not None and b is not None:
                ops.append((a[0], a[1], b[0], b[1], n))
            else:
                ops += self._split_entry(what, i, s, d, n)
        return ops, count

    def _checked_ints(self, what: str, i: int, *values) -> Tuple[int, int, int]:
        out = []
        for name, v in zip(("src_va", "dst_va", "size"), values):
            v = _as_int(v)
            if not _is_int(v) or not 0 <= v < _U64:
                self._engine._fail(Result.InvalidArgument, what, f"entry {i}: {name} {v!r} is not an integer "
                                   "in [0, 2^64)")
            out.append(v)
        return tuple(out)

    def _split_entry(self, what: str, i: int, s: int, d: int, n: int) -> list:
        """An entry across adjacent registrations, or one outside them (refused)."""
        local = self._engine._local
        src = local.pieces(s, n)
        if src is None:
            self._engine._fail(Result.InvalidArgument, what, f"entry {i}: src_va [{s:#x}, +{n}) is not "
                               f"inside memory registered with this engine ({len(local)} registration(s)); "
                               "nothing was written")
        dst = self._remote.pieces(d, n) or self._refreshed(what).pieces(d, n)
        if dst is None:
            self._engine._fail(Result.InvalidArgument, what, f"entry {i}: dst_va [{d:#x}, +{n}) is not "
                               f"inside memory agent {self.peer_name} registered ({len(self._remote)} "
                               "range(s) known); nothing was written")
        return table.pair_pieces(src, dst)

    def _refreshed(self, what: str) -> table.AddressTable:
        """The peer's table asked for again (once per miss: it may have registered since)."""
        with self._refresh_lock:
            self._remote = table.AddressTable(self._engine._ask_table(what, self._agent_conn))
        return self._remote

    def __repr__(self) -> str:
        return f"<flagcx_mesh.compat.p2p.P2pConn {self.session} (agent {self.peer_name})>"
