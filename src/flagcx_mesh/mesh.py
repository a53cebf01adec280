"""The Python face of a flagcx_mesh full mesh."""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Callable, Dict, List, Optional

from . import _core
from .errors import InvalidArgument
from ._timeouts import build_timeout, call_timeout
from . import cuda as _cuda
from .window import SignalWindow, Window, WindowLike, index_of

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


_U64 = 1 << 64


def _ints(op: str, **values: int) -> None:
    """Refuses negative or out-of-range integers, naming the argument (nothing is issued)."""
    for name, v in values.items():
        limit = 1 << 31 if name in ("peer", "context") else _U64
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
            raise InvalidArgument(f"{op}: {name} {v!r} is out of range (must be an integer in [0, {limit}))")


def _names_bad_ints(*names: str):
    """One fallback for the integer arguments ``names`` of a method: pybind11 refuses a
    negative, huge or non-integer value with TypeError before the core sees it; that becomes
    InvalidArgument naming the argument. The method's own call costs one frame, no more."""

    def wrap(method):
        signature = inspect.signature(method)

        @functools.wraps(method)
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except TypeError:
                bound = signature.bind(*args, **kwargs)  # a wrong call raises its own TypeError
                bound.apply_defaults()
                _ints(method.__name__, **{n: index_of(v) if n.endswith(("win", "window")) else v
                                          for n, v in bound.arguments.items() if n in names and v is not None})
                raise

        return call

    return wrap


def _bytes_like(data, what: str) -> memoryview:
    """``data`` as a memoryview (any object with the buffer protocol); anything else (a str, an
    int: bytes(5) would be five zeros) raises InvalidArgument naming ``what``."""
    if not isinstance(data, str):
        try:
            return memoryview(data)
        except TypeError:
            pass
    raise InvalidArgument(f"{what} must be bytes-like (bytes, bytearray, memoryview, a contiguous array), "
                          f"not {type(data).__name__}")


def _as_int(v):
    """v as an int when it is an integer scalar (numpy, torch, anything with __index__);
    otherwise v itself (bools included), for the range checks to refuse by its own repr."""
    if isinstance(v, bool):
        return v
    try:
        return operator.index(v)
    except TypeError:
        return v


def _byte_view(buffer, what: str) -> memoryview:
    """A writable, C-contiguous byte view of a buffer-protocol object or a torch CPU tensor."""
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):  # torch.Tensor
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise InvalidArgument(f"{what}: a torch tensor must be on the CPU and contiguous "
                                  f"(device={buffer.device}, contiguous={buffer.is_contiguous()})")
        import torch

        buffer = buffer.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(buffer)
    except TypeError as e:
        raise InvalidArgument(f"{what}: {e}") from None
    if view.readonly or not view.c_contiguous:
        raise InvalidArgument(f"{what}: the buffer must be writable and C-contiguous "
                              f"(readonly={view.readonly}, contiguous={view.c_contiguous})")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


