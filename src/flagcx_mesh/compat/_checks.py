"""The argument checks shared by compat's calls (failures only build text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from .._args import _as_int
from ..window import Window
from ._errors import _U64, SLOT_BYTES, Result, _raise


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


class _Checks:
    """What every part of :class:`Comm` checks its arguments with."""

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
