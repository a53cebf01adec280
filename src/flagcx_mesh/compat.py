"""FlagCX-shaped one-sided API on top of :class:`flagcx_mesh.Mesh`.

This module offers the calls a FlagCX KV connector makes, with FlagCX's argument
order, result codes and semantics, so a connector can switch with a thin shim::

    from flagcx_mesh import compat as fc

    uid = fc.get_unique_id()                       # on one process; send the 256 bytes
    comm = fc.comm_init_rank(nranks, uid, rank)    # collective, blocks until all arrive
    kv = comm.one_side_register(kv_buffer)         # window index = registration order
    comm.signal_register(8 * nslots)               # the signal slots (library memory)
    comm.put_signal(peer, src_off, dst_off, size, sig_off, kv, kv, 1)
    comm.wait_signal(peer, sig_off, expected=1)    # on the target
    comm.destroy()

Every failure raises :class:`FlagcxError` carrying ``.code`` (a :class:`Result`,
FlagCX's ``flagcxResult_t`` value), ``.peer``, ``.errno`` and a message naming the
rank, the call, the peer and the window or slot concerned.

Signal offsets (``sig_off``) are BYTE offsets into the signal buffer, as in FlagCX:
they must be multiples of 8 and name the 64-bit slot ``sig_off // 8``.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from . import _core, errors
from . import cuda as _cuda
from .mesh import Mesh, _as_int
from .mesh import get_unique_id as _mesh_unique_id
from .window import Window

UNIQUE_ID_BYTES = 256
SLOT_BYTES = 8
_U64 = 1 << 64


class Result(enum.IntEnum):
    """FlagCX's result codes (``flagcxResult_t`` in FlagCX's ``flagcx.h``), with the same values
    (checked one by one against FlagCX 0c721293)."""

    Success = 0
    UnhandledDeviceError = 1
    SystemError = 2
    InternalError = 3
    InvalidArgument = 4
    InvalidUsage = 5
    RemoteError = 6
    InProgress = 7
    UnhandledCCLError = 8
    NotSupported = 9


# flagcxSuccess, flagcxInvalidArgument, ... as module constants, as in the C header.
globals().update({f"flagcx{r.name}": r for r in Result})

_DESCRIPTIONS = {
    Result.Success: "no error",
    Result.UnhandledDeviceError: "unhandled device error: a device (GPU) runtime call failed",
    Result.SystemError: "system error: a system call failed (see errno), or memory ran out",
    Result.InternalError: "internal error: a library invariant was broken (please report it)",
    Result.InvalidArgument: "invalid argument: a rank, window index, offset, size or signal offset "
                            "was out of range or malformed; nothing was changed",
    Result.InvalidUsage: "invalid usage: a call out of order (communicator destroyed, signal buffer "
                         "missing or registered twice, window deregistered)",
    Result.RemoteError: "remote error: a peer failed, exited, sent malformed data, or did not join "
                        "a collective in time",
    Result.InProgress: "in progress: the awaited signal, counter or flush had not completed when the "
                       "timeout expired; the operation may still complete, the wait can be retried",
    Result.UnhandledCCLError: "unhandled CCL error: a call into a vendor collective library failed "
                              "(flagcx_mesh itself never returns it)",
    Result.NotSupported: "not supported: the request needs something this build does not provide "
                         "(e.g. device memory)",
}


def get_error_string(code: int) -> str:
    """A description of result ``code`` (any integer; unknown values say so)."""
    try:
        return _DESCRIPTIONS[Result(int(code))]
    except (ValueError, TypeError):
        return f"unknown result code {code!r}: not a flagcxResult_t value (0..{len(Result) - 1})"


class FlagcxError(RuntimeError):
    """The one exception type of this module.

    ``code`` is a :class:`Result`; ``peer`` the rank concerned or -1; ``errno`` the
    operating-system error or 0; ``rank`` the rank that raised it or -1. ``str()``
    is the message followed by the code's name and value.
    """

    def __init__(self, code: int, message: str, *, peer: int = -1, errno: int = 0, rank: int = -1):
        self.code = Result(code)
        self.peer, self.errno, self.rank = peer, errno, rank
        self.message = message
        super().__init__(f"{message} [flagcx{self.code.name} ({int(self.code)})]")

    def __reduce__(self):
        return (_rebuild, (int(self.code), self.message, self.peer, self.errno, self.rank))


def _rebuild(code: int, message: str, peer: int, errno: int, rank: int) -> FlagcxError:
    return FlagcxError(code, message, peer=peer, errno=errno, rank=rank)


# flagcx_mesh error class -> FlagCX code. MeshTimeout depends on the call (see _code_of).
_CODE_OF = (
    (errors.InvalidArgument, Result.InvalidArgument),
    (errors.MeshClosed, Result.InvalidUsage),
    (errors.PeerLost, Result.RemoteError),
    (errors.ProtocolError, Result.RemoteError),
    (errors.SystemCallError, Result.SystemError),
)


def _code_of(e: BaseException, timeout_code: Result) -> Result:
    if isinstance(e, errors.MeshTimeout):
        return timeout_code
    for cls, code in _CODE_OF:
        if isinstance(e, cls):
            return code
    if isinstance(e, (ValueError, TypeError, OverflowError)):
        return Result.InvalidArgument
    if isinstance(e, (MemoryError, OSError)):
        return Result.SystemError
    return Result.InternalError


_last = threading.local()


def get_last_error(comm: Optional["Comm"] = None) -> str:
    """The message of the last failure of ``comm``, or, without one, of the calling thread
    (also failures outside any communicator, such as ``comm_init_rank``); "" if none."""
    if comm is not None:
        return comm.get_last_error()
    return getattr(_last, "text", "")


def _raise(comm: Optional["Comm"], code: Result, message: str, *, peer: int = -1, errno: int = 0,
           cause: Optional[BaseException] = None):
    rank = comm.rank if comm is not None else -1
    err = FlagcxError(code, message, peer=peer, errno=errno, rank=rank)
    _last.text = str(err)
    if comm is not None:
        comm._last_error = str(err)
    raise err from cause


def _translate(comm: Optional["Comm"], e: BaseException, what: str,
               timeout_code: Result = Result.InProgress, rank: Optional[int] = None):
    """Raises the FlagcxError for a flagcx_mesh (or Python) exception ``e`` raised in ``what``.

    The message is "rank R: WHAT: DETAIL"; the rank comes from the comm, else from ``rank``
    (and is taken off the front of the detail, where the core put it)."""
    text = str(e) or type(e).__name__
    code, peer = _code_of(e, timeout_code), getattr(e, "peer", -1)
    rank = comm.rank if comm is not None else rank
    if rank is not None:
        head = f"rank {rank}: "
        what = head + what
        text = text[len(head):] if text.startswith(head) else text
    if comm is not None:
        if code == Result.InvalidArgument and 0 <= peer != comm.rank and "could not register" in text:
            code = Result.RemoteError  # another rank's registration failed, not this rank's arguments
    _raise(comm, code, f"{what}: {text}", peer=peer, errno=getattr(e, "errno", 0) or 0, cause=e)


# ----------------------------------------------------------------------------- creation

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


# ----------------------------------------------------------------------------- the communicator

@dataclass(frozen=True)
class _Reg:
    """One registration: the mesh window and its size on every rank (from the core)."""

    window: Window

    @property
    def sizes(self) -> Tuple[int, ...]:
        return self.window.peer_sizes


def _is_int(v) -> bool:
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


def _ints(*values) -> tuple:
    """The arguments as ints (the common all-int case costs one pass)."""
    for v in values:
        if type(v) is not int:
            return tuple(_as_int(x) for x in values)
    return values


class Comm:
    """A communicator: FlagCX's one-sided calls over one :class:`flagcx_mesh.Mesh`.

    Made by :func:`comm_init_rank` / :func:`comm_init_from_env`, or ``Comm(mesh)`` to wrap
    a mesh you built (the communicator then owns it: :meth:`destroy` closes it). All
    operations are thread-safe; registrations are collective and must be made in the
    same order on every rank.
    """

    def __init__(self, mesh: Mesh, timeout: Optional[float] = None):
        self._mesh = mesh
        self.rank: int = mesh.rank
        self.nranks: int = mesh.nranks
        self._timeout = timeout
        self._regs: List[Optional[_Reg]] = []
        self._sig: Optional[_Reg] = None
        self._lock = threading.Lock()  # registrations: index order == collective order
        self._destroyed = False
        self._last_error = ""

    @property
    def mesh(self) -> Mesh:
        """The underlying :class:`flagcx_mesh.Mesh` (for send/recv, allgather, barrier)."""
        return self._mesh

    def get_last_error(self) -> str:
        """The message of this communicator's last failure, or ""."""
        return self._last_error

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else f"{len(self._regs)} window(s)"
        return f"<flagcx_mesh.compat.Comm rank {self.rank} of {self.nranks}, {state}>"

    # -- checks (failures only build text) ------------------------------------
    def _fail(self, code: Result, what: str, text: str, peer: int = -1):
        if peer >= 0 and "peer" not in what:
            what = f"{what}(peer {peer})"
        _raise(self, code, f"rank {self.rank}: {what}: {text}", peer=peer)

    def _check_live(self, what: str) -> None:
        if self._destroyed:
            self._fail(Result.InvalidUsage, what, "the communicator was destroyed")

    def _check_ints(self, what: str, peer: int = -1, **values) -> None:
        for name, v in values.items():
            if not _is_int(v) or not 0 <= v < _U64:
                self._fail(Result.InvalidArgument, what, f"{name} {v!r} is not an integer in [0, 2^64)", peer)

    def _check_peer(self, what: str, peer) -> None:
        self._check_live(what)
        if not _is_int(peer) or not 0 <= peer < self.nranks:
            self._fail(Result.InvalidArgument, what, f"peer {peer!r} out of range [0, {self.nranks})",
                       peer=peer if _is_int(peer) else -1)

    def _data(self, what: str, name: str, idx, peer: int = -1) -> _Reg:
        regs = self._regs
        reg = regs[idx] if _is_int(idx) and 0 <= idx < len(regs) else None
        if reg is None:
            why = "was deregistered" if _is_int(idx) and 0 <= idx < len(regs) else \
                f"is not registered ({len(regs)} window(s) registered)"
            code = Result.InvalidUsage if why.startswith("was") else Result.InvalidArgument
            self._fail(code, what, f"{name} {idx!r} {why}", peer)
        return reg

    def _range(self, what: str, name: str, off: int, size: int, idx: int, nbytes: int, whose: str,
               peer: int) -> None:
        if off + size > nbytes:
            self._fail(Result.InvalidArgument, what,
                       f"{name} {off} + size {size} exceeds window {idx} of {whose} ({nbytes} bytes)", peer)

    def _check_put(self, what: str, peer, src_off, dst_off, size, src_idx, dst_idx) -> Tuple[Window, Window]:
        self._check_peer(what, peer)
        self._check_ints(what, peer, src_off=src_off, dst_off=dst_off, size=size)
        src, dst = self._data(what, "src_idx", src_idx, peer), self._data(what, "dst_idx", dst_idx, peer)
        self._range(what, "src_off", src_off, size, src_idx, src.sizes[self.rank], f"rank {self.rank}", peer)
        self._range(what, "dst_off", dst_off, size, dst_idx, dst.sizes[peer], f"peer {peer}", peer)
        return src.window, dst.window

    def _slot(self, what: str, sig_off, rank: int) -> int:
        if self._sig is None:
            self._fail(Result.InvalidUsage, what, "no signal buffer: call signal_register() first")
        if not _is_int(sig_off) or sig_off < 0 or sig_off % SLOT_BYTES:
            self._fail(Result.InvalidArgument, what,
                       f"sig_off {sig_off!r} is not a non-negative multiple of {SLOT_BYTES} bytes")
        nbytes = self._sig.sizes[rank]
        if sig_off >= nbytes:
            whose = "this rank" if rank == self.rank else f"peer {rank}"
            self._fail(Result.InvalidArgument, what, f"sig_off {sig_off} (slot {sig_off // SLOT_BYTES}) "
                       f"is beyond the signal buffer of {whose} ({nbytes} bytes, "
                       f"{nbytes // SLOT_BYTES} slots)", -1 if rank == self.rank else rank)
        return sig_off // SLOT_BYTES

    # -- registration (collective) ----------------------------------------------
    def _refuse(self, what: str, code: Result, text: str):
        """Fails this rank's part of a registration while letting the other ranks fail at once."""
        message = f"rank {self.rank}: {what}: {text}"
        try:
            self._mesh._core.refuse_registration(message)
        except errors.MeshError:
            pass  # the expected outcome: every rank's registration fails, naming this rank
        self._fail(code, what, text)

    def _nbytes_of(self, what: str, obj) -> Optional[int]:
        """nbytes for an int argument, None for a buffer (host or CUDA memory)."""
        obj = _as_int(obj)
        if _is_int(obj):
            if obj <= 0:
                self._refuse(what, Result.InvalidArgument, f"size {obj} is not a positive number of bytes")
            return obj
        return None

    def _check_device_support(self, what: str, buffer) -> None:
        """Device memory without a CUDA driver: NotSupported, naming why the driver is missing."""
        try:
            on_device = _cuda.device_buffer(buffer, what) is not None
        except ValueError as e:
            self._refuse(what, Result.InvalidArgument, str(e))
        missing = on_device and _core.cuda_driver_error()
        if missing:
            self._refuse(what, Result.NotSupported, f"device memory cannot be registered: {missing}")

    def one_side_register(self, buffer) -> int:
        """Register a data window; returns its index (registration order, the same on every rank).

        Collective. ``buffer`` is any writable, C-contiguous buffer (numpy array, torch CPU
        or CUDA tensor, bytearray, ``__cuda_array_interface__`` / DLPack on a CUDA device),
        which must stay alive and unmoved until :meth:`destroy`; or an int: that many
        zero-filled bytes of library shared memory (fastest on one host), readable through
        :meth:`window_buffer`. Sizes may differ per rank. Without a CUDA driver a device
        tensor is refused with NotSupported naming why the driver is missing.
        """
        what = "one_side_register"
        self._check_live(what)
        with self._lock:
            nbytes = self._nbytes_of(what, buffer)
            self._check_device_support(what, buffer)
            try:
                win = self._mesh.alloc_window(nbytes) if nbytes is not None else self._mesh.register_window(buffer)
                reg = _Reg(win)
            except Exception as e:  # noqa: BLE001
                _translate(self, e, f"{what} (index {len(self._regs)})", Result.RemoteError)
            self._regs.append(reg)
            return len(self._regs) - 1

    def signal_register(self, buffer_or_nbytes) -> memoryview:
        """Register the signal buffer: ``nbytes // 8`` 64-bit slots, all 0. Collective, once.

        The slots live in library memory (shared with the ranks of this host, so a signal is
        one atomic add); a buffer argument only gives the size (its contents are neither read
        nor written). Returns a read-only view of this rank's slots (format ``'Q'``); prefer
        :meth:`read_signal` / :meth:`wait_signal`. ``nbytes`` must be a positive multiple of 8.
        """
        what = "signal_register"
        self._check_live(what)
        with self._lock:
            nbytes = self._nbytes_of(what, buffer_or_nbytes)
            if nbytes is None:
                try:
                    nbytes = memoryview(buffer_or_nbytes).nbytes
                except TypeError as e:
                    self._refuse(what, Result.InvalidArgument, f"not an int or a buffer: {e}")
            if self._sig is not None:
                self._refuse(what, Result.InvalidUsage, "a signal buffer is already registered (one per comm)")
            if nbytes <= 0 or nbytes % SLOT_BYTES:
                self._refuse(what, Result.InvalidArgument,
                             f"size {nbytes} is not a positive multiple of {SLOT_BYTES} bytes")
            try:
                win = self._mesh.signal_window(nbytes // SLOT_BYTES)
                self._sig = _Reg(win)
            except Exception as e:  # noqa: BLE001
                _translate(self, e, what, Result.RemoteError)
            return win.buffer.cast("B").cast("Q").toreadonly()

    def one_side_deregister(self, index: int) -> None:
        """Deregister data window ``index`` (collective; flushes first). Its index is not
        reused: later registrations keep counting, and ops naming it fail with InvalidUsage."""
        index = _as_int(index)
        what = f"one_side_deregister({index!r})"
        self._check_live(what)
        with self._lock:
            reg = self._data(what, "index", index)
            try:
                reg.window.close()
            except Exception as e:  # noqa: BLE001
                _translate(self, e, what, Result.RemoteError)
            self._regs[index] = None

    def window_buffer(self, index: int) -> memoryview:
        """This rank's bytes of data window ``index`` (the user's buffer, or library memory)."""
        return self._data(f"window_buffer({index!r})", "index", index).window.buffer

    def window_describe(self, index: int) -> str:
        """One line on data window ``index``: kind, size, and the path to each peer
        (self / shm / cma / tcp) with the reason whenever a preferred path was not taken."""
        return self._data(f"window_describe({index!r})", "index", index).window.describe()

    # -- one-sided operations -------------------------------------------------
    def put(self, peer: int, src_off: int, dst_off: int, size: int, src_idx: int, dst_idx: int,
            stream=None) -> None:
        """Copy ``size`` bytes from this rank's window ``src_idx`` at ``src_off`` into
        ``peer``'s window ``dst_idx`` at ``dst_off``. Non-blocking, FIFO per peer; the
        source must not change until the op completes (:meth:`flush` / :meth:`wait_counter`).
        With ``stream`` the op starts after that stream's earlier work, in its order."""
        peer, src_off, dst_off, size, src_idx, dst_idx = _ints(peer, src_off, dst_off, size, src_idx, dst_idx)
        s, d = self._check_put("put", peer, src_off, dst_off, size, src_idx, dst_idx)
        try:
            self._mesh.put(peer, s, src_off, d, dst_off, size, stream=stream)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, f"put(peer {peer}, src_idx {src_idx}, dst_idx {dst_idx})")

    def put_signal(self, peer: int, src_off: int, dst_off: int, size: int, sig_off: int,
                   src_idx: int, dst_idx: int, sig_val: int, stream=None) -> None:
        """Put, then ADD ``sig_val`` to ``peer``'s signal slot ``sig_off // 8``: the data is
        visible at the target before the slot changes. ``size`` 0 = signal only (the windows
        are not used); ``sig_val`` 0 = data only. Non-blocking, FIFO per peer; ``stream`` as in :meth:`put`
        (the slot changes once the stream's copy is done)."""
        what = "put_signal"
        peer, src_off, dst_off, size, sig_off, src_idx, dst_idx, sig_val = _ints(
            peer, src_off, dst_off, size, sig_off, src_idx, dst_idx, sig_val)
        if size == 0:
            return self.signal(peer, sig_off, sig_val, stream)
        s, d = self._check_put(what, peer, src_off, dst_off, size, src_idx, dst_idx)
        slot = self._slot(what, sig_off, peer)
        self._check_ints(what, peer, sig_val=sig_val)
        try:
            self._mesh.put_signal(peer, s, src_off, d, dst_off, size, slot, sig_val, signal_window=self._sig.window,
                                  stream=stream)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, f"put_signal(peer {peer}, sig_off {sig_off})")

    def signal(self, peer: int, sig_off: int, sig_val: int, stream=None) -> None:
        """ADD ``sig_val`` to ``peer``'s slot ``sig_off // 8``, after every earlier op to ``peer``
        (with ``stream``: also after that stream's earlier work)."""
        peer, sig_off, sig_val = _ints(peer, sig_off, sig_val)
        self._check_peer("signal", peer)
        slot = self._slot("signal", sig_off, peer)
        self._check_ints("signal", peer, sig_val=sig_val)
        try:
            self._mesh.signal(peer, slot, sig_val, signal_window=self._sig.window, stream=stream)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, f"signal(peer {peer}, sig_off {sig_off})")

    def wait_signal(self, peer: int, sig_off: int, expected: int, stream=None,
                    timeout: Optional[float] = None) -> None:
        """Block (GIL released) until this rank's slot ``sig_off // 8`` >= ``expected``.

        ``peer`` is the rank expected to signal (checked, and named in errors). A timeout
        raises ``InProgress`` naming the slot, the expected and current values and the last
        rank that signalled it; a lost peer raises ``RemoteError`` at once. With ``stream``
        (as ``flagcxWaitSignal``) the wait is queued on that CUDA stream and this returns
        at once."""
        peer, sig_off, expected = _ints(peer, sig_off, expected)
        what = f"wait_signal(peer {peer}, sig_off {sig_off}, expected {expected})"
        self._check_peer(what, peer)
        slot = self._slot(what, sig_off, self.rank)
        self._check_ints(what, expected=expected)
        try:
            self._mesh.wait_signal(slot, expected, timeout, window=self._sig.window, stream=stream)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, f"{what} on the signal buffer (slot {slot}), waiting for rank {peer}")

    def read_signal(self, sig_off: int) -> int:
        """This rank's current value of slot ``sig_off // 8``."""
        self._check_live("read_signal")
        slot = self._slot("read_signal", _as_int(sig_off), self.rank)
        return self._mesh.read_signal(slot, window=self._sig.window)

    def batch_put(self, peer: int, ops: Sequence[Sequence[int]], src_idx: int = 0, dst_idx: int = 0,
                  stream=None) -> None:
        """Several puts to ``peer``, FIFO: each op is ``(src_off, dst_off, size)`` (windows
        ``src_idx`` / ``dst_idx``) or ``(src_off, dst_off, size, src_idx, dst_idx)``. Every op
        is checked before any is issued; each counts once in :meth:`read_counter`."""
        peer = _as_int(peer)
        self._check_peer("batch_put", peer)
        ops = list(ops)
        groups = self._batch_groups(peer, ops, src_idx, dst_idx)
        try:
            for s, d, entries in groups:
                self._mesh.batch_put(peer, s, d, entries, stream=stream)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, f"batch_put(peer {peer}, {len(ops)} ops)")

    def _batch_groups(self, peer, ops, src_idx, dst_idx) -> List[Tuple[Window, Window, list]]:
        groups: List[Tuple[Window, Window, list]] = []
        for i, op in enumerate(ops):
            what = f"batch_put(peer {peer}) op {i}"
            if not isinstance(op, (tuple, list)) or len(op) not in (3, 5):
                self._fail(Result.InvalidArgument, what,
                           f"{op!r} is not (src_off, dst_off, size[, src_idx, dst_idx])", peer)
            so, do, n, si, di = _ints(*op) if len(op) == 5 else _ints(*op, src_idx, dst_idx)
            s, d = self._check_put(what, peer, so, do, n, si, di)
            if not groups or groups[-1][0] is not s or groups[-1][1] is not d:
                groups.append((s, d, []))
            groups[-1][2].append((so, do, n))
        return groups

    def flush(self, peer: Optional[int] = None, timeout: Optional[float] = None) -> None:
        """Block until every op issued to ``peer`` (default: every peer) completed at its target."""
        what = "flush" if peer is None else f"flush(peer {peer})"
        if peer is not None:
            peer = _as_int(peer)
            self._check_peer(what, peer)
        try:
            self._mesh.flush(peer, timeout)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, what)

    def read_counter(self) -> int:
        """How many one-sided ops (put, put_signal, signal, each batch_put op) issued by this
        rank have completed at their target."""
        self._check_live("read_counter")
        return self._mesh.read_counter()

    def wait_counter(self, target: int, timeout: Optional[float] = None) -> None:
        """Block until :meth:`read_counter` >= ``target``."""
        target = _as_int(target)
        what = f"wait_counter({target!r})"
        self._check_live(what)
        self._check_ints(what, target=target)
        try:
            self._mesh.wait_counter(target, timeout)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, what)

    # -- lifetime ----------------------------------------------------------------
    def destroy(self) -> None:
        """Close the communicator (every connection and window). Idempotent; also on ``with``
        exit. Ops blocked in other threads raise InvalidUsage; later calls too."""
        self._destroyed = True
        self._mesh.close()

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


__all__ = [
    "Result", "FlagcxError", "Comm", "get_unique_id", "comm_init_rank", "comm_init_from_env",
    "get_error_string", "get_last_error", "UNIQUE_ID_BYTES", "SLOT_BYTES",
] + [f"flagcx{r.name}" for r in Result]
