"""The mesh's one-sided side: windows registered collectively, and put / get / signal /
put-with-signal / flush / counters / signal waits on them (also on CUDA streams). A part of
:class:`flagcx_mesh.Mesh` (a mixin over its core)."""

from __future__ import annotations

from typing import Optional

from . import cuda as _cuda
from ._args import _as_int, _byte_view, _ints, _names_bad_ints
from ._timeouts import call_timeout
from .errors import InvalidArgument
from .window import SignalWindow, Window, WindowLike, index_of


class MeshOneSided:
    """Windows and one-sided ops of a mesh (``self._core``: the built mesh; ``self._default_signal``:
    the first signal window's index, or None)."""

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
