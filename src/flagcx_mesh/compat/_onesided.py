"""The one-sided operations of the wrapper's (offset and window index) form."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .._args import _as_int
from ..window import Window
from ._checks import _Checks, _ints
from ._errors import Result, _translate


class _OneSided(_Checks):
    """put, put_signal, signal, wait_signal, batch_put, flush and the counter."""

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
