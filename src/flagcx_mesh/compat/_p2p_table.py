"""Absolute addresses to registered regions, for the P2P engine form (compat.p2p).

FlagCX's P2P engine addresses a write by absolute virtual addresses on both sides; flagcx_mesh's
agent addresses it by (region descriptor, offset). An :class:`AddressTable` holds one side's
registered ranges (this engine's own, or a peer's as its engine described them) and maps an
address range onto them: ``pieces(addr, size)`` is the list of (span, offset, length) covering
the range, through adjacent registrations when one ends where the next begins (FlagCX checks
ranges against merged contiguous registrations too), or None when some byte of it lies in no
registered range.

The peer's table travels in the engine's control messages (agent notifications), framed here:
``MAGIC kind request-id payload`` with kind ``Q`` (asks for the table), ``T`` (the table) or
``N`` (a refusal, payload: why). A table is a count and, per range, base, size and the agent
region descriptor. Decoding refuses anything malformed (ValueError); it never evaluates data.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

MAGIC = b"FXP2P\x01"
REQUEST, TABLE, REFUSAL = b"Q", b"T", b"N"
RID_BYTES = 8
MAX_RANGES = 65536          # as FlagCX's handshake bounds a peer's table
MAX_DESCRIPTOR_BYTES = 4096
_ENTRY = struct.Struct("<QQI")
_COUNT = struct.Struct("<I")
_HEAD = len(MAGIC) + 1 + RID_BYTES


@dataclass(frozen=True)
class Span:
    """One registered range: [base, base + size), the agent region's descriptor and, on the
    owner's side, its memory registration id and Region (None for a peer's range)."""

    base: int
    size: int
    descriptor: bytes
    mr_id: int = -1
    region: object = field(default=None, compare=False)

    @property
    def end(self) -> int:
        return self.base + self.size


Piece = Tuple[Span, int, int]  # (span, offset in it, length)


class AddressTable:
    """Registered ranges sorted by base; they never overlap (the owner refuses an overlap before
    ``add``). Readers need no lock: ``add`` replaces the sorted lists in one assignment."""

    def __init__(self, spans: Sequence[Span] = ()):
        ordered = sorted(spans, key=lambda s: s.base)
        self._state: Tuple[List[int], List[Span]] = ([s.base for s in ordered], ordered)
        self._arrays = None  # (state, bases, last bytes) as numpy arrays, made by locate_all

    def __len__(self) -> int:
        return len(self._state[1])

    def spans(self) -> List[Span]:
        return list(self._state[1])

    def overlapping(self, base: int, size: int) -> Optional[Span]:
        """The first registered range sharing a byte with [base, base + size), or None."""
        bases, spans = self._state
        i = bisect.bisect_right(bases, base) - 1
        for s in spans[max(i, 0):]:
            if s.base >= base + size:
                return None
            if s.end > base:
                return s
        return None

    def add(self, span: Span) -> None:
        bases, spans = self._state
        i = bisect.bisect_right(bases, span.base)
        self._state = (bases[:i] + [span.base] + bases[i:], spans[:i] + [span] + spans[i:])

    def locate(self, addr: int, size: int) -> Optional[Tuple[bytes, int]]:
        """(descriptor, offset) when [addr, addr + size) lies in one range (size > 0), else None."""
        bases, spans = self._state
        i = bisect.bisect_right(bases, addr) - 1
        if i >= 0:
            s = spans[i]
            if addr + size <= s.base + s.size:
                return s.descriptor, addr - s.base
        return None

    def locate_all(self, addrs, sizes):
        """(spans, indices into them, offsets), the last two numpy int64 arrays, when every
        [addrs[i], addrs[i] + sizes[i]) lies in one range; None when some does not (``pieces``
        then tells, one entry at a time). ``spans`` is the list the indices name (the table as it
        was for this call, whatever ``add`` does meanwhile).
        ``addrs`` and ``sizes`` are numpy uint64 arrays of one length, every size > 0."""
        import numpy as np

        state = self._state
        if self._arrays is None or self._arrays[0] is not state:
            bases = np.array(state[0], dtype=np.uint64)
            lasts = np.array([s.end - 1 for s in state[1]], dtype=np.uint64)  # end may be 2^64
            self._arrays = (state, bases, lasts)
        _, bases, lasts = self._arrays
        if len(bases) == 0:
            return None
        index = np.searchsorted(bases, addrs, side="right").astype(np.int64) - 1
        if (index < 0).any():
            return None
        ends = addrs + (sizes - np.uint64(1))  # the last byte; wraps past 2^64 when too large
        if (ends < addrs).any() or (ends > lasts[index]).any():
            return None
        return state[1], index, (addrs - bases[index]).astype(np.int64)

    def pieces(self, addr: int, size: int) -> Optional[List[Piece]]:
        """(span, offset, length) covering [addr, addr + size) in address order, or None."""
        bases, spans = self._state
        i = bisect.bisect_right(bases, addr) - 1
        if i < 0:
            return None
        out: List[Piece] = []
        at, end = addr, addr + size
        while at < end:
            if i >= len(spans):
                return None
            s = spans[i]
            if not s.base <= at < s.end:
                return None
            n = min(end, s.end) - at
            out.append((s, at - s.base, n))
            at += n
            i += 1
        return out


def pair_pieces(local: List[Piece], remote: List[Piece]) -> List[tuple]:
    """Agent ops (local desc, local offset, remote desc, remote offset, size) for one write whose
    source and destination ranges were cut into pieces at different boundaries."""
    ops, li, ri = [], 0, 0
    lspan, loff, lleft = local[0]
    rspan, roff, rleft = remote[0]
    while True:
        n = min(lleft, rleft)
        ops.append((lspan.descriptor, loff, rspan.descriptor, roff, n))
        loff, lleft, roff, rleft = loff + n, lleft - n, roff + n, rleft - n
        if lleft == 0:
            li += 1
            if li == len(local):
                return ops
            lspan, loff, lleft = local[li]
        if rleft == 0:
            ri += 1
            rspan, roff, rleft = remote[ri]


def encode_request(rid: bytes) -> bytes:
    return MAGIC + REQUEST + rid


def encode_refusal(rid: bytes, why: str) -> bytes:
    return MAGIC + REFUSAL + rid + why.encode("utf-8", "replace")


def encode_table(rid: bytes, spans: Sequence[Span]) -> bytes:
    parts = [MAGIC, TABLE, rid, _COUNT.pack(len(spans))]
    for s in spans:
        parts += [_ENTRY.pack(s.base, s.size, len(s.descriptor)), s.descriptor]
    return b"".join(parts)


def parse(data: bytes) -> Optional[Tuple[bytes, bytes, bytes]]:
    """(kind, request id, payload) of a control message, or None for any other bytes."""
    if len(data) < _HEAD or not data.startswith(MAGIC):
        return None
    kind = data[len(MAGIC):len(MAGIC) + 1]
    if kind not in (REQUEST, TABLE, REFUSAL):
        return None
    return kind, data[len(MAGIC) + 1:_HEAD], data[_HEAD:]


def decode_table(payload: bytes) -> List[Span]:
    """The ranges of a TABLE payload; ValueError naming what is wrong with malformed bytes."""
    if len(payload) < _COUNT.size:
        raise ValueError("the region table is truncated (no count)")
    (count,) = _COUNT.unpack_from(payload)
    if count > MAX_RANGES:
        raise ValueError(f"the region table has {count} ranges (at most {MAX_RANGES})")
    at, out = _COUNT.size, []
    for i in range(count):
        if at + _ENTRY.size > len(payload):
            raise ValueError(f"the region table is truncated at range {i} of {count}")
        base, size, dlen = _ENTRY.unpack_from(payload, at)
        at += _ENTRY.size
        if dlen > MAX_DESCRIPTOR_BYTES or at + dlen > len(payload):
            raise ValueError(f"range {i} of the region table has a bad descriptor length {dlen}")
        if size == 0 or base + size > 1 << 64:
            raise ValueError(f"range {i} of the region table ({base:#x}, {size} bytes) is empty or wraps")
        out.append(Span(base, size, bytes(payload[at:at + dlen])))
        at += dlen
    if at != len(payload):
        raise ValueError(f"{len(payload) - at} stray bytes after the region table")
    return out
