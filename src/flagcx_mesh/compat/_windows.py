"""The window- and stream-based forms of ``flagcx.h`` at FlagCX 0c721293, get and barrier.

FlagCX's header declares, beside the offset/index calls its Python wrapper binds:
``flagcxCommWindowRegister(comm, buff, size, &win, winFlags)``,
``flagcxPutSignal(localbuff, count, datatype, peer, peerWin, peerWinOffset, flags, comm, stream)``,
``flagcxSignal(peer, flags, comm, stream)``,
``flagcxWaitSignal(nDesc, descs, comm, stream)`` (``{opCnt, peer}`` descriptors),
``flagcxGet(comm, peer, srcOffset, dstOffset, size, srcMrIdx, dstMrIdx)`` and
``flagcxBarrier(comm, stream)``. In the window forms a sender always adds 1 to ITS OWN slot
(its rank) in the target's signal buffer, so a receiver waits per sender.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from typing import Optional, Sequence

from .. import cuda as _cuda
from .._args import _as_int
from ._checks import _Checks, _is_int, _ints
from ._errors import SLOT_BYTES, Result, _translate

FLAGCX_WIN_DEFAULT = 0x00
FLAGCX_WIN_COLL_SYMMETRIC = 0x01


class DataType(enum.IntEnum):
    """``flagcxDataType_t`` (FlagCX 0c721293), same values; aliases as in the header."""

    Int8 = 0
    Char = 0
    Uint8 = 1
    Int32 = 2
    Int = 2
    Uint32 = 3
    Int64 = 4
    Uint64 = 5
    Float16 = 6
    Half = 6
    Float32 = 7
    Float = 7
    Float64 = 8
    Double = 8
    Bfloat16 = 9


_DTYPE_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}


@dataclass(frozen=True)
class CommWindow:
    """A window from :meth:`Comm.comm_window_register` (FlagCX's ``flagcxWindow_t``): ``index``
    is its data-window index (the same on every rank, usable with the offset forms too),
    ``nbytes`` this rank's size, ``flags`` the ``winFlags`` it was registered with."""

    index: int
    nbytes: int
    flags: int


def _address_of(obj, what: str) -> int:
    """The address of ``localbuff``: an int, a CUDA buffer, or a writable host buffer."""
    obj = _as_int(obj)
    if _is_int(obj):
        return obj
    dev = _cuda.device_buffer(obj, what)
    if dev is not None:
        return dev.ptr
    data = getattr(obj, "data_ptr", None)  # a torch CPU tensor
    if callable(data):
        return int(data())
    iface = getattr(obj, "__array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(obj).cast("B")))


class _WindowForms(_Checks):
    """Comm's window/stream forms, get and barrier (see the module's text)."""

    def get(self, peer: int, src_off: int, dst_off: int, size: int, src_idx: int, dst_idx: int,
            stream=None) -> None:
        """Copy ``size`` bytes from ``peer``'s window ``src_idx`` at ``src_off`` into this rank's
        window ``dst_idx`` at ``dst_off`` (``flagcxGet``). Non-blocking: the bytes are there once
        :meth:`flush` returns (or :meth:`wait_counter` counts it); with ``stream``, for that
        stream's later work."""
        what = "get"
        peer, src_off, dst_off, size, src_idx, dst_idx = _ints(peer, src_off, dst_off, size, src_idx, dst_idx)
        self._check_peer(what, peer)
        self._check_ints(what, peer, src_off=src_off, dst_off=dst_off, size=size)
        src, dst = self._data(what, "src_idx", src_idx, peer), self._data(what, "dst_idx", dst_idx, peer)
        self._range(what, "src_off", src_off, size, src_idx, src.sizes[peer], f"peer {peer}", peer)
        self._range(what, "dst_off", dst_off, size, dst_idx, dst.sizes[self.rank], f"rank {self.rank}", peer)
        try:
            self._mesh.get(peer, src.window, src_off, dst.window, dst_off, size, stream=stream)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, f"get(peer {peer}, src_idx {src_idx}, dst_idx {dst_idx})")

    def barrier(self, stream=None, timeout: Optional[float] = None) -> None:
        """Block until every rank reached the barrier (``flagcxBarrier``). Collective. The barrier
        runs on the host: ``stream`` is accepted for FlagCX's signature and not waited on."""
        self._check_live("barrier")
        try:
            self._mesh.barrier(self._timeout if timeout is None else timeout)
        except Exception as e:  # noqa: BLE001
            _translate(self, e, "barrier", Result.RemoteError)

    def comm_window_register(self, buffer, win_flags: int = FLAGCX_WIN_COLL_SYMMETRIC) -> CommWindow:
        """Register ``buffer`` as a window (``flagcxCommWindowRegister``); collective, like
        :meth:`one_side_register` (which it calls: the window is also data window
        ``.index``). ``win_flags`` must include ``FLAGCX_WIN_COLL_SYMMETRIC``: FlagCX makes no
        window without it, so every rank's registration is refused with InvalidArgument."""
        what = "comm_window_register"
        self._check_live(what)
        flags = _as_int(win_flags)
        if not _is_int(flags) or not flags & FLAGCX_WIN_COLL_SYMMETRIC:
            with self._lock:
                self._refuse(what, Result.InvalidArgument, f"win_flags {win_flags!r} lacks FLAGCX_WIN_COLL_SYMMETRIC "
                             "(FlagCX registers no one-sided window without it)")
        index = self.one_side_register(buffer)
        return CommWindow(index, self._regs[index].sizes[self.rank], flags)

    def comm_window_deregister(self, win: Optional[CommWindow]) -> None:
        """Deregister a window (``flagcxCommWindowDeregister``; collective). ``None`` is a no-op."""
        if win is not None:
            self.one_side_deregister(self._window(f"comm_window_deregister({win!r})", win).index)

    def _window(self, what: str, win, peer: int = -1) -> CommWindow:
        if not isinstance(win, CommWindow):
            self._fail(Result.InvalidArgument, what, f"{win!r} is not a window from comm_window_register()", peer)
        return win

    def _local_source(self, what: str, localbuff, nbytes: int, peer: int):
        """(window index, offset) of ``localbuff`` among this rank's data windows."""
        try:
            addr = _address_of(localbuff, what)
        except (TypeError, ValueError, BufferError) as e:
            self._fail(Result.InvalidArgument, what, f"localbuff: {e}", peer)
        for i, reg in enumerate(self._regs):
            if reg is not None and reg.window._address <= addr < reg.window._address + reg.sizes[self.rank]:
                off = addr - reg.window._address
                self._range(what, "localbuff offset", off, nbytes, i, reg.sizes[self.rank], f"rank {self.rank}", peer)
                return i, off
        self._fail(Result.InvalidArgument, what, f"localbuff {addr:#x} is in no registered window of this rank", peer)

    def put_signal_window(self, localbuff, count: int, datatype: int, peer: int, peer_win: CommWindow,
                          peer_win_offset: int, flags: int = 0, stream=None) -> None:
        """``flagcxPutSignal``: write ``count`` elements of ``datatype`` from ``localbuff`` (an
        address or buffer inside a registered window of this rank) to ``peer``'s window
        ``peer_win`` at byte ``peer_win_offset``, then add 1 to slot ``self.rank`` of ``peer``'s
        signal buffer. ``count`` 0: the signal only. ``flags`` is reserved (0)."""
        what = "put_signal_window"
        peer, count, peer_win_offset = _ints(peer, count, peer_win_offset)
        self._check_peer(what, peer)
        self._check_ints(what, peer, count=count, peer_win_offset=peer_win_offset)
        dtype = _as_int(datatype)
        if dtype not in _DTYPE_BYTES:
            self._fail(Result.InvalidArgument, what, f"datatype {datatype!r} is not a flagcxDataType_t (0..9)", peer)
        win = self._window(what, peer_win, peer)
        self._data(what, "peer_win's index", win.index, peer)  # deregistered: InvalidUsage
        if count == 0:
            return self.signal_peer(peer, flags, stream)
        size = count * _DTYPE_BYTES[dtype]
        src_idx, src_off = self._local_source(what, localbuff, size, peer)
        self._check_put(what, peer, src_off, peer_win_offset, size, src_idx, win.index)
        self.put_signal(peer, src_off, peer_win_offset, size, self.rank * SLOT_BYTES, src_idx, win.index, 1,
                        stream=stream)

    def signal_peer(self, peer: int, flags: int = 0, stream=None) -> None:
        """``flagcxSignal``: add 1 to slot ``self.rank`` of ``peer``'s signal buffer, after every
        earlier op to ``peer`` (with ``stream``: after that stream's earlier work). ``flags``: 0."""
        peer = _as_int(peer)
        self._check_peer("signal_peer", peer)
        self.signal(peer, self.rank * SLOT_BYTES, 1, stream)

    def wait_signals(self, descs: Sequence, stream=None, timeout: Optional[float] = None) -> None:
        """``flagcxWaitSignal``: for each descriptor ``(op_cnt, peer)`` (or a mapping with
        ``opCnt`` and ``peer``, FlagCX's field names), wait until slot ``peer`` of this rank's
        signal buffer reached ``op_cnt``, i.e. ``peer`` sent that many put_signal_window /
        signal_peer calls. An empty sequence is a no-op. With ``stream`` each wait is queued on
        that stream and this returns at once (FlagCX requires a stream; without one this waits
        on the host)."""
        for i, d in enumerate(descs):
            try:
                op_cnt, peer = (d["opCnt"], d["peer"]) if hasattr(d, "keys") else tuple(d)
            except (TypeError, ValueError, KeyError):
                self._fail(Result.InvalidArgument, "wait_signals", f"descriptor {i} {d!r} is not (op_cnt, peer)")
            peer = _as_int(peer)
            self._check_peer(f"wait_signals descriptor {i}", peer)
            self.wait_signal(peer, peer * SLOT_BYTES, op_cnt, stream=stream, timeout=timeout)