class Mesh:
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

    # -- windows (collective registration) ----------------------------------
    def register_window(self, buffer) -> Window:
        """Register a writable, contiguous buffer: host memory (numpy array, torch CPU
        tensor, bytearray, anything with the buffer protocol) or CUDA memory (a torch
        CUDA tensor, anything with ``__cuda_array_interface__`` or DLPack on a CUDA
        device). Collective: every rank registers its window in the same order; sizes
        may differ per rank. The buffer must stay alive and unmoved until the window
        is closed. ``window.describe()`` names the path chosen per peer."""
        what = f"rank {self.rank}: register_window"
        try:
            dev = _cuda.device_buffer(buffer, what)
            view = None if dev is not None else _byte_view(buffer, what)
        except (InvalidArgument, ValueError) as e:  # still take part, so the other ranks fail at once too
            self._core.refuse_registration(str(e))
            raise InvalidArgument(str(e)) from None
        if dev is not None:
            return Window(self, self._core.register_device_window(dev.ptr, dev.nbytes), keepalive=(None, dev.keepalive))
        index = self._core.register_window(view)
        return Window(self, index, keepalive=(view, buffer))

    def alloc_window(self, nbytes: int, device=None) -> Window:
        """Allocate a zero-filled window of ``nbytes`` (collective): shared host memory,
        or with ``device`` (an ordinal, ``"cuda:N"`` or a torch.device) exportable CUDA
        memory (cuMem with a POSIX fd handle). Local peers map it, so puts to it are a
        copy by the initiator."""
        nbytes = self._registration_count("alloc_window", "nbytes", nbytes)
        if device is None:
            return Window(self, self._core.alloc_window(nbytes))
        try:
            ordinal = _cuda.device_ordinal(device)
        except ValueError as e:
            self._core.refuse_registration(f"rank {self.rank}: alloc_window: {e}")
            raise InvalidArgument(f"rank {self.rank}: alloc_window: {e}") from None
        return Window(self, self._core.alloc_device_window(nbytes, ordinal))

    def signal_window(self, nslots: int) -> SignalWindow:
        """Allocate a window of ``nslots`` 64-bit signal slots, all 0 (collective).
        The first one becomes the default of every ``signal_window=``/``window=`` argument."""
        nslots = self._registration_count("signal_window", "nslots", nslots)
        w = SignalWindow(self, self._core.signal_window(nslots))
        if self._default_signal is None:
            self._default_signal = w.index
        return w

    def _registration_count(self, op: str, name: str, value) -> int:
        """An integer argument of a collective registration (numpy / torch integer scalars
        accepted); a bad one still takes part, so the other ranks fail at once too."""
        value = _as_int(value)
        try:
            _ints(f"rank {self.rank}: {op}", **{name: value})
        except InvalidArgument as e:
            self._core.refuse_registration(str(e))
            raise
        return value

    # -- one-sided operations -----------------------------------------------
    def _sig(self, window: Optional[WindowLike]) -> int:
        if window is not None:
            return index_of(window)
        if self._default_signal is None:
            raise InvalidArgument(f"rank {self.rank}: no signal window: call signal_window() first")
        return self._default_signal

    @_names_bad_ints("peer", "src_win", "src_off", "dst_win", "dst_off", "size", "context")
    def put(self, peer: int, src_win: WindowLike, src_off: int, dst_win: WindowLike, dst_off: int,
            size: int, *, context: int = 0, stream=None) -> None:
        """Copy ``size`` bytes from this rank's ``src_win[src_off:]`` to ``peer``'s
        ``dst_win[dst_off:]``. Non-blocking; FIFO per (peer, context); the source
        bytes must not change until the op completes (:meth:`flush`). With ``stream``
        (a torch.cuda.Stream or a handle) the op starts after that stream's earlier
        work and completes in its order."""
        self._core.put(peer, index_of(src_win), src_off, index_of(dst_win), dst_off, size, context,
                       _cuda.stream_handle(stream))

    @_names_bad_ints("peer", "src_win", "src_off", "dst_win", "dst_off", "size", "slot", "value",
                     "signal_window", "context")
    def put_signal(self, peer: int, src_win: WindowLike, src_off: int, dst_win: WindowLike, dst_off: int,
                   size: int, slot: int, value: int = 1, *, op: str = "add",
                   signal_window: Optional[WindowLike] = None, context: int = 0, stream=None) -> None:
        """Put, then ``op`` (``"add"`` or ``"set"``) ``value`` on ``peer``'s signal
        ``slot``: the data is visible at the target before the signal changes.
        ``size`` 0 = signal only; ``value`` 0 (with add) = data only. ``stream`` as in :meth:`put`."""
        self._core.put_signal(peer, index_of(src_win), src_off, index_of(dst_win), dst_off, size,
                              self._sig(signal_window), slot, value, op, context, _cuda.stream_handle(stream))

    @_names_bad_ints("peer", "slot", "value", "signal_window", "context")
    def signal(self, peer: int, slot: int, value: int = 1, *, op: str = "add",
               signal_window: Optional[WindowLike] = None, context: int = 0, stream=None) -> None:
        """Add (or set) ``value`` on ``peer``'s signal ``slot``, after every earlier op to that
        (peer, context); with ``stream``, also after that stream's earlier work."""
        self._core.put_signal(peer, 0, 0, 0, 0, 0, self._sig(signal_window), slot, value, op, context,
                              _cuda.stream_handle(stream))

    @_names_bad_ints("peer", "src_win", "src_off", "dst_win", "dst_off", "size", "context")
    def get(self, peer: int, src_win: WindowLike, src_off: int, dst_win: WindowLike, dst_off: int,
            size: int, *, context: int = 0, stream=None) -> None:
        """Copy ``size`` bytes from ``peer``'s ``src_win[src_off:]`` into this rank's
        ``dst_win[dst_off:]``. Non-blocking: the bytes are there once :meth:`flush` returns
        (with ``stream``: for the stream's later work once it gets there)."""
        self._core.get(peer, index_of(src_win), src_off, index_of(dst_win), dst_off, size, context,
                       _cuda.stream_handle(stream))

    @_names_bad_ints("peer", "src_win", "dst_win", "context")
    def batch_put(self, peer: int, src_win: WindowLike, dst_win: WindowLike,
                  entries, *, context: int = 0, stream=None) -> None:
        """Several puts to one peer: ``entries`` is a sequence of (src_off, dst_off, size), or
        an (n, 3) numpy array of unsigned 64-bit integers (read without a copy). The core
        checks every entry before any is issued (an error names the entry). Each counts as one op."""
        s, d = index_of(src_win), index_of(dst_win)
        h = _cuda.stream_handle(stream)
        if getattr(entries, "dtype", None) is not None and getattr(entries, "ndim", 0) == 2:
            self._core.batch_put_array(peer, s, d, entries, context, h)
            return
        try:
            self._core.batch_put(peer, s, d, entries, context, h)
        except TypeError:
            for i, e in enumerate(entries):
                if len(e) != 3:
                    raise InvalidArgument(f"batch_put: entry {i} must be (src_off, dst_off, size), got {e!r}") from None
                _ints(f"batch_put entry {i}", src_off=e[0], dst_off=e[1], size=e[2])
            raise

    def flush(self, peer: Optional[int] = None, timeout: Optional[float] = None) -> None:
        """Wait until every op issued to ``peer`` (default: all peers) has completed at its target."""
        if peer is not None:
            _ints("flush", peer=peer)
        self._core.flush(-1 if peer is None else peer, call_timeout(timeout, "flush: timeout"))

    def read_counter(self) -> int:
        """How many one-sided ops issued by this rank have completed."""
        return self._core.read_counter()

    @_names_bad_ints("value")
    def wait_counter(self, value: int, timeout: Optional[float] = None) -> None:
        """Wait until :meth:`read_counter` >= ``value``."""
        self._core.wait_counter(value, call_timeout(timeout, "wait_counter: timeout"))

    @_names_bad_ints("slot", "window")
    def read_signal(self, slot: int, *, window: Optional[WindowLike] = None) -> int:
        """This rank's value of signal ``slot`` (default window: the first signal window)."""
        return self._core.read_signal(self._sig(window), slot)

    @_names_bad_ints("slot", "expected", "window")
    def wait_signal(self, slot: int, expected: int, timeout: Optional[float] = None, *,
                    window: Optional[WindowLike] = None, stream=None) -> None:
        """Wait until this rank's signal ``slot`` reached ``expected``: ``(int64)(value -
        expected) >= 0``, the rule of a stream wait too (docs/gpu.md). On timeout the error
        names the slot, the expected and current values and the last rank that signalled it.
        With ``stream``, the wait is queued on that CUDA stream (its later work starts once
        the slot is reached) and this returns at once; ``timeout`` then applies only where
        the driver lacks stream memory operations and the wait falls back to the host."""
        seconds = call_timeout(timeout, "wait_signal: timeout")
        h = _cuda.stream_handle(stream)
        if h is None:
            self._core.wait_signal(self._sig(window), slot, expected, seconds)
        else:
            self._core.wait_signal_stream(self._sig(window), slot, expected, h, seconds)

    # -- collectives over the bootstrap -------------------------------------
    def allgather(self, data: bytes, timeout: Optional[float] = None) -> List[bytes]:
        """Every rank's ``data``, indexed by rank (small payloads; via the root)."""
        seconds = call_timeout(timeout, "allgather: timeout")
        return self._core.allgather(_bytes_like(data, "allgather: data").tobytes(), seconds)

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Wait until every rank has reached the barrier."""
        self._core.barrier(call_timeout(timeout, "barrier: timeout"))

    # -- lifetime -----------------------------------------------------------
    def close(self) -> None:
        """Close every connection and leave the bootstrap. Idempotent."""
        self._core.close()

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
