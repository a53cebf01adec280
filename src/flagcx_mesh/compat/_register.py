"""Collective registration of data windows and the signal buffer."""

from __future__ import annotations

from typing import Optional

from .. import _core, errors
from .. import cuda as _cuda
from .._args import _as_int
from ._checks import _Checks, _is_int, _Reg
from ._errors import SLOT_BYTES, Result, _translate


class _Registration(_Checks):
    """Comm's collective registrations (the index order is the same on every rank)."""

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
